// placed_tower.h — a tower split over devices (model parallelism, towers/placement.h): each
// part runs a contiguous run of the graph's layers on a CpuDevice of its own (a oneTBB arena
// with its own threads), holds the parameters of its layers and the activations of its layers,
// and computes the gradients of its own span of the flat layout. A step's batch is cut into M
// micro-batches that flow through the parts GPipe-style:
//
//   part 0   F0 F1 F2 F3 .. .. .. .. .. .. B3 B2 B1 B0 +
//   part 1   .. F0 F1 F2 F3 B3 B2 B1 B0 +  .. .. .. ..
//
// Fm is micro-batch m's forward through the part, Bm its backward, + the sum of the part's M
// micro-batch gradients. A part runs Fm once the part before it has, and Bm once the part after
// it has (the last part: after its own forwards); every (part, micro-batch) job is a oneTBB task
// run inside its part's arena, started by the job it waits for, so no thread ever blocks on
// another part and the parts compute at the same time. Activations cross forward and errors
// backward as a micro-batch's slice of the producing part's buffer: between CPU parts all of
// it is host memory, and the task order is the hand-off. A part on a GPU (cuda:N) keeps its
// buffers there and runs its layers' CUDA twins on its own stream; where two neighbours live
// in different memories the consumer copies the slice (its input rows, or the next part's
// error rows from its dx_out) on its stream. A GPU job ends by recording an event on its
// stream, not by waiting for it: the job that needs it waits for that event (on its stream,
// or on the host for a CPU part), so a GPU part queues its next micro-batch while the last
// still runs, and the step's end waits for each GPU part's last job.
//
// Bitwise: micro-batch m's gradient goes to a buffer of its own, and after its last backward a
// part tree-sums the M buffers in micro-batch order (kernels/reduce.h). When check_micro_batches
// (towers/placement.h) accepts M, that continues the tree each layer sums over its chunks, so
// the gradient, and the per-example losses summed in example order, are bitwise those of one
// device with the whole batch (CpuTower). With any other M the result is the same sum to float
// rounding.
//
// Every part's busy time is measured per step: the step's wall time minus it is the part's
// idle time, the pipeline bubble (about (P - 1) / (M + P - 1) of a step for P equal parts).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <oneapi/tbb/task_arena.h>
#include <nlohmann/json.hpp>

#include "towers/placement.h"
#include "towers/tower.h"

namespace towers {

// A GPU part tree-sums its micro-batches' gradients on the GPU: at most this many.
constexpr int kMaxGpuPartMicroBatches = 64;

// What a placed tower's parts did over its compute_gradients calls.
struct PipelineStats {
  struct Part {
    std::string device, layers;
    int threads = 0;
    double busy_seconds = 0.0;  // inside the part's jobs
  };
  int micro_batches = 1;
  int64_t steps = 0;
  double step_seconds = 0.0;  // wall time of the steps, summed
  std::vector<Part> parts;
  // {"micro_batches", "steps", "step_seconds", "parts": [{"part", "device", "layers",
  //  "threads", "busy_seconds", "idle_seconds", "idle_fraction"}]}
  nlohmann::json to_json() const;
};

class PlacedTower final : public Tower {
 public:
  // threads: the tower's threads, shared out between the parts that give no count of their own.
  // cudnn: how the GPU parts' cuDNN plans choose their algorithms.
  PlacedTower(const Graph& graph, int64_t max_batch, const Placement& placement, int micro_batches,
              int threads, const CudnnRules& cudnn = {});
  ~PlacedTower() override;

  // The tower's host work (the optimizer apply, its share of a reduction) uses every thread of
  // its parts, on an arena of its own.
  CpuDevice& device() override { return host_; }
  CpuDevice& host() override { return host_; }
  // The GPU parts' cuDNN plans, part by part ("cuda:0: conv1, batch 64: ...").
  std::vector<std::string> plan_notes() const override;
  // Each part applies its own span of an update, on its own threads, the parts at once: part
  // q's span runs from its first variable to the next part's (part 0 from 0, the last part to
  // the end). A GPU part's span is applied to the host copy by its part's thread (its
  // parameters are loaded from there each step; the host store owns the optimizer's slots).
  void run_update(int64_t total, const std::function<void(int64_t, int64_t)>& f) override;
  // Part q's span of an update (run_update).
  std::pair<int64_t, int64_t> update_span(int q) const;
  const float* grads() const override { return grads_.data(); }
  float* mutable_grads() override { return grads_.data(); }
  void load_params(const float* host) override;
  void load_params_shared(const float* host) override;
  StepStats compute_gradients(const float* images, const int32_t* labels, int64_t n,
                              float grad_scale) override;
  // Forward only, micro-batched through the parts like a training step.
  StepStats evaluate(const float* images, const int32_t* labels, int64_t n) override;
  void copy_logits(float* out, int64_t n) override;

  int micro_batches() const { return micro_batches_; }
  int parts() const { return static_cast<int>(parts_.size()); }
  int threads() const { return total_threads_; }  // over all parts
  const PipelineStats& pipeline_stats() const { return stats_; }

  // Where part q's parameters live (tests: a GPU part's are device memory).
  const float* part_params(int q) const;
  // The threads each part of `placement` gets when the tower has `threads`: a GPU part 1, the
  // CPU parts without a count of their own a share of the rest.
  static std::vector<int> part_threads(const Placement& placement, int threads);

 private:
  struct Part;
  StepStats run(const float* images, const int32_t* labels, int64_t n, float grad_scale,
                bool training);
  void forward(Part& part, int m, int64_t b0, int64_t b1, const float* images, bool training);
  void backward(Part& part, int m, int64_t b0, int64_t b1, const float* images,
                const int32_t* labels, float grad_scale);
  void loss_rows(int64_t b0, int64_t b1, const int32_t* labels, float grad_scale, float* dlogits);
  void loss_rows_gpu(Part& part, int64_t b0, int64_t b1, const int32_t* labels, float grad_scale,
                     float* dlogits);
  void sum_gradient(Part& part, int mbs);
  // A GPU part's compute stream, its device made current (null: a CPU part).
  void* stream_of(Part& part);
  // The step's noise where the part's layers read it.
  const kernels::StepNoise* stage_noise(Part& part, const kernels::StepNoise& nz);
  // A job's hand-offs by events (GPU parts): its wait for job j of part `from`, its start and
  // end marks, and the step's end, which waits for every GPU part's last job.
  void await_job(Part& part, int from, int j);
  void begin_job(Part& part, int j);
  void end_job(Part& part, int j);
  void finish_step(int jobs);
  // The part's first layer's input rows [b0, b0 + n): where the part before left them, or the
  // part's in buffer (pull: copied there first).
  const float* first_input(Part& part, int64_t b0, int64_t n, const float* images, bool pull);
  // Layer i's input and output rows of examples [b0, ...).
  const float* input(size_t i, int64_t b0, const float* images) const;
  float* output(size_t i, int64_t b0) const;
  // Layer i's saved buffer for micro-batch m: a slice of saved_floats(layer, micro_) each.
  float* saved(size_t i, int m) const;

  int micro_batches_;
  int64_t micro_ = 0;  // the largest micro-batch
  int total_threads_ = 0;
  CpuDevice host_;
  DeviceBuffer grads_;  // the flat layout; part p writes its span
  std::vector<std::unique_ptr<Part>> parts_;
  std::vector<Part*> part_of_;    // per layer
  std::vector<double> row_loss_;  // per example of the step
  std::vector<int32_t> row_correct_;
  oneapi::tbb::task_arena driver_;  // one slot per part: the jobs' tasks
  PipelineStats stats_;
};

}  // namespace towers
