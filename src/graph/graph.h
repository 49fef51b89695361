// graph.h — a model: layers in execution order and the loss after them, built once by a model
// builder and shared by every tower. Each layer's input is the previous layer's output (the
// nets here are chains; residual nets will add multi-input nodes). The graph fixes the
// parameter layout. The loss defaults to softmax cross-entropy over num_classes logits.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "layers/layer.h"
#include "layers/loss.h"
#include "params/layout.h"

namespace towers {

class Graph {
 public:
  Graph(std::string model, Shape input, int num_classes)
      : model_(std::move(model)), input_(std::move(input)), num_classes_(num_classes),
        loss_(std::make_unique<SoftmaxCrossEntropy>()) {}

  template <class L, class... Args>
  L& add(Args&&... args) {
    auto layer = std::make_unique<L>(std::forward<Args>(args)...);
    L& ref = *layer;
    append(std::move(layer));
    return ref;
  }

  Layer& add_layer(std::unique_ptr<Layer> layer) {
    Layer& ref = *layer;
    append(std::move(layer));
    return ref;
  }

  const std::string& model() const { return model_; }
  const Shape& input_shape() const { return input_; }
  int num_classes() const { return num_classes_; }
  const std::vector<std::unique_ptr<Layer>>& layers() const { return layers_; }
  const Loss& loss() const { return *loss_; }
  void set_loss(std::unique_ptr<Loss> loss) { loss_ = std::move(loss); }
  const ParameterLayout& layout() const { return layout_; }
  int64_t flops_per_example() const;  // forward pass
  std::string summary() const;        // a table: layer, kind, output shape, parameters

 private:
  void append(std::unique_ptr<Layer> layer);

  std::string model_;
  Shape input_;
  int num_classes_;
  std::vector<std::unique_ptr<Layer>> layers_;
  std::unique_ptr<Loss> loss_;
  ParameterLayout layout_;
};

}  // namespace towers
