// load.h — datasets by name, as the CLI's --dataset and --data flags name them, and the
// augmentation a model gets on them.
#pragma once

#include <string>
#include <vector>

#include "core/tensor.h"
#include "data/augment.h"
#include "data/dataset.h"

namespace towers::data {

std::vector<std::string> dataset_names();  // fashion-mnist, cifar10, synthetic

struct DatasetRequest {
  std::string name = "fashion-mnist";
  std::string dir;  // empty: the dataset's default location (if it has one)
  // synthetic only: its shape follows the model, its size follows these
  Shape synthetic_shape;
  int64_t synthetic_train = 10000, synthetic_test = 2000;
  uint64_t seed = 1;
};

DataSplit load_dataset(const DatasetRequest& r);

// The transforms for a model input (C, H, W) on a dataset: "auto" picks the TF tutorial's
// distortions for cifar10, random flips for fashion-mnist, none for synthetic; "tutorial",
// "flip" and "none" force one. All standardize per image. Throws naming --augment or --model
// when the dataset cannot feed the model.
struct Transforms {
  AugmentConfig train, eval;
};
Transforms transforms_for(const std::string& augment, const std::string& dataset,
                          const Shape& model_input, const Dataset& data,
                          const std::string& model);

}  // namespace towers::data
