// backup.cpp — sync with backup towers (TF's SyncReplicasOptimizer with
// replicas_to_aggregate K < N): the first K gradients computed on the current version are
// averaged and applied; a gradient that arrives after its version has been applied is dropped
// and counted. A tower that has given its gradient for a version waits for the next one.
#include "core/parallel.h"
#include "towers/modes/mode.h"

namespace towers {

namespace {

class BackupTowers final : public ModePolicy {
 public:
  BackupTowers(int n, int k) : k_(k), submitted_(n, -1) {}

  int64_t examples_per_update(int64_t batch, int) const override { return batch * k_; }

  bool may_start(int tower, ModeContext& ctx) override {
    return submitted_[tower] != ctx.store.version();
  }

  Submitted submit(const TowerStep& s, ModeContext& ctx) override {
    std::lock_guard<std::mutex> l(ctx.mu);
    ctx.stats.tower_step(s.tower, s.seconds, ctx.batch);
    if (s.version_read != ctx.store.version() || ctx.store.version() >= ctx.end_version) {
      ctx.stats.dropped(s.tower);  // late: its version has been applied without it
      return {};
    }
    submitted_[s.tower] = s.version_read;
    Tower& t = *ctx.towers[s.tower];
    float* sum = ctx.grad_sum.data();
    const float* gr = t.grads();
    const bool first = count_ == 0;
    t.host().execute([&] {
      for_chunks(ctx.total(), 1 << 15, [&](int64_t, int64_t b0, int64_t b1) {
        for (int64_t j = b0; j < b1; ++j) sum[j] = first ? gr[j] : sum[j] + gr[j];
      });
    });
    if (first) rec_ = UpdateRecord{};
    ++count_;
    ctx.stats.contributed(s.tower);
    rec_.loss += s.stats.loss_sum, rec_.correct += s.stats.correct, rec_.examples += ctx.batch;
    if (count_ < k_) return {};

    rec_.lr = ctx.lr_at(s.version_read);
    const float scale = 1.0f / static_cast<float>(k_);
    t.host().execute([&] {
      for_chunks(ctx.total(), 1 << 15, [&](int64_t, int64_t b0, int64_t b1) {
        for (int64_t j = b0; j < b1; ++j) sum[j] *= scale;
      });
    });
    rec_.loss /= static_cast<double>(rec_.examples);
    rec_.tower = -1;
    rec_.contributors = k_;
    ctx.push(sum, s.tower, rec_);
    count_ = 0;
    return {ctx.record(rec_), true, false};
  }

 private:
  int k_;
  std::vector<int64_t> submitted_;  // the version each tower last gave a gradient for
  int count_ = 0;                   // gradients in the accumulator
  UpdateRecord rec_;
};

}  // namespace

std::unique_ptr<ModePolicy> make_backup_towers(const EngineConfig& cfg) {
  return std::make_unique<BackupTowers>(cfg.towers, cfg.replicas_to_aggregate);
}

}  // namespace towers
