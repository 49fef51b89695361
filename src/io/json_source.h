// json_source.h — JSON text from a user's file, parsed with the place (line, column) of every
// value and key, so that an error can point into the file. nlohmann's DOM keeps no positions;
// JsonSource reads the text through nlohmann's SAX interface, builds the DOM itself and records
// where each value and key starts, by JSON pointer ("/layers/3/kernel").
//   JsonSource doc = JsonSource::parse(text, "net.json");
//   doc.root()["layers"][3]["kernel"]                  the value
//   doc.where(JsonSource::child("/layers/3", "kernel"))  "net.json:12:17"
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace towers::io {

struct TextPos {
  int64_t line = 1, column = 1;  // 1-based; the column counts bytes
};

class JsonSource {
 public:
  // A key given twice in one object: the DOM keeps the second value, and the caller decides.
  struct DuplicateKey {
    std::string object;  // pointer of the object
    std::string key;
    TextPos first, second;
  };

  // Parses text (strict JSON: no comments, nothing after the value). A syntax error, or
  // nesting deeper than max_depth, throws towers::Error "<file>:<line>:<column>: ...".
  static JsonSource parse(std::string_view text, const std::string& file, int max_depth = 64);

  const nlohmann::json& root() const { return root_; }
  const std::string& file() const { return file_; }
  // Where the value at pointer starts, or the start of the file for a pointer not in the text.
  TextPos value_pos(const std::string& pointer) const;
  // Where the key of the object member at pointer starts; value_pos for other values.
  TextPos key_pos(const std::string& pointer) const;
  // "<file>:<line>:<column>" of a position.
  std::string where(TextPos p) const;
  // The keys given twice, in the order they were met.
  const std::vector<DuplicateKey>& duplicate_keys() const { return duplicates_; }

  // JSON pointers of a member and of an element (RFC 6901: '~' and '/' in keys are escaped).
  static std::string child(const std::string& pointer, std::string_view key);
  static std::string child(const std::string& pointer, size_t index);

 private:
  friend class PositionRecorder;

  std::string file_;
  nlohmann::json root_;
  std::map<std::string, TextPos> values_, keys_;
  std::vector<DuplicateKey> duplicates_;
};

}  // namespace towers::io
