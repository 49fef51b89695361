// layer.h — the layer contract. A layer is bound once to its input shape and is immutable
// afterwards: it holds no per-call state, so every tower shares one graph's layers. Everything a
// call needs (activations, saved buffers, variables, gradients) is passed in by the tower.
//
// A layer declares any number of named variables (params(): "<layer>/<name>", up to
// kMaxLayerVars), trainable ones and non-trainable state (ParamSpec::trainable = false: running
// statistics, say), all in the one flat layout, so state is checkpointed and pulled like
// parameters. A call sees them as params[k], in params() order; backward writes grads[k] for
// every variable: the loss gradient of a trainable one, the delta of a state variable's running
// average (ParamSpec::state_rate; the update applies it, so forwards never write state, and
// towers that share parameters never race on it). state[k] (the same memory as params[k],
// non-null only for non-trainable variables) is there for a layer that must write its state
// in forward; none does.
//
// What forward keeps for backward is the `saved` buffer, owned by the tower and allocated once
// (so a CUDA graph can capture the step): a call on n examples gets saved_floats(layer, n)
// floats, starting 8-byte aligned; saved_per_example() floats per example, then (at
// call_saved(), 8-byte aligned) saved_per_call() floats whatever n is (BatchNorm's batch
// statistics, in double). The ForwardArgs::saved of a call is the BackwardArgs::saved of its
// backward.
//
// A layer that draws random numbers in training (dropout) draws them from the call's noise
// (kernels/dropout.h): the step's key and the global position of the call's first example, in
// the memory the call runs on (device memory for a GPU call, read when its kernels run, so a
// replayed CUDA graph sees the step it replays). A forward and its backward get the same.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "kernels/dropout.h"
#include "params/layout.h"

namespace towers {

struct GpuExec;  // core/gpu.h

// The towers of one sync step, for a layer whose training forward needs statistics of the
// whole global batch (BatchNorm under --sync-bn): every tower of the step calls sum() at the
// same points of its step, in the same order, with as many values; each call returns, in
// values, the sum over the towers, added in tower order (so every tower gets the same bits).
class TowerExchange {
 public:
  virtual ~TowerExchange() = default;
  virtual void sum(double* values, int64_t count) = 0;
};

// A count of floats rounded up to an even one: slices of a saved buffer laid out in such
// counts keep the 8-byte alignment of the buffer's start (see above).
constexpr int64_t even_floats(int64_t floats) { return (floats + 1) / 2 * 2; }

inline constexpr int kMaxLayerVars = 16;
using VarViews = std::array<const float*, kMaxLayerVars>;
using MutableVarViews = std::array<float*, kMaxLayerVars>;

struct ForwardArgs {
  int64_t n = 0;              // examples in this call
  const float* x = nullptr;   // (n, in_shape)
  float* y = nullptr;         // (n, out_shape)
  VarViews params{};          // the layer's variables, in params() order
  MutableVarViews state{};    // the non-trainable ones, writable (null for trainable ones)
  float* saved = nullptr;     // saved_floats(layer, n) floats kept for backward (see above)
  bool training = true;       // false: no backward follows, nothing needs saving
  const kernels::StepNoise* noise = nullptr;  // training: the step's noise (see above)
  TowerExchange* exchange = nullptr;  // training under --sync-bn: the step's other towers
};

struct BackwardArgs {
  int64_t n = 0;
  const float* x = nullptr;   // forward input
  const float* y = nullptr;   // forward output
  const float* dy = nullptr;  // (n, out_shape)
  float* dx = nullptr;        // (n, in_shape), overwritten; null for the first layer
  VarViews params{};          // as in forward
  MutableVarViews grads{};    // gradient views of the variables, overwritten; for state, the
                              // delta its running average takes (ParamSpec::state_rate)
  const float* saved = nullptr;
  const kernels::StepNoise* noise = nullptr;  // the forward's
  TowerExchange* exchange = nullptr;          // the forward's
  // The share of the update this call's state deltas carry: n x the loss gradient's scale
  // (1 when one call makes the update, 1/T for each of T sync towers), so that the update
  // averages them as it averages the gradients.
  float state_weight = 1.0f;
};

class Layer {
 public:
  explicit Layer(std::string name) : name_(std::move(name)) {}
  virtual ~Layer() = default;

  const std::string& name() const { return name_; }
  virtual std::string kind() const = 0;
  const Shape& in_shape() const { return in_; }
  const Shape& out_shape() const { return out_; }

  // Fixes the per-example input shape; computes the output shape (throws on a bad fit).
  void bind(const Shape& in) {
    in_ = in;
    out_ = infer(in);
  }
  // The layer's variables, "<layer name>/<variable>", at most kMaxLayerVars.
  virtual std::vector<ParamSpec> params() const { return {}; }
  virtual int64_t saved_per_example() const { return 0; }
  virtual int64_t saved_per_call() const { return 0; }
  // Where a call's per-call floats start in its saved buffer (after n x saved_per_example(),
  // rounded up to an even count so that they stay 8-byte aligned).
  template <class T>
  T* call_saved(T* saved, int64_t n) const {
    return saved + even_floats(n * saved_per_example());
  }
  virtual int64_t flops_per_example() const { return 0; }  // forward multiply-adds x 2
  // Examples the CPU path computes as one block: its weight gradient is the tree sum
  // (kernels/reduce.h) of one partial per batch_chunk() examples, and its per-example results
  // are computed in blocks that divide it. A batch cut into pieces of a power-of-two number of
  // such blocks, their gradients tree-summed in order, gives this layer's gradient of the
  // whole batch bit for bit (micro-batches, towers/placed_tower.h). 0: no batch-summed gradient.
  virtual int64_t batch_chunk() const { return 0; }

  virtual void forward(const ForwardArgs& a) const = 0;
  virtual void backward(const BackwardArgs& a) const = 0;

  // The GPU twins (CUDA builds): the same contract on device pointers, queued on exec.stream
  // (nothing waits for it). gpu_scratch is the device scratch a call on n examples needs;
  // gpu_lane_scratch what a backward on n examples needs on the exec's lane (core/gpu.h), for
  // the branch it forks there.
  virtual int64_t gpu_scratch(int64_t /*n*/) const { return 0; }
  virtual int64_t gpu_lane_scratch(int64_t /*n*/) const { return 0; }
  virtual void forward_gpu(const GpuExec& exec, const ForwardArgs& a) const;
  virtual void backward_gpu(const GpuExec& exec, const BackwardArgs& a) const;

 protected:
  virtual Shape infer(const Shape& in) = 0;  // may cache geometry

 private:
  std::string name_;
  Shape in_, out_;
};

// The floats of saved buffer a call of `layer` on n examples needs (see above); a sum of
// these keeps every call's buffer 8-byte aligned.
inline int64_t saved_floats(const Layer& layer, int64_t n) {
  return even_floats(n * layer.saved_per_example()) + even_floats(layer.saved_per_call());
}

}  // namespace towers
