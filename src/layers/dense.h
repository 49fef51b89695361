// dense.h — fully connected layer (TF tutorial's "local" layers), y = x W^T + b, optional ReLU.
// The input is flattened in NCHW memory order (C, H, W). Weight [out, in].
#pragma once

#include "layers/layer.h"

namespace towers {

struct DenseConfig {
  int64_t out = 0;
  bool relu = true;
  float weight_stddev = 0.04f, bias_init = 0.1f, weight_decay = 0.0f;
};

class Dense : public Layer {
 public:
  static constexpr int kWeight = 0, kBias = 1;  // params(): "<name>/weight", "<name>/bias"
  Dense(std::string name, DenseConfig cfg) : Layer(std::move(name)), cfg_(cfg) {}
  std::string kind() const override { return "dense"; }
  std::vector<ParamSpec> params() const override;
  int64_t flops_per_example() const override { return 2 * in_ * cfg_.out; }
  int64_t batch_chunk() const override;
  void forward(const ForwardArgs& a) const override;
  void backward(const BackwardArgs& a) const override;
#if TOWERS_HAVE_CUDA
  int64_t gpu_scratch(int64_t n) const override;
  int64_t gpu_lane_scratch(int64_t n) const override;
  void forward_gpu(const GpuExec& exec, const ForwardArgs& a) const override;
  void backward_gpu(const GpuExec& exec, const BackwardArgs& a) const override;
#endif

 protected:
  Shape infer(const Shape& in) override;

 private:
  DenseConfig cfg_;
  int64_t in_ = 0;
};

}  // namespace towers
