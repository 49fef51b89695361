// cuda_tower.h — a tower on a GPU (CUDA builds only).
//
// A step on the tower's two streams:
//   copy stream     params H2D (load_params) -> batch H2D -> [grads of layer L D2H] ... [layer 1]
//   compute stream            wait(batch) -> forward -> loss -> backward L ... backward 1 -> join
//                             [-> the store's update, with parameters on the device]
// Each layer's gradient slice is copied to the pinned landing buffer as soon as its backward
// is done, so the copies overlap the backward of the layers below. Forward, loss, backward and
// those copies are captured as a CUDA graph and replayed (TowerPlacement::cuda_graphs): the
// first step of a (batch size, gradient scale) runs eagerly, the second is captured, later
// ones replay. Evaluation, and every step when graphs are off, launch eagerly.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include <cuda_runtime.h>

#include "core/cuda_device.h"
#include "core/gpu.h"
#include "towers/tower.h"

namespace towers {

class CudaTower final : public Tower {
 public:
  CudaTower(const Graph& graph, int64_t max_batch, const TowerPlacement& p);
  ~CudaTower() override;

  CudaDevice& device() override { return dev_; }
  CpuDevice& host() override { return host_; }
  const float* grads() const override { return grads_host_.as<float>(); }
  float* mutable_grads() override { return grads_host_.as<float>(); }
  // Both queue one H2D copy on the copy stream and return: host must not change until the
  // next compute_gradients or evaluate has returned (every mode guarantees it, or, for the
  // async modes, accepts a mix of versions as Hogwild does).
  void load_params(const float* host) override;
  void load_params_shared(const float* host) override { load_params(host); }
  StepStats compute_gradients(const float* images, const int32_t* labels, int64_t n,
                              float grad_scale) override;
  StepStats evaluate(const float* images, const int32_t* labels, int64_t n) override;
  void copy_logits(float* out, int64_t n) override;
  // --input device: the training set's bytes on this GPU (one copy per GPU and set, shared by
  // the towers on it); a step copies in its plans and labels (a few KB) and makes the batch
  // with kernels::cuda::augment on the compute stream, before the step's graph.
  void hold_train_data(const data::Dataset& train, const data::AugmentConfig& config) override;
  StepStats compute_gradients_planned(const kernels::ExamplePlan* plans, const int32_t* labels,
                                      int64_t n, float grad_scale) override;

  // For an all-reduce among GPUs: with grads_to_host off, compute_gradients leaves the
  // gradients on the device only.
  void set_grads_to_host(bool on) { grads_to_host_ = on; }
  // Work a training step ends with, on the compute stream after the backward, inside the
  // step's CUDA graph: the update of a device-mirrored store. It is given the stream and the
  // step's per-example losses on the device. Setting it drops the captured graph.
  // before runs on the host at the start of every training step, captured or replayed (the
  // store checks there that the step's scalars are in place).
  using StepEpilogue = std::function<void(cudaStream_t, const double* row_loss, int64_t n)>;
  void set_step_epilogue(StepEpilogue f, std::function<void()> before = nullptr) {
    epilogue_ = std::move(f);
    before_step_ = std::move(before);
    drop_graph();
  }
  float* device_grads() { return grads_d_.data(); }
  float* device_params() { return params_d_.data(); }
  int64_t graph_captures() const { return captures_; }
  int64_t planned_steps() const { return planned_steps_; }  // compute_gradients_planned calls
  const void* held_train_data() const { return train_d_.get(); }  // null: none held
  int64_t graph_replays() const { return replays_; }
  // --backward-branches: the branches the layers forked onto the lane (queued eagerly or into
  // a capture; replays do not count).
  int64_t lane_forks() const { return lane_.forks; }
  // Plans the layers made on this tower (one per cuDNN convolution and batch size).
  int64_t gpu_plans() const { return static_cast<int64_t>(plans_.size()); }
  // What each of those plans chose (GpuPlans::notes).
  const std::vector<std::string>& gpu_plan_notes() const { return plans_.notes(); }
  std::vector<std::string> plan_notes() const override { return plans_.notes(); }

 private:
  void stage_inputs(const float* images, const int32_t* labels, int64_t n);
  void stage_plans(const kernels::ExamplePlan* plans, const int32_t* labels, int64_t n);
  void stage_labels_and_noise(const int32_t* labels, int64_t n);  // then inputs_ready_
  StepStats run_step(int64_t n, float grad_scale);  // after staging: eager, captured or replayed
  LossArgs loss_args(int64_t n, float grad_scale, float* dlogits);  // on the device buffers
  void enqueue_forward(int64_t n, bool training);
  void enqueue_step(int64_t n, float grad_scale);  // forward, loss, backward, grads out
  StepStats finish(int64_t n);                     // waits, sums the per-example results
  void capture(int64_t n, float grad_scale);       // enqueue_step as a CUDA graph
  void drop_graph();

  TowerPlacement placement_;
  CudaDevice dev_;
  CpuDevice host_;
  DeviceBuffer params_d_, grads_d_, images_d_, labels_d_, row_loss_d_, row_correct_d_, scratch_;
  DeviceBuffer noise_d_;  // the step's noise (Tower::set_noise), copied in with its batch
  // --input device: the training set (bytes), which set and transform, and the step's plans.
  std::shared_ptr<void> train_d_;  // shared by the towers on this GPU that hold the same set
  DeviceBuffer plans_d_;
  PinnedBuffer plans_pin_;
  const data::Dataset* train_held_ = nullptr;
  const uint8_t* train_held_bytes_ = nullptr;  // the set's buffer when it was copied in
  int64_t train_held_size_ = 0;
  int64_t planned_steps_ = 0;
  kernels::AugmentShape shape_;
  PinnedBuffer grads_host_, images_pin_, labels_pin_, row_loss_h_, row_correct_h_, noise_pin_;
  GpuPlans plans_;  // the layers' per-batch-size plans (cuDNN), before exec_ which points here
  GpuExec exec_;
  // --backward-branches: the lane exec_.lane points to, and its scratch.
  GpuLane lane_;
  DeviceBuffer lane_scratch_;
  cudaEvent_t inputs_ready_ = nullptr, copies_done_ = nullptr;
  std::vector<cudaEvent_t> layer_done_;  // per layer with variables: its gradients are final
  bool grads_to_host_ = true;
  StepEpilogue epilogue_;
  std::function<void()> before_step_;
  // The captured step and what it was captured for.
  cudaGraphExec_t graph_ = nullptr;
  int64_t graph_n_ = -1;
  float graph_scale_ = 0.0f;
  bool graph_to_host_ = true;
  int64_t captures_ = 0, replays_ = 0;
};

}  // namespace towers
