// idx.h — the IDX format of MNIST and Fashion-MNIST (yann.lecun.com/exdb/mnist), read from
// plain or gzip files alike. Only what those sets use is accepted: 3-D uint8 images
// (magic 0x00000803) and 1-D uint8 labels (magic 0x00000801).
#pragma once

#include <string>

#include "data/dataset.h"

namespace towers::data {

// Where Debian's dataset-fashion-mnist package installs the four .gz files.
inline constexpr const char* kFashionMnistDir = "/usr/share/datasets/fashion-mnist";

// Reads an image file and its label file into a one-channel Dataset. Throws towers::Error
// naming the file on: unreadable file, wrong magic, zero dims, truncated payload, trailing
// bytes, a label >= num_classes, or image and label counts that differ.
Dataset read_idx_pair(const std::string& images_path, const std::string& labels_path,
                      const std::string& name, int num_classes);

// train-{images-idx3,labels-idx1}-ubyte and t10k-... in dir, each with or without ".gz".
DataSplit load_fashion_mnist(const std::string& dir = kFashionMnistDir);

}  // namespace towers::data
