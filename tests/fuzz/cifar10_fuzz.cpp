// cifar10_fuzz.cpp — read_cifar10_files on one to three arbitrary files. Input: a byte whose
// value mod 3 is the file count minus one, then the files' bytes, cut into that many parts of
// equal size (the last takes the remainder).
// Bad input must end in towers::Error; any other exception, a crash or a sanitizer report is a
// bug, and so is an allocation beyond the run's -malloc_limit_mb.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/check.h"
#include "data/cifar10.h"
#include "fuzz_input.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static towers::fuzz::ScratchFile files[3] = {towers::fuzz::ScratchFile("data_batch_1.bin"),
                                               towers::fuzz::ScratchFile("data_batch_2.bin"),
                                               towers::fuzz::ScratchFile("data_batch_3.bin")};
  if (size < 1) return 0;
  const size_t count = data[0] % 3 + 1;
  std::string_view rest = towers::fuzz::as_bytes(data + 1, size - 1);
  const size_t part = rest.size() / count;
  std::vector<std::string> paths;
  for (size_t k = 0; k < count; ++k) {
    const size_t n = k + 1 == count ? rest.size() : part;
    paths.push_back(files[k].write(rest.substr(0, n)));
    rest.remove_prefix(n);
  }
  try {
    const towers::data::Dataset d = towers::data::read_cifar10_files(paths, "fuzz");
    if (d.images.size() != static_cast<size_t>(d.size() * 3072) || d.size() == 0 ||
        static_cast<size_t>(d.size() * towers::data::kCifar10RecordBytes) != size - 1)
      __builtin_trap();
    for (int32_t label : d.labels)
      if (label < 0 || label >= 10) __builtin_trap();
  } catch (const towers::Error&) {
  }
  return 0;
}
