// idx_fuzz.cpp — read_idx_pair on arbitrary image and label files, plain or gzip (the reader
// tells them apart by content). Input: split_two (fuzz_input.h), images first.
// Bad input must end in towers::Error; any other exception, a crash or a sanitizer report is a
// bug, and so is an allocation beyond the run's -malloc_limit_mb, whatever the header claims.
#include <cstddef>
#include <cstdint>

#include "core/check.h"
#include "data/idx.h"
#include "fuzz_input.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static towers::fuzz::ScratchFile images("images-idx3-ubyte"), labels("labels-idx1-ubyte");
  const towers::fuzz::TwoFiles in = towers::fuzz::split_two(towers::fuzz::as_bytes(data, size));
  try {
    const towers::data::Dataset d =
        towers::data::read_idx_pair(images.write(in.first), labels.write(in.second), "fuzz", 10);
    // What the reader promises of a dataset it returns.
    if (d.images.size() != static_cast<size_t>(d.size() * d.example_bytes()) ||
        d.labels.size() != static_cast<size_t>(d.size()))
      __builtin_trap();
    for (int32_t label : d.labels)
      if (label < 0 || label >= 10) __builtin_trap();
  } catch (const towers::Error&) {
  }
  return 0;
}
