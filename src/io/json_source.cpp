#include "io/json_source.h"

#include <algorithm>
#include <cstddef>
#include <iterator>

#include <fmt/format.h>

#include "core/check.h"

namespace towers::io {

using nlohmann::json;

namespace {

// A char iterator over the text that notes the offset of the last character the parser read.
// nlohmann's lexer reads one character at a time, so when a SAX event arrives this offset is the
// last character of the event's token (or, after a number, the one character looked ahead).
class TrackingIterator {
 public:
  using iterator_category = std::forward_iterator_tag;
  using value_type = char;
  using difference_type = std::ptrdiff_t;
  using pointer = const char*;
  using reference = const char&;

  TrackingIterator() = default;
  TrackingIterator(const char* p, const char* begin, size_t* last)
      : p_(p), begin_(begin), last_(last) {}
  reference operator*() const {
    *last_ = static_cast<size_t>(p_ - begin_);
    return *p_;
  }
  TrackingIterator& operator++() {
    ++p_;
    return *this;
  }
  TrackingIterator operator++(int) {
    TrackingIterator t = *this;
    ++p_;
    return t;
  }
  bool operator==(const TrackingIterator& o) const { return p_ == o.p_; }
  bool operator!=(const TrackingIterator& o) const { return p_ != o.p_; }

 private:
  const char* p_ = nullptr;
  const char* begin_ = nullptr;
  size_t* last_ = nullptr;
};

bool is_number_char(char c) {
  return (c >= '0' && c <= '9') || c == '-' || c == '+' || c == '.' || c == 'e' || c == 'E';
}

// The opening quote of the string whose closing quote is at `end`: the nearest '"' before it
// that is not escaped (preceded by an even number of backslashes).
size_t string_start(std::string_view text, size_t end) {
  for (size_t i = end; i-- > 0;) {
    if (text[i] != '"') continue;
    size_t slashes = 0;
    while (slashes < i && text[i - 1 - slashes] == '\\') ++slashes;
    if (slashes % 2 == 0) return i;
  }
  return 0;
}

// The first character of the number that ends at `last` or just before it (the lookahead).
size_t number_start(std::string_view text, size_t last) {
  size_t i = last;
  if (i > 0 && (i >= text.size() || !is_number_char(text[i]))) --i;
  while (i > 0 && is_number_char(text[i - 1])) --i;
  return i;
}

// Line and column of a byte offset, by binary search over the line starts.
class LineIndex {
 public:
  explicit LineIndex(std::string_view text) : size_(text.size()) {
    starts_.push_back(0);
    for (size_t i = 0; i < text.size(); ++i)
      if (text[i] == '\n') starts_.push_back(i + 1);
  }
  TextPos operator()(size_t offset) const {
    offset = std::min(offset, size_);
    const auto next = std::upper_bound(starts_.begin(), starts_.end(), offset);
    const size_t line = static_cast<size_t>(next - starts_.begin());  // >= 1
    return {static_cast<int64_t>(line), static_cast<int64_t>(offset - starts_[line - 1]) + 1};
  }

 private:
  std::vector<size_t> starts_;
  size_t size_;
};

// nlohmann's message without its "[json.exception...] parse error at line L, column C: " prefix.
std::string syntax_message(const std::string& what) {
  const size_t col = what.find("column ");
  const size_t colon = col == std::string::npos ? what.find("]: ") : what.find(": ", col);
  if (colon == std::string::npos) return what;
  return what.substr(colon + 2);
}

}  // namespace

// The SAX handler: builds the DOM and records where every value and key starts.
class PositionRecorder {
 public:
  PositionRecorder(JsonSource& doc, std::string_view text, const size_t& last, int max_depth)
      : doc_(doc), text_(text), lines_(text), last_(last), max_depth_(max_depth) {}

  bool null() { return put(nullptr, last_ + 1 - 4); }
  bool boolean(bool v) { return put(v, last_ + 1 - (v ? 4 : 5)); }
  bool number_integer(json::number_integer_t v) { return put(v, number_start(text_, last_)); }
  bool number_unsigned(json::number_unsigned_t v) { return put(v, number_start(text_, last_)); }
  bool number_float(json::number_float_t v, const std::string&) {
    return put(v, number_start(text_, last_));
  }
  bool string(std::string& v) { return put(std::move(v), string_start(text_, last_)); }
  bool binary(json::binary_t&) { return false; }  // not produced by the JSON parser

  bool start_object(size_t) { return open(json::object()); }
  bool start_array(size_t) { return open(json::array()); }
  bool end_object() { return close(); }
  bool end_array() { return close(); }

  bool key(std::string& k) {
    Frame& f = stack_.back();
    const TextPos at = lines_(string_start(text_, last_));
    const std::string ptr = JsonSource::child(f.pointer, k);
    if (f.node->contains(k))
      doc_.duplicates_.push_back({f.pointer, k, doc_.keys_.at(ptr), at});
    else
      doc_.keys_[ptr] = at;
    f.key = std::move(k);
    return true;
  }

  // Points at the start of the offending token where the text shows it (the parser may have
  // read one character past a number), else at the last character read.
  bool parse_error(size_t, const std::string& token, const nlohmann::detail::exception& ex) {
    size_t at = last_;
    for (size_t end : {last_ + 1, last_})
      if (!token.empty() && end >= token.size() && end <= text_.size() &&
          text_.substr(end - token.size(), token.size()) == token) {
        at = end - token.size();
        break;
      }
    TOWERS_BAD_INPUT("{}: JSON syntax error: {}", doc_.where(lines_(at)),
                     syntax_message(ex.what()));
  }

 private:
  struct Frame {
    json* node;
    std::string pointer;
    std::string key;  // the member being read (objects)
  };

  // Places v as the next value (the root, an array's next element or the current member) and
  // returns where it now lives, with its pointer.
  json* place(json v, size_t start, std::string* pointer) {
    const TextPos at = lines_(start);
    json* slot = nullptr;
    if (stack_.empty()) {
      pointer->clear();
      doc_.root_ = std::move(v);
      slot = &doc_.root_;
    } else if (Frame& f = stack_.back(); f.node->is_array()) {
      *pointer = JsonSource::child(f.pointer, f.node->size());
      f.node->push_back(std::move(v));
      slot = &f.node->back();
    } else {
      *pointer = JsonSource::child(f.pointer, f.key);
      slot = &(*f.node)[f.key];
      *slot = std::move(v);
    }
    doc_.values_[*pointer] = at;
    return slot;
  }

  bool put(json v, size_t start) {
    std::string pointer;
    place(std::move(v), start, &pointer);
    return true;
  }

  bool open(json container) {
    if (static_cast<int>(stack_.size()) >= max_depth_)
      TOWERS_BAD_INPUT("{}: JSON nested deeper than {} levels", doc_.where(lines_(last_)),
                       max_depth_);
    std::string pointer;
    json* slot = place(std::move(container), last_, &pointer);
    stack_.push_back({slot, std::move(pointer), {}});
    return true;
  }

  bool close() {
    stack_.pop_back();
    return true;
  }

  JsonSource& doc_;
  std::string_view text_;
  LineIndex lines_;
  const size_t& last_;
  int max_depth_;
  std::vector<Frame> stack_;
};

JsonSource JsonSource::parse(std::string_view text, const std::string& file, int max_depth) {
  JsonSource doc;
  doc.file_ = file;
  size_t last = 0;
  PositionRecorder recorder(doc, text, last, max_depth);
  const char* b = text.data();
  json::sax_parse(TrackingIterator(b, b, &last), TrackingIterator(b + text.size(), b, &last),
                  &recorder, json::input_format_t::json, /*strict=*/true);
  return doc;
}

TextPos JsonSource::value_pos(const std::string& pointer) const {
  auto it = values_.find(pointer);
  return it == values_.end() ? TextPos{} : it->second;
}

TextPos JsonSource::key_pos(const std::string& pointer) const {
  auto it = keys_.find(pointer);
  return it == keys_.end() ? value_pos(pointer) : it->second;
}

std::string JsonSource::where(TextPos p) const {
  return fmt::format("{}:{}:{}", file_, p.line, p.column);
}

std::string JsonSource::child(const std::string& pointer, std::string_view key) {
  std::string out = pointer + "/";
  for (char c : key) {
    if (c == '~')
      out += "~0";
    else if (c == '/')
      out += "~1";
    else
      out += c;
  }
  return out;
}

std::string JsonSource::child(const std::string& pointer, size_t index) {
  return fmt::format("{}/{}", pointer, index);
}

}  // namespace towers::io
