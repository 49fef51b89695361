// safetensors.h — a small reader and writer of the safetensors format (F32 only), so any
// safetensors reader (Python's included) opens what towers writes (DESIGN.md, decision 8).
//
// File layout: u64 little-endian header length N | N bytes of UTF-8 JSON, padded with spaces to
// a multiple of 8 | data section. The JSON maps each tensor name to
// {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]} (bytes, relative to the data
// section) and "__metadata__" to a string -> string map.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "core/tensor.h"

namespace towers::io {

using Metadata = std::map<std::string, std::string>;

// A tensor to write: numel(shape) row-major floats at `data` (may be null when numel is 0).
struct TensorView {
  std::string name;
  Shape shape;
  const float* data = nullptr;
};

// Writes `tensors` (in the given order, contiguous, no gaps: the data section is their bytes
// back to back) and `metadata` to `path`, atomically: the bytes go to `<path>.tmp-<pid>` in the
// same directory, are fsynced, renamed over `path`, and the directory is fsynced. On failure the
// temporary file is removed, `path` is untouched, and towers::Error names the file and the cause.
void write_safetensors(const std::string& path, const std::vector<TensorView>& tensors,
                       const Metadata& metadata);

// One tensor of a file read back. Offsets are bytes relative to the data section.
struct TensorEntry {
  std::string name;
  Shape shape;
  int64_t begin = 0;
  int64_t end = 0;
};

struct SafetensorsHeader {
  std::vector<TensorEntry> tensors;  // sorted by data offset (file order)
  Metadata metadata;
  int64_t data_offset = 0;  // where the data section starts in the file
  int64_t data_size = 0;    // bytes from data_offset to the end of the file

  const TensorEntry* find(const std::string& name) const;  // null when absent
};

// Reads and validates the header only: the file exists and is a regular file of at least 8 bytes,
// the header length is within the file and below 100 MB, the header is a JSON object of the
// shape above, every dtype is F32, every tensor's offsets lie within the data section and span
// numel * 4 bytes, and no two tensors overlap. Each failure throws towers::Error naming the file.
SafetensorsHeader read_safetensors_header(const std::string& path);

struct SafetensorsFile {
  SafetensorsHeader header;
  std::vector<unsigned char> data;  // the whole data section (header.data_size bytes)

  // Copies the tensor's numel floats to `out`.
  void copy_to(const TensorEntry& tensor, float* out) const;
};

// read_safetensors_header, then the data section.
SafetensorsFile read_safetensors(const std::string& path);

// JSON read from a file has no value inside more than this many arrays and objects: nlohmann's
// dump (error messages print values) recurses once per level, and a file of a million '[' would
// overflow the stack.
inline constexpr int kMaxJsonDepth = 64;

// Parses JSON text read from a file. Throws towers::Error "<what> is not valid JSON" or "<what>
// nests arrays and objects more than 64 deep"; `what` names the file and the part of it.
nlohmann::json parse_file_json(const std::string& text, const std::string& what);

}  // namespace towers::io
