#include "models/models.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/check.h"
#include "layers/conv2d.h"
#include "layers/dense.h"
#include "layers/lrn.h"
#include "layers/maxpool.h"

namespace towers {

namespace {

using kernels::Padding;

// tensorflow/models tutorials/image/cifar10/cifar10.py: inference(), same names, shapes,
// initialisers and weight decay; LRN(depth_radius 4, bias 1, alpha 0.001/9, beta 0.75).
std::unique_ptr<Graph> tutorial_net(const std::string& model, Shape input) {
  auto g = std::make_unique<Graph>(model, std::move(input), 10);
  const kernels::LrnParams lrn{4, 1.0f, 0.001f / 9.0f, 0.75f};
  g->add<Conv2D>("conv1", Conv2DConfig{64, 5, 1, Padding::Same, true, 5e-2f, 0.0f, 0.0f});
  g->add<MaxPool>("pool1", 3, 2, Padding::Same);
  g->add<Lrn>("norm1", lrn);
  g->add<Conv2D>("conv2", Conv2DConfig{64, 5, 1, Padding::Same, true, 5e-2f, 0.1f, 0.0f});
  g->add<Lrn>("norm2", lrn);
  g->add<MaxPool>("pool2", 3, 2, Padding::Same);
  g->add<Dense>("local3", DenseConfig{384, true, 0.04f, 0.1f, 0.004f});
  g->add<Dense>("local4", DenseConfig{192, true, 0.04f, 0.1f, 0.004f});
  g->add<Dense>("softmax_linear", DenseConfig{10, false, 1.0f / 192.0f, 0.0f, 0.0f});
  return g;
}

std::unique_ptr<Graph> mlp() {
  auto g = std::make_unique<Graph>("mlp", Shape{1, 28, 28}, 10);
  g->add<Dense>("hidden", DenseConfig{128, true, 0.05f, 0.1f, 0.0f});
  g->add<Dense>("softmax_linear", DenseConfig{10, false, 1.0f / 128.0f, 0.0f, 0.0f});
  return g;
}

}  // namespace

std::vector<std::string> model_names() { return {"cifar10", "fashion", "mlp"}; }

std::unique_ptr<Graph> build_model(const std::string& name) {
  if (name == "cifar10") return tutorial_net(name, {3, 24, 24});
  if (name == "fashion") return tutorial_net(name, {1, 28, 28});
  if (name == "mlp") return mlp();
  TOWERS_BAD_INPUT("unknown model '{}' (known: {})", name, fmt::join(model_names(), ", "));
}

}  // namespace towers
