// tower.h — one model replica on one device: the shared graph, a parameter mirror, one
// contiguous gradient buffer (the layout of the parameter store), and the activations of one
// batch. A step is: copy parameters in, forward, loss, backward into the gradient buffer.
// CpuTower computes on a oneTBB arena of its own; CudaTower (towers/cuda_tower.h) on a GPU,
// with its gradients landing in pinned host memory. The engine sees only this interface.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/cudnn_rules.h"
#include "core/device.h"
#include "graph/graph.h"
#include "kernels/augment.h"
#include "kernels/softmax_xent.h"
#include "layers/layer.h"

namespace towers::data {
struct Dataset;
struct AugmentConfig;
}  // namespace towers::data

namespace towers {

struct StepStats {
  double loss_sum = 0.0;  // cross-entropy summed over the examples
  int64_t correct = 0;
  int64_t examples = 0;
};

// Where a tower runs.
struct TowerPlacement {
  DeviceKind kind = DeviceKind::Cpu;
  int threads = 1;           // CPU: compute threads; GPU: threads for the tower's host work
  int gpu = 0;               // CUDA ordinal
  bool tf32 = false;         // cuBLAS TF32 tensor-core math
  bool cuda_graphs = true;   // replay each step's forward+backward as one CUDA graph
  // GPU: each layer's weight and bias gradients on a second stream, beside its input gradient
  // (parallel branches of the step's graph; core/gpu.h GpuLane).
  bool backward_branches = false;
  // GPU: how cuDNN's algorithms are chosen. By default deterministic ones only, so a run's bits
  // are a function of its seed; nondeterministic: its fastest-ranked ones; benchmark: chosen by
  // timing them (cudnnFind*), so the choice may differ from run to run; gemm_only: kept to the
  // GEMM family (no FFT or Winograd), whose FP32 results round as the CPU tower's do.
  CudnnRules cudnn;
  // Tests only: a spin kernel of this many ns on the compute stream before each layer's
  // backward, so that a gradient copy that does not wait for its layer reads stale data.
  int64_t test_backward_delay_ns = 0;
};

// The threads that run an update's pass over the flat layout (the optimizer's apply):
// run_update(total, f) calls f(lo, hi) for spans that cover [0, total), each span on the
// threads that own it, and returns when every span is done. The spans hold whole variables.
class UpdateThreads {
 public:
  virtual void run_update(int64_t total, const std::function<void(int64_t, int64_t)>& f) = 0;

 protected:
  ~UpdateThreads() = default;
};

// One CpuDevice's threads, the whole layout as one span.
class HostUpdate final : public UpdateThreads {
 public:
  explicit HostUpdate(CpuDevice& threads) : threads_(threads) {}
  void run_update(int64_t total, const std::function<void(int64_t, int64_t)>& f) override {
    threads_.execute([&] { f(0, total); });
  }

 private:
  CpuDevice& threads_;
};

// A tower runs its updates on its host threads (host()), the whole layout at once; a placed
// tower runs each part's span on that part's threads, the parts at the same time.
class Tower : public UpdateThreads {
 public:
  Tower(const Graph& graph, int64_t max_batch);
  virtual ~Tower() = default;
  // What the tower's per-batch-size plans chose (a GPU tower's cuDNN algorithms and their
  // workspaces, GpuPlans::notes), for the run's summary record; empty where nothing is planned.
  virtual std::vector<std::string> plan_notes() const { return {}; }
  Tower(const Tower&) = delete;
  Tower& operator=(const Tower&) = delete;

  const Graph& graph() const { return graph_; }
  int64_t max_batch() const { return max_batch_; }
  virtual Device& device() = 0;
  // Threads for the host-side work that belongs to this tower (its optimizer apply, its share
  // of a host reduction). For a CPU tower these are its compute threads.
  virtual CpuDevice& host() = 0;
  void run_update(int64_t total, const std::function<void(int64_t, int64_t)>& f) override {
    host().execute([&] { f(0, total); });
  }

  // The gradients of the last compute_gradients, in host memory (pinned for a GPU tower).
  virtual const float* grads() const = 0;
  virtual float* mutable_grads() = 0;  // reductions sum into tower 0's buffer
  virtual void load_params(const float* host) = 0;  // one copy of the whole flat array
  // The same copy while other threads write host (async modes): a tower may see a mix of
  // versions, which Hogwild accepts, but never a torn float.
  virtual void load_params_shared(const float* host) = 0;

  // images (n, C, H, W), labels (n), host memory. Overwrites the gradient buffer with
  // d(sum of losses * grad_scale)/d(params); grad_scale = 1 / global batch gives the mean.
  virtual StepStats compute_gradients(const float* images, const int32_t* labels, int64_t n,
                                      float grad_scale) = 0;
  // The noise of the training steps that follow (ForwardArgs::noise: what dropout draws its
  // masks from). The step driver sets it before every compute_gradients: the run's seed with
  // the batch's index in the data stream as the key, the tower's offset in a sync global
  // batch as the first example. Until then it is {0, 0}.
  void set_noise(const kernels::StepNoise& noise) { noise_ = noise; }
  const kernels::StepNoise& noise() const { return noise_; }
  // --sync-bn: the exchange through which this tower's training steps meet the other towers'
  // (layers/layer.h); null (the default): the tower's batch is the whole batch. CPU towers.
  void set_exchange(TowerExchange* exchange) { exchange_ = exchange; }
  // --input device: the tower holds the training set on its device and makes each training
  // batch there from its examples' plans (data::plan_train: the example and its draws, drawn
  // by the host exactly as for a batch of pixels). Towers that cannot throw a user error that
  // names the flag (the CPU tower). hold_train_data copies the set in once (again only for
  // another set or transform); train must outlive the tower's planned steps and not change
  // meanwhile.
  virtual void hold_train_data(const data::Dataset& train, const data::AugmentConfig& config);
  // As compute_gradients, for the batch of n examples planned by plans (host memory).
  virtual StepStats compute_gradients_planned(const kernels::ExamplePlan* plans,
                                              const int32_t* labels, int64_t n, float grad_scale);
  // Forward only.
  virtual StepStats evaluate(const float* images, const int32_t* labels, int64_t n) = 0;
  // The logits (n x classes, host memory) of the last evaluate or compute_gradients of n
  // examples, for what needs more than the loss's sums (test-time augmentation).
  virtual void copy_logits(float* out, int64_t n) = 0;

 protected:
  void check_batch(int64_t n) const;
  // The activations of one batch on dev: per layer its output and saved buffer, and two
  // ping-pong buffers for the gradients flowing down.
  void allocate_activations(Device& dev);
  // Every derived tower calls this in its destructor: the buffers must go back to the device
  // while the derived class, which owns the device, still exists.
  void release_activations();
  // The arguments of layer i's forward on input x, and of its backward in a pass where cur
  // selects the ping-pong buffer holding dy; params and grads are the tower's flat arrays.
  ForwardArgs forward_args(size_t i, int64_t n, const float* x, const float* params,
                           bool training);
  BackwardArgs backward_args(size_t i, int64_t n, const float* images, int cur,
                             const float* params, float* grads, float grad_scale);

  // Layer i's variables as views into arrays that hold the layout from offset `origin` on (0:
  // the whole flat layout; a placed tower's part holds only its span): a.params, the writable
  // a.state among them and, for backward, a.grads (state variables' deltas among them).
  void bind_variables(size_t i, float* params, int64_t origin, ForwardArgs& a) const;
  void bind_variables(size_t i, const float* params, float* grads, int64_t origin,
                      BackwardArgs& a) const;

  // Per layer: its variables (params() order) as layout entries, and the span [lo, hi) of
  // the flat array they cover (lo == hi: none); backward writes all of it.
  std::vector<std::vector<const Variable*>> vars_;
  std::vector<std::pair<int64_t, int64_t>> grad_span_;
  bool has_grads(size_t i) const { return grad_span_[i].first < grad_span_[i].second; }
  std::vector<DeviceBuffer> act_, saved_;
  DeviceBuffer dact_[2];
  kernels::StepNoise noise_;
  // What forward_args and backward_args give the layers: noise_ itself, or a tower's device
  // copy of it (CudaTower).
  const kernels::StepNoise* noise_arg_ = &noise_;
  TowerExchange* exchange_ = nullptr;

 private:
  const Graph& graph_;
  int64_t max_batch_;
};

class CpuTower final : public Tower {
 public:
  CpuTower(const Graph& graph, int64_t max_batch, int threads);
  ~CpuTower() override { release_activations(); }

  CpuDevice& device() override { return device_; }
  CpuDevice& host() override { return device_; }
  float* params() { return params_.data(); }
  const float* grads() const override { return grads_.data(); }
  float* mutable_grads() override { return grads_.data(); }
  void load_params(const float* host) override;
  void load_params_shared(const float* host) override;
  StepStats compute_gradients(const float* images, const int32_t* labels, int64_t n,
                              float grad_scale) override;
  StepStats evaluate(const float* images, const int32_t* labels, int64_t n) override;
  void copy_logits(float* out, int64_t n) override;
  // Logits of the last call.
  const float* logits() const { return act_.back().data(); }

 private:
  const float* forward(const float* images, int64_t n, bool training);

  CpuDevice device_;
  DeviceBuffer params_, grads_;
};

// A CpuTower or, in a CUDA build, a CudaTower. Throws a user-facing error when the placement
// asks for a GPU this build or machine does not have.
std::unique_ptr<Tower> make_tower(const Graph& graph, int64_t max_batch, const TowerPlacement& p);

}  // namespace towers
