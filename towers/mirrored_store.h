// mirrored_store.h — `--params mirrored`: the parameters and optimizer slots live on the GPUs,
// one copy (a replica) per GPU tower, as in TF's MirroredStrategy; the host copy is refreshed
// only for evaluation, checkpoints and the end of the run. The towers' gradients never leave
// their devices.
//
// Sync (sync_every = 0): every tower's gradient goes into every update.
// One tower: the update is part of the tower's step, the last kernels of its CUDA graph
// (CudaTower::set_step_epilogue):
//     forward -> loss -> backward -> [scalars H2D] -> loss check -> [norm, clip] -> optimizer,
//     per variable
// The scalars of the update (learning rate, Adam's bias correction, each variable's weight
// decay, the wrappers') are written to page-locked memory by pull, before the step, and copied
// to the device by the step itself, so one captured graph serves every step. If any example's
// loss is not finite the optimizer kernels write nothing, as the host-parameter path skips such
// an update. With --clip-grad-norm or --on-divergence skip-step the step also takes its
// gradient's norm, in the host's order (kernels/norm_rules.h), clips the gradient by it, and
// writes nothing when it is not finite; the norm comes back with the step's losses.
// "optimizer" is the whole of Optimizer::apply, in its order and rounding: update 1 starts the
// wrappers' slots (--ema, --lookahead), then the rule, the state variables' running averages
// (from the steps' deltas, which travel with the gradients), Lookahead's move when due, the
// average.
// Several towers: after every tower's step, the gradients are summed on the devices (by the
// fixed tree of kernels/reduce.h when the towers share one GPU, by an NCCL all-reduce with one
// tower per GPU) and every replica applies the sum with kernels::cuda::optimizer_update (and
// the state and wrapper steps, as above, with the scalars passed from the host). With
// the tree, every replica computes the same bits as the host store would.
//
// Async and SSP (sync_every = K >= 1, `--sync-every K`, local SGD): every tower applies its
// own gradient to its own replica inside its step, as one tower does in sync, at its own pace.
// After every K of its steps a tower exchanges with the host copy:
//     host <- w + (host - base);  w <- host;  base <- host
// where w is its replica and base the host copy it took at its last exchange: its K updates
// join the host copy, and it takes what the other towers have folded in meanwhile. Elements
// that no other tower changed (host == base) take w exactly, so one tower trains bitwise like
// sync. The exchange is serialised by a lock on the host copy (--use-locking adds nothing).
// Staleness: an update's staleness is the number of updates applied anywhere that its
// replica has not seen (the other towers' steps since its last exchange, and theirs not yet
// folded in); with one tower it is 0. The SSP bound still counts steps: the fastest tower is
// at most S steps ahead of the slowest, and sees its updates only through the host copy.
// Each replica keeps its own optimizer slots (Adam's step count too); host_params() folds in
// every tower's pending steps (so an evaluation or a checkpoint holds every counted update)
// and copies the first replica's slots to the host, which a resumed run gives every replica.
// A step's learning rate is the schedule's at the version its tower pulled at.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "optim/optimizer.h"
#include "towers/modes/mode.h"
#include "towers/parameter_store.h"

namespace towers {

class MirroredParameterStore final : public InProcessStore {
 public:
  // params: the host copy (layout.total() floats, owned by the caller, outliving the store),
  // which seeds the replicas and is refreshed from the first one by host_params(). opt: the
  // configuration, update count and host slots the replicas mirror. reduce: how several towers
  // on several GPUs average (Nccl: one tower per GPU). lr_at(v): the learning rate of the
  // update that makes version v + 1 (the schedule), needed before the step that applies it.
  // sync_every: 0 for sync mode, K >= 1 for async and SSP (local SGD, above).
  // clip_grad_norm (> 0) and check_grad_norm: the update's guard (--clip-grad-norm,
  // --on-divergence skip-step), on the GPUs (guards_on_towers).
  MirroredParameterStore(float* params, Optimizer& opt, Reduce reduce,
                         std::function<float(int64_t)> lr_at, int64_t sync_every = 0,
                         double clip_grad_norm = 0.0, bool check_grad_norm = false);
  ~MirroredParameterStore() override;

  UpdateAccess access() const override;
  void restore_version(int64_t v) override;
  bool gradients_on_towers() const override { return true; }
  // Every tower must be a CudaTower. Copies the host parameters and slots to each replica.
  void attach(const std::vector<Tower*>& towers) override;
  void detach() override;
  // A tower's replica is always current: nothing is copied. Returns the version (sync), or
  // the number of updates the tower's replica holds (async, SSP).
  int64_t pull(Tower& tower) override;
  // grads must be null: the towers' own gradients are averaged and applied (sync), or the
  // update rec.tower's step has applied is counted, and every K-th exchanged (async, SSP;
  // rec.lr becomes the learning rate the step applied).
  int64_t push(const float* grads, UpdateRecord& rec, UpdateThreads& on) override;
  int64_t skip(UpdateRecord& rec) override;
  // True for the guard the store was made with. Then each update's gradient norm is taken on
  // the GPU, in the host's order (kernels/norm_rules.h), and the gradient clipped there: by
  // the step itself where the update is inside it (the norm comes back with the step), else
  // on the sum of several sync towers, which gradient_norm makes and push then applies.
  bool guards_on_towers(double bound, bool check) const override;
  double gradient_norm(const UpdateRecord& rec) override;
  // Async and SSP: called while no tower is in a step (side work, the end of the run).
  const float* host_params() override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace towers
