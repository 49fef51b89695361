// tower_group.h — N towers on one parameter store, driven by the one step driver: every
// tower step, in every mode, is a oneTBB task that runs
//     gate (the mode's may_start) -> pull -> compute -> submit (the mode's policy) -> record
// and re-enqueues itself (towers/modes/mode.h says what a policy decides). A tower that must
// wait (the SSP bound, a sync tower that has given its gradient for this version) parks
// instead of blocking a thread, so the run makes progress with any number of threads.
// DESIGN.md, "Modes of a run", describes the modes.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "data/pipeline.h"
#include "towers/modes/mode.h"
#include "towers/parameter_store.h"
#include "towers/run_stats.h"
#include "towers/tower.h"

namespace towers {

std::optional<Reduce> reduce_named(const std::string& s);

struct RunHooks {
  std::function<float(int64_t version)> lr_at;  // the schedule's lr for the next update
  // Called under the group's record lock after each update; returns true when side work
  // (evaluation, a checkpoint) is due. Side work then runs with every tower paused, and is
  // given the version the parameters are at then (async towers may have applied more
  // updates between the one that made the work due and the pause).
  std::function<bool(const UpdateRecord&)> on_update;
  std::function<void(int64_t version)> side_work;
  std::function<bool()> stop_requested;
};

class NcclReducer;
class TowerExchangeGroup;

// How the mode's updates meet the towers' reads: plain sync applies while no tower runs;
// async, SSP and backup towers apply while others copy the parameters.
UpdateAccess store_access(const EngineConfig& cfg);
// use_locking for the store: async and SSP with --use-locking (backup towers apply one update
// at a time anyway).
bool store_locking(const EngineConfig& cfg);

class TowerGroup {
 public:
  // store: the parameters every tower pulls and every update is pushed to (its access rule
  // must suit the mode: store_access(cfg)). batch: examples per tower per step.
  // make: how each tower is made (make_tower; tests pass towers of their own).
  using TowerFactory = std::function<std::unique_ptr<Tower>(const Graph&, int64_t max_batch,
                                                            const TowerPlacement&)>;
  TowerGroup(const Graph& graph, EngineConfig cfg, int64_t batch, ParameterStore& store,
             const TowerFactory& make = make_tower);
  ~TowerGroup();

  const EngineConfig& config() const { return cfg_; }
  // The towers step until the version reaches end_version (or stop is requested). Data:
  // lockstep modes (sync) read batches of N x B at steps start_version..; the others give
  // tower i the batches (of B) first_batch + i, first_batch + i + N, ... of the same stream.
  void run(const data::Dataset& train, const data::AugmentConfig& augment, uint64_t seed,
           int64_t start_version, int64_t end_version, int64_t first_batch, RunHooks hooks);

  int64_t version() const { return store_.version(); }
  RunStats& stats() { return stats_; }
  Tower& tower(int i) { return *towers_[i]; }

 private:
  void straggle(int tower) const;
  bool late(int tower) const;
  // ModeContext::push: the gradient guard (EngineConfig::clip_grad_norm, check_grad_norm)
  // around the store's push and wait, on the pushing tower's host threads.
  void guarded_push(const float* grads, int tower, UpdateRecord& rec);

  const Graph& graph_;
  EngineConfig cfg_;
  int64_t batch_;
  ParameterStore& store_;
  std::vector<std::unique_ptr<Tower>> towers_;
  RunStats stats_;
  HostBuffer grad_sum_;  // sync and backup towers: the averaged gradient
  std::shared_ptr<void> pinned_sum_;  // GPU towers: the sum's host memory page-locked
  std::unique_ptr<NcclReducer> nccl_;
  std::vector<HostBuffer> clipped_;  // per tower, made on the first clipped push
  std::unique_ptr<TowerExchangeGroup> exchange_;  // --sync-bn with more than one tower
};

}  // namespace towers
