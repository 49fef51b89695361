// mode.h — a mode of a run as a policy of the one step driver (towers/tower_group.cpp).
//
// Every mode runs the same loop, one oneTBB task per tower step:
//     may_start? -> pull -> compute -> submit -> (record, side work) -> next step
// A policy decides three things and nothing else:
//   - the batches: lockstep (every update is one global batch of N x B split over the towers,
//     each gradient scaled by 1 / (N B)) or free-running (each tower reads its own stream of
//     batches of B and scales by 1 / B);
//   - the gate: whether a tower may start a step now (the SSP bound, a sync tower that has
//     already given its gradient for the current version); a tower that may not is parked and
//     re-examined after every submit that asks for it;
//   - the submit: what happens to a finished gradient (pushed at once, held for an ordered
//     average, accumulated, or dropped), through the driver's services in ModeContext.
// Adding a mode: a value of Mode below, a file in towers/modes/ with its policy and factory,
// and one line in registry.cpp.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "core/cudnn_rules.h"
#include "core/tensor.h"
#include "towers/parameter_store.h"
#include "towers/run_stats.h"
#include "towers/tower.h"

namespace towers {

enum class Mode { Sync, Async, Ssp };

// How sync mode sums GPU towers' gradients: on the host with oneTBB (the TF tutorial's way:
// every tower copies its gradients out), or by an NCCL all-reduce among the GPUs and one copy
// of the result to the host.
enum class Reduce { Host, Nccl };

struct EngineConfig {
  Mode mode = Mode::Sync;
  int towers = 1;
  int threads_per_tower = 1;
  int replicas_to_aggregate = 0;  // sync: 0 = all towers
  int64_t staleness = 0;          // ssp bound
  bool use_locking = false;       // async/ssp
  bool staleness_aware_lr = false;
  std::vector<std::pair<int, int>> stragglers;  // (tower, extra milliseconds per step)
  // Towers that give each gradient only once the others can go no further without it: sync
  // with backup towers, once the version it read has been applied without it; ssp, once every
  // other tower waits for it at the bound (--slow-tower TOWER:late; TowerGroup::run).
  std::vector<int> late_towers;
  // Where the towers run. CUDA: tower i on GPU i % gpus; threads_per_tower is then the
  // threads of each tower's host-side work.
  DeviceKind device = DeviceKind::Cpu;
  int gpus = 1;
  Reduce reduce = Reduce::Host;
  bool tf32 = false;
  bool cuda_graphs = true;
  bool backward_branches = false;  // TowerPlacement::backward_branches
  CudnnRules cudnn;                // TowerPlacement::cudnn
  // The gradient guard (TowerGroup::guarded_push). An update whose loss is not finite is never
  // applied: it is recorded as skipped (the version still advances, so data and schedule go
  // on) and the run decides whether to go on. check_grad_norm: also compute the gradient's
  // global L2 norm and skip the update when it is not finite. clip_grad_norm > 0: scale the
  // gradient to at most that norm (the norm is then computed too).
  double clip_grad_norm = 0.0;
  bool check_grad_norm = false;
  // A remote tower group (towers/remote/): this process runs the global towers first_tower ..
  // first_tower + towers - 1 of all_towers (0: towers) over every worker process. Lockstep
  // batches are then global batches of all_towers x B and gradients are scaled by
  // 1 / (all_towers B); free-running tower g reads stream g of all_towers.
  int first_tower = 0;
  int all_towers = 0;
  // --sync-bn: BatchNorm's training statistics over the global batch of the sync towers (a
  // TowerExchange among them, towers/tower_exchange.h) instead of each tower's own batch. Sync
  // towers of one process (CPU or GPU), without backup towers.
  bool sync_bn = false;
  // --input device: every tower holds the training set on its GPU and makes its batches there
  // from the host's plans (Tower::compute_gradients_planned). GPU towers.
  bool device_input = false;
  int total_towers() const { return all_towers > 0 ? all_towers : towers; }
};

// A tower's finished step, as the driver hands it to the policy.
struct TowerStep {
  int tower = 0;
  int64_t version_read = 0;  // the version its parameters were pulled at
  StepStats stats;
  double seconds = 0.0;      // pull + compute (+ any straggler delay)
};

// What a submit asks of the driver.
struct Submitted {
  bool side_work = false;      // an evaluation or checkpoint is due (run with towers paused)
  bool recheck_parked = false; // re-examine parked towers' gates
  bool stop = false;           // the run has reached its end version
};

class NcclReducer;

// The driver's services to a policy. mu guards the records, the statistics and every
// policy's own bookkeeping; record() must be called with it held.
struct ModeContext {
  const EngineConfig& cfg;
  ParameterStore& store;
  std::vector<std::unique_ptr<Tower>>& towers;
  RunStats& stats;
  HostBuffer& grad_sum;   // layout.total() floats when towers > 1
  NcclReducer* nccl;      // sync with Reduce::Nccl on several GPUs, else null
  int64_t batch;          // examples per tower per step
  int64_t end_version;
  std::mutex& mu;
  // The schedule's lr for the update that makes version v + 1.
  std::function<float(int64_t v)> lr_at;
  // Pushes one update through the gradient guard (clipping, non-finite skips) and waits for
  // it: reads rec.lr and rec.loss, fills in rec.version, rec.skipped and rec.grad_norm; tower
  // is the pushing tower. Policies push only through this.
  std::function<void(const float* grads, int tower, UpdateRecord& rec)> push;
  // Counts the update in the statistics and reports it to the run (metrics, evaluation and
  // checkpoint triggers); returns true when side work is due.
  std::function<bool(const UpdateRecord&)> record;

  int n() const { return static_cast<int>(towers.size()); }
  int64_t total() const { return static_cast<int64_t>(grad_sum.size()); }
};

class ModePolicy {
 public:
  virtual ~ModePolicy() = default;
  // Lockstep: every update is one global batch of N x B, tower i computing slice i.
  virtual bool lockstep() const { return false; }
  // Called once before the towers start, with the store at the run's first version.
  virtual void begin(ModeContext&) {}
  // Examples behind one update, for the schedule's epoch count.
  virtual int64_t examples_per_update(int64_t batch, int towers) const = 0;
  // Called with ctx.mu held before tower i pulls: false parks the tower.
  virtual bool may_start(int tower, ModeContext& ctx) = 0;
  // Called without the lock once tower i's gradient is in its buffer.
  virtual Submitted submit(const TowerStep& step, ModeContext& ctx) = 0;
};

// ---- the registry (registry.cpp) -------------------------------------------------------------
struct ModeInfo {
  Mode mode;
  const char* name;
  const char* summary;  // one line for --help
};
const std::vector<ModeInfo>& modes();
std::optional<Mode> mode_named(const std::string& name);
std::string mode_name(Mode m);
std::string mode_names();  // "sync, async, ssp"
// The policy of cfg's mode (sync picks the backup-tower policy when K < N).
std::unique_ptr<ModePolicy> make_policy(const EngineConfig& cfg);

}  // namespace towers
