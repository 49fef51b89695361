// hogwild.cpp — async mode (Hogwild, Recht et al. 2011): every tower pulls the parameters
// without a lock, computes on its own stream of batches, and pushes its own update at once;
// updates race with other towers' pulls (relaxed atomics, never a torn float). With
// use_locking the store serialises the apply per variable (TF's use_locking). An update's
// staleness is the number of updates applied between its pull and its push.
#include <algorithm>

#include "towers/modes/hogwild.h"

#include "core/check.h"

namespace towers {

int64_t Hogwild::examples_per_update(int64_t batch, int) const { return batch; }

void Hogwild::begin(ModeContext& ctx) {
  next_ticket_ = ctx.store.version();
  held_.assign(ctx.n(), -1);
}

// Tickets keep the number of updates at exactly end_version - start, whoever races: a tower
// without one does not start. (A store that applies the update inside the tower's step,
// mirrored parameters in async mode, could not take back a step that has run.)
//
// Across worker processes (a store shared by processes) the run ends at the shards' version,
// which counts every worker's updates, so this process's tickets do not run out before it;
// but they can, where a shard restarted from its checkpoint lost the updates since and the
// other workers are gone. Then a step may start while the version and this process's steps
// under way stay below the end.
bool Hogwild::may_start(int tower, ModeContext& ctx) {
  if (held_[tower] >= 0) return true;  // woken after a park: it holds its ticket
  if (!gate_open(tower, ctx)) return false;
  if (next_ticket_ >= ctx.end_version && ctx.store.shared_by_processes()) {
    const int64_t open = ctx.store.version() + std::count_if(held_.begin(), held_.end(),
                                                             [](int64_t t) { return t >= 0; });
    if (open < ctx.end_version) next_ticket_ = open;
  }
  if (next_ticket_ >= ctx.end_version) return false;
  held_[tower] = next_ticket_++;
  return true;
}

Submitted Hogwild::submit(const TowerStep& s, ModeContext& ctx) {
  const int64_t ticket = held_[s.tower];
  TOWERS_CHECK(ticket >= 0, "tower {} submits without a ticket", s.tower);
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
  // A store that keeps the gradients on the towers' devices takes them from there.
  ctx.push(ctx.store.gradients_on_towers() ? nullptr : ctx.towers[s.tower]->grads(), s.tower,
           rec);

  std::lock_guard<std::mutex> l(ctx.mu);
  held_[s.tower] = -1;
  ctx.stats.tower_step(s.tower, s.seconds, ctx.batch);
  ctx.stats.contributed(s.tower);
  ctx.store.tick(s.tower);
  // (Tickets that ran out across processes may open again as the shards' version moves: the
  // towers parked for want of one are asked again after each push.)
  const bool recheck =
      recheck_after_push() || (ctx.store.shared_by_processes() && next_ticket_ >= ctx.end_version);
  return {ctx.record(rec), recheck, false};
}

std::unique_ptr<ModePolicy> make_hogwild(const EngineConfig& cfg) {
  return std::make_unique<Hogwild>(cfg);
}

}  // namespace towers
