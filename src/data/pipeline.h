// pipeline.h — the training example stream, cut into batches and prepared ahead of use.
//
// The stream is the concatenation of epoch permutations; the permutation of epoch e is a
// pure function of (seed, e), and the augmentation of the example at stream position p is a
// pure function of (seed, p / N, p % N). Step t is positions [t*B, (t+1)*B): every batch is
// full and may straddle an epoch boundary. So batch t is a pure function of (seed, t): a
// resumed run starts at any step without replaying, and the bytes do not depend on the
// prefetch depth or the thread count.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include <oneapi/tbb/task_arena.h>

#include "core/tensor.h"
#include "data/augment.h"
#include "data/dataset.h"

namespace towers::data {

// Fisher–Yates over [0, n) with Rng(seed, epoch).
std::vector<int64_t> epoch_permutation(int64_t n, uint64_t seed, int64_t epoch);

struct Batch {
  int64_t step = 0;
  HostBuffer images;            // (B, C, out_h, out_w) float; empty when the batch is planned
  std::vector<ExamplePlan> plans;  // planned batches only (B): each example's draws
  std::vector<int32_t> labels;  // (B)
  double epoch_end = 0.0;       // stream position after this batch / train size
};

class BatchPipeline {
 public:
  // `train` must outlive the pipeline. Steps start_step+1 .. start_step+prefetch_depth are
  // prepared by oneTBB tasks while the caller works on the current one; depth 0 prepares
  // each batch inside next(). planned: each batch is its examples' plans and labels, no
  // pixels (--input device: a GPU tower makes the pixels, kernels::cuda::augment).
  BatchPipeline(const Dataset& train, AugmentConfig config, int64_t batch, uint64_t seed,
                int64_t start_step, int prefetch_depth = 2, int64_t stride = 1,
                bool planned = false);
  ~BatchPipeline();  // waits for the batches in flight
  BatchPipeline(const BatchPipeline&) = delete;
  BatchPipeline& operator=(const BatchPipeline&) = delete;

  // The batch of step(), then step() advances by one. Rethrows an error of its preparation.
  Batch next();
  int64_t step() const { return next_step_; }
  int64_t batch_size() const { return batch_; }
  Shape example_shape() const;

 private:
  struct Slot;
  Slot& slot_of(int64_t step);
  void schedule(int64_t step);
  std::vector<int64_t> indices_of(int64_t step);  // the dataset index of each example
  void prepare(Batch& out, const std::vector<int64_t>& indices) const;

  const Dataset& train_;
  AugmentConfig config_;
  int64_t batch_;
  uint64_t seed_;
  int64_t next_step_;
  bool planned_;
  int64_t stride_;  // next() walks start_step, start_step + stride, ... (a tower's shard)
  bool failed_ = false;
  // Touched only by the caller's thread (in schedule), never by the tasks.
  int64_t cached_epoch_ = -1;
  std::vector<int64_t> cached_permutation_;
  std::unique_ptr<oneapi::tbb::task_arena> arena_;  // only with prefetching
  std::vector<std::unique_ptr<Slot>> slots_;        // slot k holds the steps s with s % depth == k
};

// Eval examples [begin, end) of `test` in order, eval transform.
// out: (end - begin, C, out_h, out_w); labels: (end - begin).
void make_eval_batch(const Dataset& test, const AugmentConfig& config, int64_t begin, int64_t end,
                     float* out, int32_t* labels);

}  // namespace towers::data
