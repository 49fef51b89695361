// maxpool.h — max-pooling with TF window and SAME/VALID padding rules; no parameters.
#pragma once

#include "kernels/conv.h"
#include "layers/layer.h"

namespace towers {

class MaxPool : public Layer {
 public:
  MaxPool(std::string name, int64_t kernel, int64_t stride, kernels::Padding padding)
      : Layer(std::move(name)), kernel_(kernel), stride_(stride), padding_(padding) {}
  std::string kind() const override { return "maxpool"; }
  int64_t saved_per_example() const override { return numel(out_shape()); }  // argmax
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
  int64_t kernel_, stride_;
  kernels::Padding padding_;
  kernels::Window rows_, cols_;
};

}  // namespace towers
