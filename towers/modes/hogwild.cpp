// hogwild.cpp — async mode (Hogwild, Recht et al. 2011): every tower pulls the parameters
// without a lock, computes on its own stream of batches, and pushes its own update at once;
// updates race with other towers' pulls (relaxed atomics, never a torn float). With
// use_locking the store serialises the apply per variable (TF's use_locking). An update's
// staleness is the number of updates applied between its pull and its push.
#include <algorithm>
#include <atomic>

#include "towers/modes/hogwild.h"

namespace towers {

int64_t Hogwild::examples_per_update(int64_t batch, int) const { return batch; }

void Hogwild::begin(ModeContext& ctx) { tickets_.store(ctx.store.version()); }

bool Hogwild::may_start(int, ModeContext&) { return true; }

Submitted Hogwild::submit(const TowerStep& s, ModeContext& ctx) {
  // Tickets keep the number of updates at exactly end_version - start, whoever races.
  const int64_t ticket = tickets_.fetch_add(1);
  if (ticket >= ctx.end_version) return {false, false, true};
  UpdateRecord rec;
  rec.tower = s.tower;
  rec.staleness = ctx.store.version() - s.version_read;
  rec.loss = s.stats.loss_sum / static_cast<double>(ctx.batch);
  rec.correct = s.stats.correct;
  rec.examples = ctx.batch;
  // The schedule follows the applied updates: in one process the ticket, across worker
  // processes (a remote store) the shards' version, which counts every worker's.
  rec.lr = ctx.lr_at(std::max(ticket, ctx.store.version()));
  if (ctx.cfg.staleness_aware_lr)
    rec.lr /= static_cast<float>(std::max<int64_t>(1, rec.staleness));
  ctx.push(ctx.towers[s.tower]->grads(), s.tower, rec);

  std::lock_guard<std::mutex> l(ctx.mu);
  ctx.stats.tower_step(s.tower, s.seconds, ctx.batch);
  ctx.stats.contributed(s.tower);
  ctx.store.tick(s.tower);
  return {ctx.record(rec), recheck_after_push(), false};
}

std::unique_ptr<ModePolicy> make_hogwild(const EngineConfig& cfg) {
  return std::make_unique<Hogwild>(cfg);
}

}  // namespace towers
