// batchnorm.h — batch normalization (Ioffe & Szegedy) over the channels of (C, H, W) or (C)
// inputs: y = gamma (x - mean) / sqrt(var + eps) + beta, with the batch's statistics in
// training and the running ones in evaluation. Variables (TF's names): gamma, beta (trainable)
// and moving_mean, moving_variance (state: ParamSpec::trainable = false).
//
// The running statistics are never written by a forward. Backward writes their deltas as the
// variables' gradients (kernels/batchnorm.h); the optimizer adds (1 - momentum) x the update's
// average of them. So they are updated where every parameter is updated (the host, a shard,
// ...), once per update, from the statistics of the towers behind it: per tower by default,
// as TF's multi-GPU towers compute them; a sync update follows the mean of its towers' batch
// statistics. The training forward keeps its batch statistics (mean and biased variance, C
// doubles each) in its saved buffer's per-call floats, and backward reads them there.
//
// With a TowerExchange in the call (--sync-bn, sync towers) a training step normalizes
// with the statistics of the global batch instead: the towers add their channel sums through
// the exchange (the mean, the squares about it; in backward, the sums of dy and dy x xhat),
// so N towers of B / N compute what one tower of B computes, up to the order of the additions
// (one tower's lanes against per-tower lanes added in tower order: float-close, not bitwise).
// A GPU tower takes its sums on the device and adds them through the same exchange on the
// host (a copy out and in, and a wait on its stream, at each of the three sums of a step), so
// its step cannot be a CUDA graph: CudaTower runs --sync-bn steps eagerly.
#pragma once

#include <vector>

#include "kernels/batchnorm.h"
#include "layers/layer.h"

namespace towers {

struct BatchNormConfig {
  double momentum = 0.9;  // running = momentum x running + (1 - momentum) x batch
  double eps = 1e-5;
  float weight_decay = 0.0f;  // on gamma and beta
};

class BatchNorm : public Layer {
 public:
  static constexpr int kGamma = 0, kBeta = 1, kMean = 2, kVar = 3;  // params() order
  BatchNorm(std::string name, BatchNormConfig cfg) : Layer(std::move(name)), cfg_(cfg) {}
  std::string kind() const override { return "batchnorm"; }
  std::vector<ParamSpec> params() const override;
  int64_t flops_per_example() const override { return 4 * c_ * hw_; }
  int64_t saved_per_call() const override { return 4 * c_; }  // mean, var: c doubles each
  void forward(const ForwardArgs& a) const override;
  void backward(const BackwardArgs& a) const override;
#if TOWERS_HAVE_CUDA
  void forward_gpu(const GpuExec& exec, const ForwardArgs& a) const override;
  void backward_gpu(const GpuExec& exec, const BackwardArgs& a) const override;
  int64_t gpu_scratch(int64_t n) const override;  // device doubles: gpu_scratch_floats
#endif
  // Scratch floats of the GPU path for c channels, 8-byte aligned: the --sync-bn sums (4 x c
  // doubles), then the kernels' work (kernels::cuda::batchnorm_work_doubles).
  static int64_t gpu_scratch_floats(int64_t c) {
    return 2 * (4 * c + kernels::cuda::batchnorm_work_doubles(c)) + 2;
  }

 protected:
  Shape infer(const Shape& in) override;

 private:
  void global_moments(const kernels::BnShape& s, const float* x, TowerExchange& ex, double* mean,
                      double* var) const;
  // The training forward's statistics in a call's saved buffer: mean, then var.
  double* stats(float* saved, int64_t n) const;
  const double* stats(const float* saved, int64_t n) const;

  BatchNormConfig cfg_;
  int64_t c_ = 0, hw_ = 1;
};

}  // namespace towers
