#include "towers/mirrored_store.h"

#include "core/check.h"

#if TOWERS_HAVE_CUDA
#include <algorithm>
#include <exception>
#include <type_traits>

#include <fmt/format.h>

#include <cuda_runtime.h>

#include "core/cuda_check.h"
#include "core/cuda_device.h"
#include "kernels/optimizer.h"
#include "kernels/reduce.h"
#include "towers/cuda_tower.h"
#include "towers/nccl_reduce.h"

namespace towers {

// The scalars travel as bytes, host to device.
static_assert(std::is_trivially_copyable_v<kernels::RuleArgs>);

struct MirroredParameterStore::Impl {
  struct Replica {
    CudaTower* tower = nullptr;
    DeviceBuffer slots[2];  // the optimizer's slots on the tower's GPU (as many as it has)
  };

  float* params;
  Optimizer& opt;
  Reduce reduce;
  std::function<float(int64_t)> lr_at;
  std::vector<const Variable*> trainable;  // the variables an update touches, layout order
  kernels::OptRule rule;
  int nslots = 0;
  std::vector<Replica> reps;

  // One tower: the update runs inside its step. pull writes the scalars of the next update
  // (one RuleArgs per trainable variable) to args_h; the step copies them to args_d, checks its
  // losses into flag_d and copies the flag back to flag_h (1: not applied).
  bool in_step = false;
  PinnedBuffer args_h, flag_h;
  DeviceBuffer args_d, flag_d;
  // The order a one-tower step must keep: pull (prepared), the step (stepped), push or skip.
  // A step outside it would apply an update the host never counts.
  bool prepared = false;  // args_h holds the scalars of the version's update
  bool stepped = false;   // the step that applies them has run
  float prepared_lr = 0.0f;

  // Several towers: an NCCL all-reduce (one per GPU), or the tree on their one GPU.
  std::unique_ptr<NcclReducer> nccl;
  cudaEvent_t summed = nullptr;

  Impl(float* p, Optimizer& o, Reduce r, std::function<float(int64_t)> lr)
      : params(p), opt(o), reduce(r), lr_at(std::move(lr)) {
    for (const Variable& v : opt.layout().variables())
      if (v.spec.trainable) trainable.push_back(&v);
    rule = opt.next_rule_args(0.0f).rule;
    nslots = static_cast<int>(opt.slot_names().size());
    TOWERS_CHECK(nslots <= 2, "optimizer {} has {} slots; a rule reads at most 2", opt.config().name,
                 nslots);
  }

  float* slot(Replica& r, int k, int64_t offset) {
    return k < nslots ? r.slots[k].data() + offset : nullptr;
  }

  // The update of replica r from gradient g (on r's GPU), queued on r's compute stream.
  void apply(Replica& r, const float* g, kernels::RuleArgs a) {
    r.tower->device().activate();
    cudaStream_t s = r.tower->device().compute();
    float* w = r.tower->device_params();
    for (const Variable* v : trainable) {
      a.wd = v->spec.weight_decay;
      kernels::cuda::optimizer_update(s, v->size, w + v->offset, slot(r, 0, v->offset),
                                      slot(r, 1, v->offset), g + v->offset, a);
    }
  }

  // The end of a one-tower step (captured with it): the update, unless a loss is not finite.
  void enqueue_update(cudaStream_t s, const double* row_loss, int64_t n) {
    Replica& r = reps[0];
    auto* args = reinterpret_cast<const kernels::RuleArgs*>(args_d.data());
    auto* flag = reinterpret_cast<int32_t*>(flag_d.data());
    CUDA_CHECK(cudaMemcpyAsync(args_d.data(), args_h.as<void>(),
                               sizeof(kernels::RuleArgs) * trainable.size(),
                               cudaMemcpyHostToDevice, s));
    kernels::cuda::any_nonfinite(s, n, row_loss, flag);
    float* w = r.tower->device_params();
    const float* g = r.tower->device_grads();
    for (size_t k = 0; k < trainable.size(); ++k) {
      const Variable* v = trainable[k];
      kernels::cuda::optimizer_update_at(s, v->size, w + v->offset, slot(r, 0, v->offset),
                                         slot(r, 1, v->offset), g + v->offset, rule, args + k,
                                         flag);
    }
    CUDA_CHECK(cudaMemcpyAsync(flag_h.as<void>(), flag, sizeof(int32_t), cudaMemcpyDeviceToHost, s));
  }

  // The first replica's parameters and slots into the host copies.
  void to_host() {
    if (reps.empty()) return;
    Replica& r = reps[0];
    CudaDevice& d = r.tower->device();
    const int64_t total = opt.layout().total();
    d.copy_out(params, r.tower->device_params(), total);
    for (int k = 0; k < nslots; ++k) d.copy_out(opt.slot(opt.slot_names()[k]), r.slots[k].data(), total);
  }

  void release() {
    if (in_step && !reps.empty()) reps[0].tower->set_step_epilogue(nullptr);
    for (Replica& r : reps) r.tower->set_grads_to_host(true);
    nccl.reset();
    if (summed) cudaEventDestroy(summed);
    summed = nullptr;
    args_d = DeviceBuffer();
    flag_d = DeviceBuffer();
    args_h = PinnedBuffer();
    flag_h = PinnedBuffer();
    reps.clear();
    in_step = prepared = stepped = false;
  }
};

MirroredParameterStore::MirroredParameterStore(float* params, Optimizer& opt, Reduce reduce,
                                               std::function<float(int64_t)> lr_at)
    : impl_(std::make_unique<Impl>(params, opt, reduce, std::move(lr_at))) {}

// A TowerGroup detaches before its towers (and their devices) go, so replicas remain here only
// where the store goes first (a benchmark that attached towers itself): give them back.
MirroredParameterStore::~MirroredParameterStore() {
  if (impl_ && !impl_->reps.empty()) impl_->release();
}

void MirroredParameterStore::attach(const std::vector<Tower*>& towers) {
  Impl& m = *impl_;
  TOWERS_CHECK(m.reps.empty(), "a mirrored store attached twice");
  TOWERS_CHECK(!towers.empty(), "a mirrored store without towers");
  const int n = static_cast<int>(towers.size());
  try {
    bool one_gpu = true;
    for (Tower* t : towers) {
      auto* ct = dynamic_cast<CudaTower*>(t);
      TOWERS_CHECK(ct != nullptr, "mirrored parameters need GPU towers");
      one_gpu = one_gpu && ct->device().ordinal() ==
                               static_cast<CudaTower*>(towers[0])->device().ordinal();
      m.reps.push_back(Impl::Replica{ct, {}});
    }
    TOWERS_CHECK(n == 1 || one_gpu || m.reduce == Reduce::Nccl,
                 "mirrored towers on several GPUs average with NCCL");
    TOWERS_REQUIRE(!one_gpu || n <= kernels::cuda::kMaxTreeBlocks,
                   "{} towers share one GPU; with mirrored parameters at most {} can", n,
                   kernels::cuda::kMaxTreeBlocks);
    for (const Variable& v : m.opt.layout().variables())
      TOWERS_REQUIRE(v.spec.trainable,
                     "--params mirrored: variable {} is layer state (running statistics), which "
                     "mirrored parameters do not carry yet; use --params host",
                     v.spec.name);
    const int64_t total = m.opt.layout().total();
    for (Impl::Replica& r : m.reps) {
      CudaDevice& d = r.tower->device();
      for (int k = 0; k < m.nslots; ++k) {
        r.slots[k] = DeviceBuffer(d, total);
        d.copy_in(r.slots[k].data(), m.opt.slot(m.opt.slot_names()[k]), total);
      }
      d.copy_in(r.tower->device_params(), m.params, total);
      r.tower->set_grads_to_host(false);
    }
    CudaDevice& d0 = m.reps[0].tower->device();
    if (n == 1) {
      const size_t bytes = sizeof(kernels::RuleArgs) * std::max<size_t>(m.trainable.size(), 1);
      m.args_h = PinnedBuffer(bytes);
      m.args_d = DeviceBuffer(d0, static_cast<int64_t>((bytes + sizeof(float) - 1) / sizeof(float)));
      m.flag_h = PinnedBuffer(sizeof(int32_t));
      m.flag_d = DeviceBuffer(d0, 1);
      m.in_step = true;
      m.reps[0].tower->set_step_epilogue(
          [&m](cudaStream_t s, const double* row_loss, int64_t rows) {
            m.enqueue_update(s, row_loss, rows);
          },
          [&m] {
            TOWERS_CHECK(m.prepared && !m.stepped,
                         "a step with mirrored parameters runs between a pull and a push");
            m.stepped = true;
          });
    } else if (!one_gpu) {
      m.nccl = std::make_unique<NcclReducer>(towers);
    } else {
      d0.activate();
      CUDA_CHECK(cudaEventCreateWithFlags(&m.summed, cudaEventDisableTiming));
    }
  } catch (...) {
    m.release();
    throw;
  }
}

// Called from ~TowerGroup: it must not throw. After a CUDA error (the reason a run is
// unwinding) the device copy may be unreadable; the host copy then keeps the last version it
// received, and the error that stopped the run is the one reported.
void MirroredParameterStore::detach() {
  if (std::uncaught_exceptions() == 0) {
    try {
      impl_->to_host();
    } catch (const std::exception& e) {
      fmt::print(stderr, "towers: warning: the GPU parameters could not be copied back: {}\n",
                 e.what());
    }
  }
  impl_->release();
}

int64_t MirroredParameterStore::pull(Tower&) {
  Impl& m = *impl_;
  TOWERS_CHECK(!m.stepped, "a pull before the last step's update was pushed");
  if (m.in_step && !m.prepared) {
    // The scalars of the update this version's step will apply, read by the step itself.
    const float lr = m.lr_at(version());
    kernels::RuleArgs a = m.opt.next_rule_args(lr);
    auto* out = m.args_h.as<kernels::RuleArgs>();
    for (size_t k = 0; k < m.trainable.size(); ++k) {
      a.wd = m.trainable[k]->spec.weight_decay;
      out[k] = a;
    }
    m.prepared = true;
    m.prepared_lr = lr;
  }
  return version();
}

int64_t MirroredParameterStore::push(const float* grads, UpdateRecord& rec, CpuDevice&) {
  const float lr = rec.lr;
  Impl& m = *impl_;
  TOWERS_CHECK(grads == nullptr, "a mirrored store averages the towers' own gradients");
  TOWERS_CHECK(!m.reps.empty(), "a mirrored store pushed to before attach");
  if (m.in_step) {
    // The step has applied it already; here the host's view and the device's must agree.
    TOWERS_CHECK(m.prepared && m.stepped, "an update without the step that applies it");
    TOWERS_CHECK(lr == m.prepared_lr, "the step applied learning rate {} but the update is at {}",
                 m.prepared_lr, lr);
    TOWERS_CHECK(*m.flag_h.as<int32_t>() == 0,
                 "the device skipped an update whose loss the host found finite");
    m.prepared = m.stepped = false;
  } else {
    const kernels::RuleArgs a = m.opt.next_rule_args(lr);
    if (m.nccl) {
      m.nccl->all_reduce();  // in place; each replica applies its own copy of the sum
      for (Impl::Replica& r : m.reps) m.apply(r, r.tower->device_grads(), a);
    } else {
      // One GPU: the tree in tower order into the first tower's gradients (the host store's
      // sum, bit for bit), which every replica then reads.
      CudaTower& t0 = *m.reps[0].tower;
      t0.device().activate();
      std::vector<float*> blocks;
      for (Impl::Replica& r : m.reps) blocks.push_back(r.tower->device_grads());
      kernels::cuda::tree_sum(t0.device().compute(), blocks.data(),
                              static_cast<int64_t>(blocks.size()), m.opt.layout().total());
      CUDA_CHECK(cudaEventRecord(m.summed, t0.device().compute()));
      for (Impl::Replica& r : m.reps) {
        CUDA_CHECK(cudaStreamWaitEvent(r.tower->device().compute(), m.summed, 0));
        m.apply(r, t0.device_grads(), a);
      }
    }
    // Every replica done before any tower's next step overwrites a gradient another reads.
    for (Impl::Replica& r : m.reps) {
      r.tower->device().activate();
      CUDA_CHECK(cudaStreamSynchronize(r.tower->device().compute()));
    }
  }
  m.opt.count_update();
  return advance();
}

int64_t MirroredParameterStore::skip(UpdateRecord&) {
  Impl& m = *impl_;
  if (m.in_step) {
    TOWERS_CHECK(m.prepared && m.stepped && *m.flag_h.as<int32_t>() != 0,
                 "the device applied an update the host skipped");
    m.prepared = m.stepped = false;
  }
  return advance();
}

const float* MirroredParameterStore::host_params() {
  impl_->to_host();
  return impl_->params;
}

}  // namespace towers

#else  // a build without CUDA has no GPU towers to mirror parameters on

namespace towers {

struct MirroredParameterStore::Impl {};

MirroredParameterStore::MirroredParameterStore(float*, Optimizer&, Reduce,
                                               std::function<float(int64_t)>) {
  TOWERS_BAD_INPUT("--params mirrored: this towers was built without CUDA");
}
MirroredParameterStore::~MirroredParameterStore() = default;
void MirroredParameterStore::attach(const std::vector<Tower*>&) {}
void MirroredParameterStore::detach() {}
int64_t MirroredParameterStore::pull(Tower&) { return version(); }
int64_t MirroredParameterStore::push(const float*, UpdateRecord&, CpuDevice&) { return advance(); }
int64_t MirroredParameterStore::skip(UpdateRecord&) { return advance(); }
const float* MirroredParameterStore::host_params() { return nullptr; }

}  // namespace towers

#endif
