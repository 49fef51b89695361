// residual.h — a residual block: y = x + f(x), where f is a chain of inner layers whose last
// output has the block's input shape (ResNet's identity shortcut; a ReLU after the sum is a
// `relu` layer of its own). The block is one layer of the graph: it owns its inner layers,
// declares their variables (under the inner layers' own names, at most kMaxLayerVars in all),
// and runs their CPU or GPU calls in order.
//
// Its saved buffer holds, for a call on n examples, each inner layer's output and saved buffer
// (saved_floats(inner, n), 8-byte aligned as the layer contract wants), then two ping-pong buffers
// for the errors between inner layers (written by backward: the buffer is the tower's, used by this
// layer only). Backward runs the inner layers' backwards in reverse; the first one writes dx, and
// the shortcut adds dy to it.
#pragma once

#include <memory>
#include <vector>

#include "layers/layer.h"

namespace towers {

class Residual : public Layer {
 public:
  Residual(std::string name, std::vector<std::unique_ptr<Layer>> inner);
  std::string kind() const override { return "residual"; }
  const std::vector<std::unique_ptr<Layer>>& inner() const { return inner_; }
  std::vector<ParamSpec> params() const override;
  int64_t saved_per_example() const override;
  int64_t saved_per_call() const override;
  int64_t flops_per_example() const override;
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
  // Where inner layer k's output and saved buffer, and the two error buffers, start in a
  // call's saved buffer on n examples.
  struct Slices {
    std::vector<float*> act, saved;
    float* err[2];
  };
  Slices slices(float* saved, int64_t n) const;
  ForwardArgs inner_forward(size_t k, const ForwardArgs& a, const Slices& s) const;
  BackwardArgs inner_backward(size_t k, const BackwardArgs& a, const Slices& s, const float* dy,
                              int cur) const;

  std::vector<std::unique_ptr<Layer>> inner_;
  std::vector<int> first_var_;  // inner layer k's variables start at params()[first_var_[k]]
  int64_t widest_ = 0;          // the widest inner output, per example
};

}  // namespace towers
