// mirrored_store.h — `--params mirrored`: the parameters and optimizer slots live on the GPUs,
// one copy (a replica) per GPU tower, as in TF's MirroredStrategy; the host copy is refreshed
// only for evaluation, checkpoints and the end of the run. Sync mode only (every tower's
// gradient in every update); the towers' gradients never leave their devices.
//
// One tower: the update is part of the tower's step, the last kernels of its CUDA graph
// (CudaTower::set_step_epilogue):
//     forward -> loss -> backward -> [scalars H2D] -> loss check -> optimizer, per variable
// The scalars of the update (learning rate, Adam's bias correction, each variable's weight
// decay) are written to page-locked memory by pull, before the step, and copied to the device
// by the step itself, so one captured graph serves every step. If any example's loss is not
// finite the optimizer kernels write nothing, as the host-parameter path skips such an update.
// Several towers: after every tower's step, the gradients are summed on the devices (by the
// fixed tree of kernels/reduce.h when the towers share one GPU, by an NCCL all-reduce with one
// tower per GPU) and every replica applies the sum with kernels::cuda::optimizer_update. With
// the tree, every replica computes the same bits as the host store would.
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
  MirroredParameterStore(float* params, Optimizer& opt, Reduce reduce,
                         std::function<float(int64_t)> lr_at);
  ~MirroredParameterStore() override;

  UpdateAccess access() const override { return UpdateAccess::Exclusive; }
  bool gradients_on_towers() const override { return true; }
  // Every tower must be a CudaTower. Copies the host parameters and slots to each replica.
  void attach(const std::vector<Tower*>& towers) override;
  void detach() override;
  // A tower's replica is always current: nothing is copied.
  int64_t pull(Tower& tower) override;
  // grads must be null: the towers' own gradients are averaged and applied.
  int64_t push(const float* grads, UpdateRecord& rec, CpuDevice& host) override;
  int64_t skip(UpdateRecord& rec) override;
  const float* host_params() override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace towers
