// parameter_store.h — where a tower group's parameters live, and the one place an update is
// applied (modelled on ps-lite's KVWorker: pull, push, wait).
//
// A store holds (owns, or borrows from the caller) the flat parameter array (ParameterLayout
// order) and the optimizer with its slots, and owns the version (the number of updates
// applied) and the concurrency rules of its updates. The
// engine (TowerGroup) never touches the parameters or the optimizer itself:
//   pull(tower)                  the tower gets the current parameters; returns the version
//                                they were at when the copy began
//   push(grads, rec, on)         applies one update at rec.lr (grads already averaged and scaled),
//                                on the pushing tower's threads (on: Tower::run_update),
//                                returns a ticket: the version the update produced
//   wait(ticket)                 returns once that update is visible to every later pull
//   tick(tower), clock(tower), min_clock()
//                                per-tower clocks: the updates each tower has pushed in this
//                                run (the SSP gate compares them); the caller serialises them
// A sync round is a version: every tower of a round pulls the same version and the round's
// one push makes the next, so sync needs nothing beyond the version from the store.
// The local host store (this file) applies at once, on the pushing tower's threads (each part
// of a placed tower its own span: Tower::run_update), so its wait returns at once. The device-mirrored store (towers/mirrored_store.h, TF's
// MirroredStrategy) keeps a copy of the parameters and slots on each GPU tower and runs the
// CUDA optimizer there. The remote store (towers/remote/remote_store.h) keeps them on
// parameter-server shards in other processes: push sends each shard its byte range of the
// gradient and returns once it is applied, pull fetches the ranges and loads the tower.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/check.h"
#include "optim/optimizer.h"
#include "towers/tower.h"

namespace towers {

// One applied update, as the run records it.
struct UpdateRecord {
  int64_t version = 0;    // the parameter version this update produced (= the step count)
  int tower = -1;         // who applied it; -1 for an average over towers
  int contributors = 1;   // towers whose gradients went into it
  int64_t staleness = 0;  // version at apply - version the gradients were computed on
  double loss = 0.0;      // mean cross-entropy of the examples behind the update
  int64_t correct = 0, examples = 0;
  float lr = 0.0f;
  bool skipped = false;     // not applied: its loss or gradient was not finite
  double grad_norm = -1.0;  // the gradient's L2 norm before clipping (-1: not computed)
};

// How updates meet readers: Exclusive when nothing reads or writes the parameters during an
// update (plain sync: every tower has finished its step); Concurrent when towers may be
// copying them at the same time (async, SSP, backup towers), as relaxed atomics; with
// use_locking, concurrent updates of one variable are serialised (TF's use_locking).
enum class UpdateAccess { Exclusive, Concurrent };

class ParameterStore {
 public:
  virtual ~ParameterStore() = default;
  virtual int64_t version() const = 0;
  // Whether processes other than this one update it (a remote store): its version then counts
  // their updates too, and may also fall back (a shard restarted from its checkpoint).
  virtual bool shared_by_processes() const { return false; }
  // How its updates meet concurrent reads: the engine checks it suits the mode.
  virtual UpdateAccess access() const = 0;
  // Sets the version a run starts from (a resumed checkpoint's step).
  virtual void restore_version(int64_t v) = 0;
  // Where a push finds its gradient. false: the grads argument, a host array in layout order
  // (every tower copies its gradient out). true: every tower leaves its gradient on its own
  // device, and push(nullptr, ...) averages the towers' gradients there itself (sync mode).
  virtual bool gradients_on_towers() const { return false; }
  // A store whose gradients stay on the towers may guard its updates there: true when it was
  // made to measure each update's gradient norm (check) and to clip it to `bound` (> 0) as
  // the host does (kernels/norm_rules.h), with the same bits. Then, before each push or skip,
  // gradient_norm(rec) returns the norm of the gradient that push would apply (rec: the
  // update being made; the sync average, or rec.tower's own), and push applies it clipped.
  virtual bool guards_on_towers(double /*bound*/, bool /*check*/) const { return false; }
  virtual double gradient_norm(const UpdateRecord& /*rec*/) {
    TOWERS_FAIL("this parameter store does not measure gradients on the towers");
  }
  // A tower group's towers, from their making to their end: a store that keeps state on their
  // devices makes it in attach and gives it back (after refreshing its host copy) in detach.
  virtual void attach(const std::vector<Tower*>& /*towers*/) {}
  virtual void detach() {}
  virtual int64_t pull(Tower& tower) = 0;
  // rec: the update as the pushing process knows it; push reads rec.lr (and rec.tower, the
  // pushing tower, -1 for an average). A store shared by several processes (remote) rewrites
  // rec's loss, correct, examples and contributors with the whole round's, and rec.skipped
  // when another process's loss was not finite. on: the threads a host apply runs on, span by
  // span (the pushing tower, or HostUpdate of a CpuDevice).
  virtual int64_t push(const float* grads, UpdateRecord& rec, UpdateThreads& on) = 0;
  // Advances the version without an update (a skipped step); returns it like push.
  virtual int64_t skip(UpdateRecord& rec) = 0;
  virtual void wait(int64_t ticket) = 0;
  // The parameters at the current version, in host memory (evaluation, checkpoints); the
  // optimizer's host slots are current too once it returns.
  virtual const float* host_params() = 0;
  // Per-tower clocks, all 0 after reset_clocks(towers).
  virtual void reset_clocks(int towers) = 0;
  virtual int64_t tick(int tower) = 0;  // returns the tower's new clock
  virtual int64_t clock(int tower) const = 0;
  virtual int64_t min_clock() const = 0;
};

// What the stores of one process share: the version, and the towers' clocks in memory. Their
// updates are visible when push returns, so wait returns at once.
class InProcessStore : public ParameterStore {
 public:
  int64_t version() const override { return version_.load(); }
  void restore_version(int64_t v) override { version_.store(v); }
  int64_t skip(UpdateRecord&) override { return advance(); }
  void wait(int64_t) override {}
  void reset_clocks(int towers) override { clocks_.assign(towers, 0); }
  int64_t tick(int tower) override { return ++clocks_.at(tower); }
  int64_t clock(int tower) const override { return clocks_.at(tower); }
  int64_t min_clock() const override;

 protected:
  int64_t advance() { return version_.fetch_add(1) + 1; }  // returns the new version

 private:
  std::atomic<int64_t> version_{0};
  std::vector<int64_t> clocks_;
};

// The parameters in host memory, as in the TF tutorial: towers copy them in (GPU towers from
// page-locked memory, one DMA each) and updates are applied by the host.
class LocalParameterStore final : public InProcessStore {
 public:
  // params: layout.total() floats, owned by the caller and outliving the store; opt owns the
  // slots. pin: page-lock params for GPU towers (best effort; a warning if it fails).
  LocalParameterStore(float* params, Optimizer& opt, UpdateAccess access, bool use_locking,
                      bool pin);
  UpdateAccess access() const override { return access_; }
  int64_t pull(Tower& tower) override;
  // One update in spans (UpdateThreads), each applied where its tower says: a placed tower's
  // parts each apply their own span, at the same time. The optimizer is element-wise, so the
  // spans give bitwise the update of one pass.
  int64_t push(const float* grads, UpdateRecord& rec, UpdateThreads& on) override;
  const float* host_params() override { return params_; }

 private:
  float* params_;
  Optimizer& opt_;
  UpdateAccess access_;
  bool use_locking_;
  std::shared_ptr<void> pinned_;
};

}  // namespace towers
