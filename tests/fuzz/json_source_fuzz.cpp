// json_source_fuzz.cpp — the position-recording JSON reader of model files (io::JsonSource) on
// arbitrary text, checked against nlohmann's own parser: whatever JsonSource accepts, nlohmann
// accepts too and reads as the same document (when no key is given twice: then JsonSource keeps
// the second value by its contract), and every position it records lies inside the text.
// Bad input must end in towers::Error; any other exception, a crash or a sanitizer report is a
// bug.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "core/check.h"
#include "io/json_source.h"

namespace {

using towers::io::JsonSource;
using towers::io::TextPos;

int64_t lines_of(std::string_view text) {
  int64_t n = 1;
  for (char c : text) n += c == '\n';
  return n;
}

// Every value and key of the document, by pointer: its recorded position is in the text.
void check_positions(const JsonSource& doc, const nlohmann::json& v, const std::string& ptr,
                     int64_t lines, size_t bytes) {
  for (const TextPos p : {doc.value_pos(ptr), doc.key_pos(ptr)})
    if (p.line < 1 || p.line > lines || p.column < 1 || static_cast<size_t>(p.column) > bytes + 1)
      __builtin_trap();
  if (v.is_object())
    for (const auto& [k, child] : v.items())
      check_positions(doc, child, JsonSource::child(ptr, k), lines, bytes);
  else if (v.is_array())
    for (size_t i = 0; i < v.size(); ++i)
      check_positions(doc, v[i], JsonSource::child(ptr, i), lines, bytes);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    const JsonSource doc = JsonSource::parse(text, "fuzz.json");
    nlohmann::json reference;
    try {
      reference = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception&) {
      __builtin_trap();  // JsonSource accepted what strict JSON does not
    }
    if (doc.duplicate_keys().empty() && reference != doc.root()) __builtin_trap();
    check_positions(doc, doc.root(), "", lines_of(text), size);
  } catch (const towers::Error&) {
  }
  return 0;
}
