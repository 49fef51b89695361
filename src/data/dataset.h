// dataset.h — a labelled image set held as raw bytes, the form every reader produces.
// Pixels stay uint8 until augmentation: a quarter of the memory of floats, and the
// augmentation pipeline converts each example exactly once per use anyway.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace towers::data {

struct Dataset {
  std::string name;  // "fashion-mnist/train", "cifar10/test", ... (used in error messages)
  int64_t channels = 0, height = 0, width = 0;
  int num_classes = 0;
  std::vector<uint8_t> images;  // (N, C, H, W)
  std::vector<int32_t> labels;  // (N), each in [0, num_classes)

  int64_t size() const { return static_cast<int64_t>(labels.size()); }
  int64_t example_bytes() const { return channels * height * width; }
  const uint8_t* image(int64_t i) const;  // (C, H, W)

  // Internal consistency (sizes agree, labels in range); throws naming the dataset.
  void validate() const;
};

struct DataSplit {
  Dataset train, test;
};

}  // namespace towers::data
