// tower.h — one model replica on one device: the shared graph, a parameter mirror, one
// contiguous gradient buffer (the layout of the parameter store), and the activations of one
// batch. A step is: copy parameters in, forward, loss, backward into the gradient buffer.
#pragma once

#include <cstdint>
#include <vector>

#include "core/device.h"
#include "graph/graph.h"
#include "kernels/softmax_xent.h"

namespace towers {

struct StepStats {
  double loss_sum = 0.0;  // cross-entropy summed over the examples
  int64_t correct = 0;
  int64_t examples = 0;
};

class Tower {
 public:
  Tower(const Graph& graph, int64_t max_batch, int threads);

  const Graph& graph() const { return graph_; }
  CpuDevice& device() { return device_; }
  int64_t max_batch() const { return max_batch_; }

  float* params() { return params_.data(); }
  const float* grads() const { return grads_.data(); }
  float* mutable_grads() { return grads_.data(); }  // reductions sum into tower 0's buffer
  void load_params(const float* host);  // one copy of the whole flat array
  // The same copy while other threads write host (async modes): relaxed atomic loads, so a
  // tower may see a mix of versions, which Hogwild accepts, but never a torn float.
  void load_params_shared(const float* host);

  // images (n, C, H, W), labels (n). Overwrites the gradient buffer with
  // d(sum of losses * grad_scale)/d(params); grad_scale = 1 / global batch gives the mean.
  StepStats compute_gradients(const float* images, const int32_t* labels, int64_t n,
                              float grad_scale);
  // Forward only; logits of the last call stay in logits().
  StepStats evaluate(const float* images, const int32_t* labels, int64_t n);
  const float* logits() const { return act_.back().data(); }

 private:
  const float* forward(const float* images, int64_t n, bool training);

  const Graph& graph_;
  int64_t max_batch_;
  CpuDevice device_;
  DeviceBuffer params_, grads_;
  std::vector<DeviceBuffer> act_, saved_;
  DeviceBuffer dact_[2];
  std::vector<int64_t> w_off_, b_off_;  // per layer; -1 when the layer has no variables
};

}  // namespace towers
