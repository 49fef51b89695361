// cifar10.h — the CIFAR-10 binary version (www.cs.toronto.edu/~kriz/cifar.html):
// records of 1 label byte + 3072 pixel bytes, the R, G and B planes of 32x32 (already CHW).
#pragma once

#include <string>
#include <vector>

#include "data/dataset.h"

namespace towers::data {

inline constexpr int64_t kCifar10RecordBytes = 1 + 3 * 32 * 32;

// Concatenates the records of the given files in order. Throws towers::Error naming the file
// on: missing or unreadable file, a size that is zero or not a multiple of 3073, a label >= 10.
Dataset read_cifar10_files(const std::vector<std::string>& paths, const std::string& name);

// data_batch_1..5.bin (train) and test_batch.bin (test) in dir or dir/cifar-10-batches-bin.
DataSplit load_cifar10(const std::string& dir);

}  // namespace towers::data
