#include "data/load.h"

#include <fmt/ranges.h>

#include "core/check.h"
#include "data/cifar10.h"
#include "data/idx.h"
#include "data/synthetic.h"

namespace towers::data {

std::vector<std::string> dataset_names() { return {"fashion-mnist", "cifar10", "synthetic"}; }

DataSplit load_dataset(const DatasetRequest& r) {
  if (r.name == "fashion-mnist") return load_fashion_mnist(r.dir.empty() ? kFashionMnistDir : r.dir);
  if (r.name == "cifar10") {
    TOWERS_REQUIRE(!r.dir.empty(),
                   "--dataset cifar10 needs --data DIR (the folder of data_batch_1.bin .. "
                   "test_batch.bin from cifar-10-binary.tar.gz)");
    return load_cifar10(r.dir);
  }
  if (r.name == "synthetic") {
    TOWERS_CHECK(r.synthetic_shape.size() == 3, "synthetic data needs a (C, H, W) shape");
    TOWERS_REQUIRE(r.synthetic_train > 0 && r.synthetic_test > 0,
                   "--synthetic-size must be positive, got {}", r.synthetic_train);
    return make_synthetic(r.synthetic_shape[0], r.synthetic_shape[1], r.synthetic_shape[2], 10,
                          r.synthetic_train, r.synthetic_test, r.seed);
  }
  TOWERS_BAD_INPUT("--dataset: unknown dataset '{}' (known: {})", r.name,
                   fmt::join(dataset_names(), ", "));
}

Transforms transforms_for(const std::string& augment, const std::string& dataset,
                          const Shape& in, const Dataset& data, const std::string& model) {
  TOWERS_REQUIRE(data.channels == in[0],
                 "--model {} takes {} channel(s) ({}x{}x{}) but --dataset {} has {} channel(s) "
                 "({}x{}x{})",
                 model, in[0], in[1], in[2], in[0], dataset, data.channels, data.height,
                 data.width, data.channels);
  TOWERS_REQUIRE(data.height >= in[1] && data.width >= in[2],
                 "--model {} takes {}x{} images but --dataset {} has smaller {}x{} ones", model,
                 in[1], in[2], dataset, data.height, data.width);
  std::string mode = augment;
  if (mode == "auto") mode = dataset == "cifar10" ? "tutorial" : dataset == "fashion-mnist" ? "flip" : "none";
  Transforms t;
  t.eval = tutorial_eval_config(in[1]);
  t.eval.out_w = in[2];
  if (mode == "tutorial") {
    t.train = tutorial_train_config(in[1]);
    t.train.out_w = in[2];
  } else if (mode == "flip" || mode == "none") {
    t.train = t.eval;
    t.train.random_crop = data.height > in[1] || data.width > in[2];
    t.train.flip = mode == "flip";
  } else if (mode == "airbench") {
    // airbench's: a random flip and a random translation by up to 2 pixels each way (the
    // image zero-padded by 2, then cropped at random), then standardization.
    t.train = t.eval;
    t.train.random_crop = t.train.flip = true;
    t.train.pad = 2;
  } else {
    TOWERS_BAD_INPUT("--augment: unknown mode '{}' (known: auto, tutorial, flip, airbench, none)",
                     augment);
  }
  validate(t.train, data);
  validate(t.eval, data);
  return t;
}

}  // namespace towers::data
