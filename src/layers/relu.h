// relu.h — ReLU, max(x, 0), element by element over any shape (a layer of its own, after a
// batchnorm, say); no parameters. Backward reads the output: dx = dy where y > 0.
#pragma once

#include "layers/layer.h"

namespace towers {

class Relu : public Layer {
 public:
  explicit Relu(std::string name) : Layer(std::move(name)) {}
  std::string kind() const override { return "relu"; }
  void forward(const ForwardArgs& a) const override;
  void backward(const BackwardArgs& a) const override;
#if TOWERS_HAVE_CUDA
  void forward_gpu(const GpuExec& exec, const ForwardArgs& a) const override;
  void backward_gpu(const GpuExec& exec, const BackwardArgs& a) const override;
#endif

 protected:
  Shape infer(const Shape& in) override;
};

}  // namespace towers
