// dropout.h — inverted dropout over any input shape (kernels/dropout.h): in training each
// element is kept with probability 1 - rate and scaled by 1 / (1 - rate), else zeroed; in
// evaluation the identity. The mask is a pure function of the step's noise (ForwardArgs::noise),
// the example's global position, the element and the layer's name, so backward recomputes it
// (nothing is saved) and sync towers, micro-batches, GPU twins and resumed runs draw exactly
// the masks of one tower on the whole batch.
#pragma once

#include "kernels/dropout.h"
#include "layers/layer.h"

namespace towers {

struct DropoutConfig {
  double rate = 0.5;  // the probability of dropping an element, in [0, 1)
};

class Dropout : public Layer {
 public:
  Dropout(std::string name, DropoutConfig cfg) : Layer(std::move(name)), cfg_(cfg) {}
  std::string kind() const override { return "dropout"; }
  double rate() const { return cfg_.rate; }
  void forward(const ForwardArgs& a) const override;
  void backward(const BackwardArgs& a) const override;
#if TOWERS_HAVE_CUDA
  void forward_gpu(const GpuExec& exec, const ForwardArgs& a) const override;
  void backward_gpu(const GpuExec& exec, const BackwardArgs& a) const override;
#endif

 protected:
  Shape infer(const Shape& in) override;

 private:
  DropoutConfig cfg_;
  kernels::DropoutParams p_;
};

}  // namespace towers
