// tower_group.h — N towers on one set of host parameters, and the modes that drive them
// (DESIGN.md, "Modes of a run"):
//   sync     the global batch of N x B is split in N slices; gradients are averaged in tower
//            order (deterministic) and applied once; every tower reads the same version.
//   sync with replicas_to_aggregate K < N (backup towers): the first K gradients of a version
//            are averaged and applied; later ones for that version are dropped and counted.
//   async    every tower loops on its own: copy the parameters (no lock), compute, apply its
//            own update at once (Hogwild); use_locking serialises the apply per variable.
//   ssp      async, but no tower runs more than `staleness` of its own steps ahead of the
//            slowest tower.
// A step of a tower is a oneTBB task that re-enqueues itself, so a tower that must wait (SSP
// bound, backup towers waiting for the next version) parks instead of blocking a thread, and
// the run makes progress with any number of threads.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <vector>

#include "data/pipeline.h"
#include "towers/parameter_store.h"
#include "towers/run_stats.h"
#include "towers/tower.h"

namespace towers {

enum class Mode { Sync, Async, Ssp };
Mode parse_mode(const std::string& s);  // throws naming --mode
std::string to_string(Mode m);

// How sync mode averages GPU towers' gradients: on the host with oneTBB (the TF tutorial's
// way: every tower copies its gradients out), or by an NCCL all-reduce among the GPUs and one
// copy of the result to the host.
enum class Reduce { Host, Nccl };
Reduce parse_reduce(const std::string& s);  // throws naming --reduce
std::string to_string(Reduce r);

struct EngineConfig {
  Mode mode = Mode::Sync;
  int towers = 1;
  int threads_per_tower = 1;
  int replicas_to_aggregate = 0;  // sync: 0 = all towers
  int64_t staleness = 0;          // ssp bound
  bool use_locking = false;       // async/ssp
  bool staleness_aware_lr = false;
  std::vector<std::pair<int, int>> stragglers;  // (tower, extra milliseconds per step)
  // Where the towers run. CUDA: tower i on GPU i % gpus; threads_per_tower is then the
  // threads of each tower's host-side work.
  DeviceKind device = DeviceKind::Cpu;
  int gpus = 1;
  Reduce reduce = Reduce::Host;
  bool tf32 = false;
  bool cuda_graphs = true;
};

// One applied update, as the run records it.
struct UpdateRecord {
  int64_t version = 0;    // the parameter version this update produced (= the step count)
  int tower = -1;         // who applied it; -1 for an average over towers
  int contributors = 1;   // towers whose gradients went into it
  int64_t staleness = 0;  // version at apply - version the gradients were computed on
  double loss = 0.0;      // mean cross-entropy of the examples behind the update
  int64_t correct = 0, examples = 0;
  float lr = 0.0f;
};

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
  int64_t examples_per_update() const;
  // The towers step until the version reaches end_version (or stop is requested). Data:
  // sync reads batches of N x B at steps start_version..; the other modes give tower i the
  // batches (of B) first_batch + i, first_batch + i + N, ... of the same example stream.
  void run(const data::Dataset& train, const data::AugmentConfig& augment, uint64_t seed,
           int64_t start_version, int64_t end_version, int64_t first_batch, RunHooks hooks);

  int64_t version() const { return store_.version(); }
  RunStats& stats() { return stats_; }
  Tower& tower(int i) { return *towers_[i]; }

 private:
  void run_sync(const data::Dataset& train, const data::AugmentConfig& augment, uint64_t seed,
                int64_t end_version, RunHooks& hooks);
  void run_tasks(const data::Dataset& train, const data::AugmentConfig& augment, uint64_t seed,
                 int64_t end_version, int64_t first_batch, RunHooks& hooks);
  void straggle(int tower) const;

  const Graph& graph_;
  EngineConfig cfg_;
  int64_t batch_;
  ParameterStore& store_;
  std::vector<std::unique_ptr<Tower>> towers_;
  RunStats stats_;
  HostBuffer grad_sum_;  // sync and backup towers: the averaged gradient
  std::shared_ptr<void> pinned_sum_;  // GPU towers: the sum's host memory page-locked
  std::unique_ptr<NcclReducer> nccl_;
};

}  // namespace towers
