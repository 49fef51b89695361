// sync.cpp — sync mode: the TF tutorial's in-graph replication. Every update is one global
// batch of N x B; tower i computes slice i, scaled by 1 / (N B), and the gradients are summed
// in tower order by a fixed tree (kernels/reduce.h) or by an NCCL all-reduce, so the result
// is bitwise the same whichever tower finishes first. One update, applied while every tower
// waits; all towers then read the same version.
#include "kernels/reduce.h"
#include "core/parallel.h"
#include "towers/modes/mode.h"
#include "towers/nccl_reduce.h"

namespace towers {

namespace {

class SyncTree final : public ModePolicy {
 public:
  explicit SyncTree(int n) : given_(n, false), stats_(n), seconds_(n) {}

  bool lockstep() const override { return true; }
  int64_t examples_per_update(int64_t batch, int towers) const override { return batch * towers; }

  // A tower gives one gradient per version.
  bool may_start(int tower, ModeContext&) override { return !given_[tower]; }

  Submitted submit(const TowerStep& s, ModeContext& ctx) override {
    const int n = ctx.n();
    {
      std::lock_guard<std::mutex> l(ctx.mu);
      given_[s.tower] = true;
      stats_[s.tower] = s.stats;
      seconds_[s.tower] = s.seconds;
      if (++arrived_ < n) return {};
    }
    // The last tower of the version: every other one is parked, so it owns the gradients.
    const float* grads = average(ctx);
    UpdateRecord rec;
    rec.tower = n == 1 ? 0 : -1;
    rec.contributors = n;
    rec.examples = ctx.batch * n;
    for (int i = 0; i < n; ++i) {
      rec.loss += stats_[i].loss_sum;
      rec.correct += stats_[i].correct;
    }
    rec.loss /= static_cast<double>(rec.examples);
    rec.lr = ctx.lr_at(ctx.store.version());
    ctx.push(grads, 0, rec);

    std::lock_guard<std::mutex> l(ctx.mu);
    for (int i = 0; i < n; ++i) {
      ctx.stats.tower_step(i, seconds_[i], ctx.batch);
      ctx.stats.contributed(i);
      given_[i] = false;
    }
    arrived_ = 0;
    return {ctx.record(rec), true, false};
  }

 private:
  // The mean gradient of the version in host memory (each tower's is already scaled by
  // 1 / (N B), so the mean is the sum), or null when the store averages on the towers' devices.
  static const float* average(ModeContext& ctx) {
    const int n = ctx.n();
    if (ctx.store.gradients_on_towers()) return nullptr;
    if (n > 1 && ctx.nccl) {
      ctx.nccl->sum_to_host(ctx.grad_sum.data());
      return ctx.grad_sum.data();
    }
    if (n > 1) {
      // A tree sum over the towers in tower order, into tower 0's buffer.
      std::vector<float*> blocks(n);
      for (int i = 0; i < n; ++i) blocks[i] = ctx.towers[i]->mutable_grads();
      for_chunks(ctx.total(), 1 << 15, [&](int64_t, int64_t b0, int64_t b1) {
        kernels::cpu::tree_sum(blocks.data(), n, b0, b1);
      });
    }
    return ctx.towers[0]->grads();
  }

  std::vector<bool> given_;
  std::vector<StepStats> stats_;
  std::vector<double> seconds_;
  int arrived_ = 0;
};

}  // namespace

std::unique_ptr<ModePolicy> make_sync_tree(const EngineConfig& cfg) {
  return std::make_unique<SyncTree>(cfg.towers);
}

}  // namespace towers
