// safetensors_fuzz.cpp — the safetensors reader on an arbitrary file: the header alone
// (read_safetensors_header, as `towers eval` reads it first), then header and data section
// (read_safetensors), and every tensor copied out as a caller would.
// Bad input must end in towers::Error; any other exception, a crash or a sanitizer report is a
// bug, and so is an allocation beyond the run's -malloc_limit_mb, whatever the header claims.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/check.h"
#include "fuzz_input.h"
#include "io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static towers::fuzz::ScratchFile file("model.safetensors");
  const std::string& path = file.write(towers::fuzz::as_bytes(data, size));
  try {
    const towers::io::SafetensorsHeader header = towers::io::read_safetensors_header(path);
    const towers::io::SafetensorsFile f = towers::io::read_safetensors(path);
    if (f.header.tensors.size() != header.tensors.size() ||
        f.data.size() != static_cast<size_t>(f.header.data_size) ||
        f.header.data_offset + f.header.data_size != static_cast<int64_t>(size))
      __builtin_trap();
    for (const towers::io::TensorEntry& t : f.header.tensors) {
      // The reader promises end - begin == numel(shape) * 4 bytes within the data section.
      if (t.begin < 0 || t.end < t.begin || t.end > f.header.data_size ||
          (t.end - t.begin) != towers::numel(t.shape) * 4 || f.header.find(t.name) == nullptr)
        __builtin_trap();
      std::vector<float> out(static_cast<size_t>(t.end - t.begin) / sizeof(float));
      f.copy_to(t, out.data());
    }
  } catch (const towers::Error&) {
  }
  return 0;
}
