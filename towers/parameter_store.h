// parameter_store.h — where a tower group's parameters live, and the one place an update is
// applied (modelled on ps-lite's KVWorker: pull, push, wait).
//
// A store holds (owns, or borrows from the caller) the flat parameter array (ParameterLayout
// order) and the optimizer with its slots, and owns the version (the number of updates
// applied) and the concurrency rules of its updates. The
// engine (TowerGroup) never touches the parameters or the optimizer itself:
//   pull(tower)                  the tower gets the current parameters; returns the version
//                                they were at when the copy began
//   push(grads, lr, host)        applies one update (grads already averaged and scaled),
//                                returns a ticket: the version the update produced
//   wait(ticket)                 returns once that update is visible to every later pull
//   tick(tower), clock(tower), min_clock()
//                                per-tower clocks: the updates each tower has pushed in this
//                                run (the SSP gate compares them); the caller serialises them
// A sync round is a version: every tower of a round pulls the same version and the round's
// one push makes the next, so sync needs nothing beyond the version from the store.
// The local host store (this file) applies at once, on the calling tower's host threads, so
// its wait returns at once. The stores to come plug in behind the same three calls:
//   - device-mirrored (TF's MirroredStrategy): a copy of the parameters and slots on each
//     GPU; push runs the CUDA optimizer on every copy (after an NCCL all-reduce in sync mode),
//     pull is a no-op for a tower on its own GPU, and host_params() copies one replica back for
//     evaluation and checkpoints;
//   - remote sharded (parameter-server tasks over gRPC): push sends each shard's byte range of
//     the gradient, the ticket is the round, wait blocks on the shards' acknowledgements, pull
//     fetches the ranges into a pinned host buffer and then loads the tower from it.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "optim/optimizer.h"
#include "towers/tower.h"

namespace towers {

// How updates meet readers: Exclusive when nothing reads or writes the parameters during an
// update (plain sync: every tower has finished its step); Concurrent when towers may be
// copying them at the same time (async, SSP, backup towers), as relaxed atomics; with
// use_locking, concurrent updates of one variable are serialised (TF's use_locking).
enum class UpdateAccess { Exclusive, Concurrent };

class ParameterStore {
 public:
  virtual ~ParameterStore() = default;
  virtual int64_t version() const = 0;
  // How its updates meet concurrent reads: the engine checks it suits the mode.
  virtual UpdateAccess access() const = 0;
  // Sets the version a run starts from (a resumed checkpoint's step).
  virtual void restore_version(int64_t v) = 0;
  virtual int64_t pull(Tower& tower) = 0;
  virtual int64_t push(const float* grads, float lr, CpuDevice& host) = 0;
  // Advances the version without an update (a skipped step); returns it like push.
  virtual int64_t skip() = 0;
  virtual void wait(int64_t ticket) = 0;
  // The parameters at the current version, in host memory (evaluation, checkpoints).
  virtual const float* host_params() = 0;
  // Per-tower clocks, all 0 after reset_clocks(towers).
  virtual void reset_clocks(int towers) = 0;
  virtual int64_t tick(int tower) = 0;  // returns the tower's new clock
  virtual int64_t clock(int tower) const = 0;
  virtual int64_t min_clock() const = 0;
};

// The parameters in host memory, as in the TF tutorial: towers copy them in (GPU towers from
// page-locked memory, one DMA each) and updates are applied by the host.
class LocalParameterStore final : public ParameterStore {
 public:
  // params: layout.total() floats, owned by the caller and outliving the store; opt owns the
  // slots. pin: page-lock params for GPU towers (best effort; a warning if it fails).
  LocalParameterStore(float* params, Optimizer& opt, UpdateAccess access, bool use_locking,
                      bool pin);
  int64_t version() const override { return version_.load(); }
  UpdateAccess access() const override { return access_; }
  void restore_version(int64_t v) override { version_.store(v); }
  int64_t pull(Tower& tower) override;
  int64_t push(const float* grads, float lr, CpuDevice& host) override;
  int64_t skip() override { return version_.fetch_add(1) + 1; }
  void wait(int64_t) override {}
  const float* host_params() override { return params_; }
  void reset_clocks(int towers) override { clocks_.assign(towers, 0); }
  int64_t tick(int tower) override { return ++clocks_.at(tower); }
  int64_t clock(int tower) const override { return clocks_.at(tower); }
  int64_t min_clock() const override;

 private:
  float* params_;
  Optimizer& opt_;
  UpdateAccess access_;
  bool use_locking_;
  std::atomic<int64_t> version_{0};
  std::shared_ptr<void> pinned_;
  std::vector<int64_t> clocks_;
};

}  // namespace towers
