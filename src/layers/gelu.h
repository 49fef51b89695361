// gelu.h — GELU, its tanh form (kernels/activation_rules.h), element by element over any shape;
// no parameters. Backward recomputes from the forward input, so nothing is saved.
#pragma once

#include "layers/layer.h"

namespace towers {

class Gelu : public Layer {
 public:
  explicit Gelu(std::string name) : Layer(std::move(name)) {}
  std::string kind() const override { return "gelu"; }
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
