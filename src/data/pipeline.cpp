#include "data/pipeline.h"

#include <utility>

#include <oneapi/tbb/task_arena.h>
#include <oneapi/tbb/task_group.h>

#include "core/check.h"
#include "core/parallel.h"
#include "core/rng.h"

namespace towers::data {
namespace {

// Keeps augmentation draws apart from the permutation draws of the same seed.
constexpr uint64_t kAugmentStream = 0x6175676d656e74ULL;  // "augment"
constexpr int64_t kExamplesPerTask = 8;

}  // namespace

std::vector<int64_t> epoch_permutation(int64_t n, uint64_t seed, int64_t epoch) {
  std::vector<int64_t> p(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) p[i] = i;
  Rng rng(seed, static_cast<uint64_t>(epoch));
  for (int64_t i = n - 1; i > 0; --i) std::swap(p[i], p[rng.below(static_cast<uint64_t>(i + 1))]);
  return p;
}

// A batch in preparation. The tasks run in the pipeline's own arena: a trainer thread that
// waits inside its own parallel_for then never steals a whole batch preparation and stalls.
struct BatchPipeline::Slot {
  oneapi::tbb::task_group tasks;
  std::vector<int64_t> indices;
  Batch batch;
};

BatchPipeline::BatchPipeline(const Dataset& train, AugmentConfig config, int64_t batch,
                             uint64_t seed, int64_t start_step, int prefetch_depth,
                             int64_t stride, bool planned)
    : train_(train), config_(config), batch_(batch), seed_(seed), next_step_(start_step),
      planned_(planned), stride_(stride) {
  train.validate();
  validate(config_, train);
  TOWERS_REQUIRE(batch > 0, "batch size {} must be positive", batch);
  TOWERS_REQUIRE(start_step >= 0, "start step {} must not be negative", start_step);
  TOWERS_REQUIRE(stride >= 1, "step stride {} must be positive", stride);
  TOWERS_REQUIRE(prefetch_depth >= 0, "prefetch depth {} must not be negative", prefetch_depth);
  if (prefetch_depth > 0) arena_ = std::make_unique<oneapi::tbb::task_arena>();
  for (int k = 0; k < prefetch_depth; ++k) slots_.push_back(std::make_unique<Slot>());
  for (int k = 0; k < prefetch_depth; ++k) schedule(start_step + k * stride_);
}

BatchPipeline::~BatchPipeline() {
  for (auto& slot : slots_) {
    try {
      arena_->execute([&] { slot->tasks.wait(); });
    } catch (...) {
      // An error of a batch nobody asked for any more has no one to report to.
    }
  }
}

Shape BatchPipeline::example_shape() const { return data::example_shape(config_, train_); }

BatchPipeline::Slot& BatchPipeline::slot_of(int64_t step) {
  return *slots_[static_cast<size_t>((step / stride_) % static_cast<int64_t>(slots_.size()))];
}

void BatchPipeline::schedule(int64_t step) {
  Slot& slot = slot_of(step);
  slot.indices = indices_of(step);
  slot.batch.step = step;
  arena_->execute([&] { slot.tasks.run([this, &slot] { prepare(slot.batch, slot.indices); }); });
}

std::vector<int64_t> BatchPipeline::indices_of(int64_t step) {
  const int64_t n = train_.size();
  std::vector<int64_t> indices(static_cast<size_t>(batch_));
  for (int64_t i = 0; i < batch_; ++i) {
    const int64_t pos = step * batch_ + i;
    const int64_t epoch = pos / n;
    // Positions only grow, so one cached epoch suffices even when a batch spans several.
    if (epoch != cached_epoch_) {
      cached_permutation_ = epoch_permutation(n, seed_, epoch);
      cached_epoch_ = epoch;
    }
    indices[i] = cached_permutation_[pos % n];
  }
  return indices;
}

void BatchPipeline::prepare(Batch& out, const std::vector<int64_t>& indices) const {
  const int64_t n = train_.size();
  const int64_t m = example_floats(config_, train_);
  if (planned_)
    out.plans.resize(static_cast<size_t>(batch_));
  else
    out.images.resize(batch_ * m);
  out.labels.resize(static_cast<size_t>(batch_));
  out.epoch_end = static_cast<double>((out.step + 1) * batch_) / static_cast<double>(n);
  const uint64_t augment_seed = hash_combine(seed_, kAugmentStream);
  for_chunks(batch_, kExamplesPerTask, [&](int64_t, int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t pos = out.step * batch_ + i;
      Rng rng(augment_seed, static_cast<uint64_t>(pos / n), static_cast<uint64_t>(pos % n));
      if (planned_)
        out.plans[i] = plan_train(config_, train_, indices[i], rng);
      else
        augment_train(config_, train_, indices[i], rng, out.images.data() + i * m);
      out.labels[i] = train_.labels[indices[i]];
    }
  });
}

Batch BatchPipeline::next() {
  const int64_t step = next_step_;
  if (slots_.empty()) {
    Batch b;
    b.step = step;
    prepare(b, indices_of(step));
    next_step_ += stride_;
    return b;
  }
  TOWERS_CHECK(!failed_, "BatchPipeline::next after a failed batch preparation");
  Slot& slot = slot_of(step);
  try {
    arena_->execute([&] { slot.tasks.wait(); });
  } catch (...) {
    failed_ = true;  // the slot holds a half-made batch; never hand it out
    throw;
  }
  Batch b = std::move(slot.batch);
  slot.batch = Batch{};
  next_step_ += stride_;
  schedule(step + static_cast<int64_t>(slots_.size()) * stride_);
  return b;
}

void make_eval_batch(const Dataset& test, const AugmentConfig& config, int64_t begin, int64_t end,
                     float* out, int32_t* labels) {
  TOWERS_CHECK(0 <= begin && begin <= end && end <= test.size(),
               "eval range [{}, {}) outside dataset '{}' of {} examples", begin, end, test.name,
               test.size());
  const int64_t m = example_floats(config, test);
  for_chunks(end - begin, kExamplesPerTask, [&](int64_t, int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      transform_eval(config, test, begin + i, out + i * m);
      labels[i] = test.labels[begin + i];
    }
  });
}

}  // namespace towers::data
