// conv2d.h — 2-D convolution (+ bias, + optional fused ReLU) as im2col + GEMM.
// Weight [out, in, kh, kw]; TF SAME/VALID padding. The batch is cut into fixed chunks of
// images; each chunk is one GEMM over all its pixels, and chunks run on oneTBB threads.
#pragma once

#include "kernels/conv.h"
#include "layers/layer.h"

namespace towers {

struct Conv2DConfig {
  int64_t out_channels = 0, kernel = 0, stride = 1;
  kernels::Padding padding = kernels::Padding::Same;
  bool relu = true;
  float weight_stddev = 5e-2f, bias_init = 0.0f, weight_decay = 0.0f;
};

class Conv2D : public Layer {
 public:
  static constexpr int kWeight = 0, kBias = 1;  // params(): "<name>/weight", "<name>/bias"
  Conv2D(std::string name, Conv2DConfig cfg) : Layer(std::move(name)), cfg_(cfg) {}
  std::string kind() const override { return "conv2d"; }
  std::vector<ParamSpec> params() const override;
  int64_t flops_per_example() const override;
  int64_t batch_chunk() const override;
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
  Conv2DConfig cfg_;
  kernels::ConvGeometry geo_;  // set by infer (bind happens once, before any call)
};

}  // namespace towers
