// global_avg_pool.h — global average pooling: (C, H, W) -> (C, 1, 1), each plane to its mean
// (summed in order in double, kernels/global_pool_rules.h); no parameters, nothing saved.
#pragma once

#include "layers/layer.h"

namespace towers {

class GlobalAvgPool : public Layer {
 public:
  explicit GlobalAvgPool(std::string name) : Layer(std::move(name)) {}
  std::string kind() const override { return "global_avg_pool"; }
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
