// lrn.h — local response normalisation across channels (tf.nn.lrn); saves its scale.
#pragma once

#include "kernels/lrn.h"
#include "layers/layer.h"

namespace towers {

class Lrn : public Layer {
 public:
  Lrn(std::string name, kernels::LrnParams p) : Layer(std::move(name)), p_(p) {}
  std::string kind() const override { return "lrn"; }
  int64_t saved_per_example() const override { return numel(in_shape()); }
  void forward(const ForwardArgs& a) const override;
  void backward(const BackwardArgs& a) const override;
#if TOWERS_HAVE_CUDA
  int64_t gpu_scratch(int64_t n) const override;
  void forward_gpu(const GpuExec& exec, const ForwardArgs& a) const override;
  void backward_gpu(const GpuExec& exec, const BackwardArgs& a) const override;
#endif

 protected:
  Shape infer(const Shape& in) override;

 private:
  kernels::LrnParams p_;
};

}  // namespace towers
