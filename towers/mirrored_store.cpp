#include "towers/mirrored_store.h"

#include "core/check.h"

#if TOWERS_HAVE_CUDA
#include <algorithm>
#include <cmath>
#include <exception>
#include <mutex>
#include <type_traits>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cuda_runtime.h>

#include "core/cuda_check.h"
#include "core/cuda_device.h"
#include "core/parallel.h"
#include "core/tensor.h"
#include "kernels/norm_rules.h"
#include "kernels/optimizer.h"
#include "kernels/reduce.h"
#include "towers/cuda_tower.h"
#include "towers/nccl_reduce.h"

namespace towers {

// The scalars travel as bytes, host to device: the wrappers' first, then one RuleArgs per
// trainable variable.
static_assert(std::is_trivially_copyable_v<kernels::RuleArgs>);
static_assert(std::is_trivially_copyable_v<kernels::WrapperArgs>);
static_assert(sizeof(kernels::WrapperArgs) % alignof(kernels::RuleArgs) == 0);

struct MirroredParameterStore::Impl {
  struct Replica {
    CudaTower* tower = nullptr;
    // The optimizer's slots on the tower's GPU, as many as it has: the rule's, then the
    // wrappers' ("ema", "lookahead").
    DeviceBuffer slots[4];
    // The update inside the step (one tower in sync, every tower in async and SSP): pull
    // writes the scalars of the next update (the wrappers', then one RuleArgs per trainable
    // variable) to args_h;
    // the step copies them to args_d, checks its losses into flag_d and copies the flag back
    // to flag_h (1: not applied).
    PinnedBuffer args_h, flag_h;
    DeviceBuffer args_d, flag_d;
    // The update's guard (--clip-grad-norm, --on-divergence skip-step), when on: on the GPU,
    // in doubles, the norm, the clip scale (a float), the chunks' partial sums and the
    // trainable ranges (int64 pairs); the norm comes back to norm_h.
    DeviceBuffer guard_d;
    PinnedBuffer norm_h;
    // The order a step must keep: pull (prepared), the step (stepped), push or skip. A step
    // outside it would apply an update the host never counts.
    bool prepared = false;  // args_h holds the scalars of the next update
    bool stepped = false;   // the step that applies them has run
    float prepared_lr = 0.0f;
    // Async and SSP (local SGD).
    int64_t t = 0;      // updates its slots hold (Adam's step)
    int64_t local = 0;  // steps since its last exchange
    int64_t view = 0;   // updates (since the run began) in the host copy it last took
    PinnedBuffer stage; // its parameters on their way through the exchange
    HostBuffer base;    // the host copy it took at its last exchange
  };

  float* params;
  Optimizer& opt;
  Reduce reduce;
  std::function<float(int64_t)> lr_at;
  int64_t sync_every;  // 0: sync
  double clip;         // --clip-grad-norm's bound (0: off)
  bool check;          // --on-divergence skip-step: a gradient whose norm is not finite is skipped
  std::vector<int64_t> keep;  // the trainable ranges, as the norm covers them
  std::vector<const Variable*> trainable;  // the variables the rule updates, layout order
  std::vector<int64_t> trainable_offset, trainable_size;  // theirs, for the update's launches
  std::vector<const Variable*> state;      // running averages (ParamSpec::state_rate)
  kernels::OptRule rule;
  int nslots = 0;          // the rule's slots
  int nall = 0;            // with the wrappers'
  int ema_k = -1, slow_k = -1;  // the wrappers' slots, when on
  // By pointer: each step's epilogue holds its replica.
  std::vector<std::unique_ptr<Replica>> reps;
  bool in_step = false;  // the updates run inside the towers' steps

  // Several sync towers: an NCCL all-reduce (one per GPU), or the tree on their one GPU.
  std::unique_ptr<NcclReducer> nccl;
  cudaEvent_t summed = nullptr;
  bool reduced = false;  // the update's sum is on the devices, not yet applied
  bool guarded = false;  // and guard has run on it (gradient_norm)

  // Async and SSP: the host copy's lock, and the updates folded into it since the run began.
  std::mutex host_mu;
  int64_t folded = 0;
  int64_t start = 0;  // the run's first version

  Impl(float* p, Optimizer& o, Reduce r, std::function<float(int64_t)> lr, int64_t k, double bound,
       bool chk)
      : params(p), opt(o), reduce(r), lr_at(std::move(lr)), sync_every(k), clip(bound),
        check(chk), keep(o.layout().trainable_ranges()) {
    TOWERS_CHECK(clip >= 0.0 && std::isfinite(clip), "a clip bound of {}", clip);
    for (const Variable& v : opt.layout().variables()) {
      if (v.spec.trainable) {
        trainable.push_back(&v);
        trainable_offset.push_back(v.offset);
        trainable_size.push_back(v.size);
      } else if (v.spec.state_rate != 0.0f) {
        state.push_back(&v);
      }
    }
    rule = opt.next_rule_args(0.0f).rule;
    nslots = opt.rule_slots();
    TOWERS_CHECK(nslots <= 2, "optimizer {} has {} slots; a rule reads at most 2", opt.config().name,
                 nslots);
    const std::vector<std::string>& names = opt.slot_names();
    nall = static_cast<int>(names.size());
    for (int k = nslots; k < nall; ++k) {
      TOWERS_CHECK(names[k] == "ema" || names[k] == "lookahead",
                   "optimizer slots {}: the rule's, then ema and lookahead", fmt::join(names, ", "));
      (names[k] == "ema" ? ema_k : slow_k) = k;
    }
    TOWERS_CHECK(nall <= 4 && nall - nslots == (ema_k >= 0) + (slow_k >= 0),
                 "optimizer slots {}: the rule's, then ema and lookahead", fmt::join(names, ", "));
    // Local SGD keeps a replica per tower, each folded into the host copy every K steps: one
    // replica's average or slow weights are not the run's (the trainer refuses the flags).
    TOWERS_CHECK(sync_every == 0 || nall == nslots,
                 "mirrored async and SSP towers have no --ema or --lookahead");
    TOWERS_CHECK(sync_every >= 0, "sync_every {} < 0", sync_every);
  }

  bool local() const { return sync_every > 0; }
  bool guards() const { return clip > 0.0 || check; }

  // The guard's buffers on r's GPU (guard_d's layout above).
  void make_guard(Replica& r) {
    CudaDevice& d = r.tower->device();
    const int64_t doubles = 2 + kernels::norm_chunks(opt.layout().total()) +
                            static_cast<int64_t>(keep.size());
    r.guard_d = DeviceBuffer(d, 2 * doubles);
    r.norm_h = PinnedBuffer(sizeof(double));
    d.activate();
    CUDA_CHECK(cudaMemcpyAsync(keep_d(r), keep.data(), sizeof(int64_t) * keep.size(),
                               cudaMemcpyHostToDevice, d.compute()));
    CUDA_CHECK(cudaStreamSynchronize(d.compute()));
  }
  static double* norm_d(Replica& r) { return reinterpret_cast<double*>(r.guard_d.data()); }
  static float* scale_d(Replica& r) { return r.guard_d.data() + 2; }
  static double* partials_d(Replica& r) { return norm_d(r) + 2; }
  int64_t* keep_d(Replica& r) const {
    return reinterpret_cast<int64_t*>(partials_d(r) + kernels::norm_chunks(opt.layout().total()));
  }

  // Queues on s, for gradient g on r's GPU: its norm (back to r.norm_h), and, with a bound, g's
  // trainable variables scaled by the clip; flag (if not null) set when the norm is not finite.
  void guard(Replica& r, cudaStream_t s, float* g, int32_t* flag) {
    kernels::cuda::norm_guard(s, opt.layout().total(), g, keep_d(r),
                              static_cast<int64_t>(keep.size() / 2), clip, partials_d(r),
                              norm_d(r), scale_d(r), flag);
    if (clip > 0.0)
      for (const Variable* v : trainable)
        kernels::cuda::scale_at(s, v->size, scale_d(r), g + v->offset);
    CUDA_CHECK(cudaMemcpyAsync(r.norm_h.as<void>(), norm_d(r), sizeof(double),
                               cudaMemcpyDeviceToHost, s));
  }

  float* slot(Replica& r, int k, int64_t offset) {
    return k < nslots ? r.slots[k].data() + offset : nullptr;
  }
  float* wrapper_slot(Replica& r, int k) { return k >= 0 ? r.slots[k].data() : nullptr; }

  Replica& replica_of(const Tower& t) {
    for (auto& r : reps)
      if (r->tower == &t) return *r;
    TOWERS_FAIL("a tower the mirrored store was not attached to");
  }

  // What an update does beside the rule, in the host optimizer's order (Optimizer::apply):
  // before it, update 1 starts the wrappers' slots as the parameters (begin: true); after it,
  // the state variables' running averages, Lookahead's move when due, the average. Scalars
  // from *at (device memory) when not null, else from wa; nothing when *skip is non-zero.
  void beside_rule(Replica& r, cudaStream_t s, const float* g, bool begin,
                   const kernels::WrapperArgs& wa, const kernels::WrapperArgs* at,
                   const int32_t* skip) {
    float* w = r.tower->device_params();
    float* ema = wrapper_slot(r, ema_k);
    float* slow = wrapper_slot(r, slow_k);
    const int64_t total = opt.layout().total();
    // (Scalars on the host: a step that is not due is not launched. A captured step launches
    // every kernel, and each reads at its replay whether it is due.)
    if (begin) {
      if (at != nullptr || wa.first != 0)
        kernels::cuda::wrappers_begin(s, total, w, ema, slow, wa, at, skip);
      return;
    }
    for (const Variable* v : state)
      kernels::cuda::state_update(s, v->size, w + v->offset, g + v->offset, v->spec.state_rate,
                                  skip);
    if (slow != nullptr && (at != nullptr || wa.lookahead_now != 0))
      for (const Variable* v : trainable)
        kernels::cuda::lookahead_update(s, v->size, w + v->offset, slow + v->offset, wa, at, skip);
    if (ema != nullptr) kernels::cuda::ema_update(s, total, w, ema, wa, at, skip);
  }

  // The update of replica r from gradient g (on r's GPU), queued on r's compute stream.
  void apply(Replica& r, const float* g, kernels::RuleArgs a, const kernels::WrapperArgs& wa) {
    r.tower->device().activate();
    cudaStream_t s = r.tower->device().compute();
    float* w = r.tower->device_params();
    beside_rule(r, s, g, true, wa, nullptr, nullptr);
    for (const Variable* v : trainable) {
      a.wd = v->spec.weight_decay;
      kernels::cuda::optimizer_update(s, v->size, w + v->offset, slot(r, 0, v->offset),
                                      slot(r, 1, v->offset), g + v->offset, a);
    }
    beside_rule(r, s, g, false, wa, nullptr, nullptr);
  }

  // The scalars in a replica's args buffers (host or device): the wrappers', then the rule's.
  static kernels::WrapperArgs* wrapper_args(void* args) {
    return static_cast<kernels::WrapperArgs*>(args);
  }
  static kernels::RuleArgs* rule_args(void* args) {
    return reinterpret_cast<kernels::RuleArgs*>(static_cast<char*>(args) +
                                                sizeof(kernels::WrapperArgs));
  }
  size_t args_bytes() const {
    return sizeof(kernels::WrapperArgs) + sizeof(kernels::RuleArgs) * trainable.size();
  }

  // The end of replica r's step (captured with it): the update, unless a loss is not finite.
  void enqueue_update(Replica& r, cudaStream_t s, const double* row_loss, int64_t n) {
    const kernels::RuleArgs* args = rule_args(r.args_d.data());
    const kernels::WrapperArgs* wargs = wrapper_args(r.args_d.data());
    auto* flag = reinterpret_cast<int32_t*>(r.flag_d.data());
    CUDA_CHECK(cudaMemcpyAsync(r.args_d.data(), r.args_h.as<void>(), args_bytes(),
                               cudaMemcpyHostToDevice, s));
    kernels::cuda::any_nonfinite(s, n, row_loss, flag);
    float* w = r.tower->device_params();
    float* g = r.tower->device_grads();
    if (guards()) guard(r, s, g, flag);
    beside_rule(r, s, g, true, {}, wargs, flag);
    kernels::cuda::optimizer_update_spans_at(
        s, static_cast<int>(trainable.size()), trainable_offset.data(), trainable_size.data(), w,
        slot(r, 0, 0), slot(r, 1, 0), g, rule, args, flag);
    beside_rule(r, s, g, false, {}, wargs, flag);
    CUDA_CHECK(cudaMemcpyAsync(r.flag_h.as<void>(), flag, sizeof(int32_t), cudaMemcpyDeviceToHost,
                               s));
  }

  // Makes replica r's update part of its tower's step.
  void update_in_step(Replica& r) {
    CudaDevice& d = r.tower->device();
    const size_t bytes = args_bytes();
    r.args_h = PinnedBuffer(bytes);
    r.args_d = DeviceBuffer(d, static_cast<int64_t>((bytes + sizeof(float) - 1) / sizeof(float)));
    r.flag_h = PinnedBuffer(sizeof(int32_t));
    r.flag_d = DeviceBuffer(d, 1);
    r.tower->set_step_epilogue(
        [this, &r](cudaStream_t s, const double* row_loss, int64_t rows) {
          enqueue_update(r, s, row_loss, rows);
        },
        [&r] {
          TOWERS_CHECK(r.prepared && !r.stepped,
                       "a step with mirrored parameters runs between a pull and a push");
          r.stepped = true;
        });
  }

  // pull's half of an update inside the step: the scalars of update number t at the
  // schedule's lr for version v.
  void prepare(Replica& r, int64_t v, int64_t t) {
    TOWERS_CHECK(!r.stepped, "a pull before the last step's update was pushed");
    if (r.prepared) return;
    const float lr = lr_at(v);
    kernels::RuleArgs a = opt.rule_args(lr, t);
    *wrapper_args(r.args_h.as<void>()) = opt.wrapper_args(t);
    kernels::RuleArgs* out = rule_args(r.args_h.as<void>());
    for (size_t k = 0; k < trainable.size(); ++k) {
      a.wd = trainable[k]->spec.weight_decay;
      out[k] = a;
    }
    r.prepared = true;
    r.prepared_lr = lr;
  }

  // push's and skip's half: the step ran, and applied its update exactly when applied.
  void stepped(Replica& r, bool applied) {
    TOWERS_CHECK(r.prepared && r.stepped, "an update without the step that applies it");
    const int32_t skipped = *r.flag_h.as<int32_t>();
    TOWERS_CHECK(applied == (skipped == 0), "the device {} an update the host {}",
                 applied ? "skipped" : "applied", applied ? "found finite" : "skipped");
    r.prepared = r.stepped = false;
  }

  // Async and SSP: replica r's steps join the host copy, and r takes the host copy.
  void exchange(Replica& r) {
    CudaDevice& d = r.tower->device();
    const int64_t total = opt.layout().total();
    float* w = r.stage.as<float>();
    d.copy_out(w, r.tower->device_params(), total);
    {
      std::lock_guard<std::mutex> l(host_mu);
      float* base = r.base.data();
      // On the tower's own host threads, as the host store applies.
      r.tower->host().execute([&] {
        for_chunks(total, 1 << 15, [&](int64_t, int64_t b, int64_t e) {
          for (int64_t j = b; j < e; ++j) {
            const float h = params[j];
            const float s = h == base[j] ? w[j] : w[j] + (h - base[j]);
            params[j] = base[j] = w[j] = s;
          }
        });
      });
      folded += r.local;
      r.view = folded;
    }
    r.local = 0;
    d.copy_in(r.tower->device_params(), w, total);
  }

  // Several sync towers: the update's sum, once, on the devices: NCCL's all-reduce in place
  // (every replica then holds its copy of the sum), or the tree in tower order into the first
  // tower's gradients on their one GPU (the host store's sum, bit for bit).
  void sum_towers() {
    if (reduced) return;
    if (nccl) {
      nccl->all_reduce();
    } else {
      CudaTower& t0 = *reps[0]->tower;
      t0.device().activate();
      std::vector<float*> blocks;
      for (auto& r : reps) blocks.push_back(r->tower->device_grads());
      kernels::cuda::tree_sum(t0.device().compute(), blocks.data(),
                              static_cast<int64_t>(blocks.size()), opt.layout().total());
    }
    reduced = true;
  }

  void sync_replicas() {
    for (auto& r : reps) {
      r->tower->device().activate();
      CUDA_CHECK(cudaStreamSynchronize(r->tower->device().compute()));
    }
  }

  // The host's copies: the parameters (every replica's steps folded in, in async and SSP;
  // else the first replica's) and the first replica's slots.
  void to_host() {
    if (reps.empty()) return;
    Replica& r = *reps[0];
    CudaDevice& d = r.tower->device();
    const int64_t total = opt.layout().total();
    if (local()) {
      for (auto& x : reps) {
        TOWERS_CHECK(!x->stepped, "a step applied an update that was never pushed");
        if (x->local > 0) exchange(*x);
      }
    } else {
      d.copy_out(params, r.tower->device_params(), total);
    }
    for (int k = 0; k < nall; ++k) d.copy_out(opt.slot(opt.slot_names()[k]), r.slots[k].data(), total);
  }

  void release() {
    for (auto& r : reps) {
      if (in_step) r->tower->set_step_epilogue(nullptr);
      r->tower->set_grads_to_host(true);
    }
    nccl.reset();
    if (summed) cudaEventDestroy(summed);
    summed = nullptr;
    reps.clear();
    in_step = reduced = guarded = false;
  }
};

MirroredParameterStore::MirroredParameterStore(float* params, Optimizer& opt, Reduce reduce,
                                               std::function<float(int64_t)> lr_at,
                                               int64_t sync_every, double clip_grad_norm,
                                               bool check_grad_norm)
    : impl_(std::make_unique<Impl>(params, opt, reduce, std::move(lr_at), sync_every,
                                   clip_grad_norm, check_grad_norm)) {}

// A TowerGroup detaches before its towers (and their devices) go, so replicas remain here only
// where the store goes first (a benchmark that attached towers itself): give them back.
MirroredParameterStore::~MirroredParameterStore() {
  if (impl_ && !impl_->reps.empty()) impl_->release();
}

UpdateAccess MirroredParameterStore::access() const {
  return impl_->local() ? UpdateAccess::Concurrent : UpdateAccess::Exclusive;
}

// A run starts: the updates folded are counted from here.
void MirroredParameterStore::restore_version(int64_t v) {
  InProcessStore::restore_version(v);
  Impl& m = *impl_;
  std::lock_guard<std::mutex> l(m.host_mu);
  m.start = v;
  m.folded = 0;
  for (auto& r : m.reps) r->view = r->local = 0;
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
      m.reps.push_back(std::make_unique<Impl::Replica>());
      m.reps.back()->tower = ct;
    }
    TOWERS_CHECK(m.local() || n == 1 || one_gpu || m.reduce == Reduce::Nccl,
                 "mirrored towers on several GPUs average with NCCL");
    TOWERS_REQUIRE(m.local() || !one_gpu || n <= kernels::cuda::kMaxTreeBlocks,
                   "{} towers share one GPU; with mirrored parameters at most {} can", n,
                   kernels::cuda::kMaxTreeBlocks);
    const int64_t total = m.opt.layout().total();
    for (auto& rp : m.reps) {
      Impl::Replica& r = *rp;
      CudaDevice& d = r.tower->device();
      for (int k = 0; k < m.nall; ++k) {
        r.slots[k] = DeviceBuffer(d, total);
        d.copy_in(r.slots[k].data(), m.opt.slot(m.opt.slot_names()[k]), total);
      }
      d.copy_in(r.tower->device_params(), m.params, total);
      if (m.guards()) m.make_guard(r);
      r.tower->set_grads_to_host(false);
    }
    m.in_step = m.local() || n == 1;
    if (m.in_step)
      for (auto& r : m.reps) m.update_in_step(*r);
    if (m.local()) {
      m.folded = 0;
      for (auto& r : m.reps) {
        r->t = m.opt.updates();
        r->stage = PinnedBuffer(sizeof(float) * total);
        r->base = HostBuffer(total);
        std::copy(m.params, m.params + total, r->base.data());
      }
    } else if (n > 1 && !one_gpu) {
      m.nccl = std::make_unique<NcclReducer>(towers);
    } else if (n > 1) {
      m.reps[0]->tower->device().activate();
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

int64_t MirroredParameterStore::pull(Tower& tower) {
  Impl& m = *impl_;
  if (m.local()) {
    Impl::Replica& r = m.replica_of(tower);
    m.prepare(r, version(), r.t + 1);
    return m.start + r.view + r.local;
  }
  if (m.in_step) m.prepare(*m.reps[0], version(), m.opt.updates() + 1);
  return version();
}

int64_t MirroredParameterStore::push(const float* grads, UpdateRecord& rec, UpdateThreads&) {
  Impl& m = *impl_;
  TOWERS_CHECK(grads == nullptr, "a mirrored store averages the towers' own gradients");
  TOWERS_CHECK(!m.reps.empty(), "a mirrored store pushed to before attach");
  if (m.local()) {
    TOWERS_CHECK(rec.tower >= 0 && rec.tower < static_cast<int>(m.reps.size()),
                 "a push from tower {} of {}", rec.tower, m.reps.size());
    Impl::Replica& r = *m.reps[rec.tower];
    m.stepped(r, true);
    rec.lr = r.prepared_lr;  // the step has applied its update at the lr of its pull
    ++r.t;
    m.opt.count_update();
    const int64_t v = advance();
    if (++r.local >= m.sync_every) m.exchange(r);
    return v;
  }
  if (m.in_step) {
    // The step has applied it already; here the host's view and the device's must agree.
    m.stepped(*m.reps[0], true);
    TOWERS_CHECK(rec.lr == m.reps[0]->prepared_lr,
                 "the step applied learning rate {} but the update is at {}",
                 m.reps[0]->prepared_lr, rec.lr);
  } else {
    const kernels::RuleArgs a = m.opt.next_rule_args(rec.lr);
    const kernels::WrapperArgs wa = m.opt.wrapper_args(m.opt.updates() + 1);
    TOWERS_CHECK(!m.guards() || m.guarded,
                 "a guarded update pushed without its gradient norm (gradient_norm)");
    m.sum_towers();
    if (m.nccl) {
      for (auto& r : m.reps) m.apply(*r, r->tower->device_grads(), a, wa);
    } else {
      // One GPU: every replica reads the sum in the first tower's gradients.
      CudaTower& t0 = *m.reps[0]->tower;
      t0.device().activate();
      CUDA_CHECK(cudaEventRecord(m.summed, t0.device().compute()));
      for (auto& r : m.reps) {
        CUDA_CHECK(cudaStreamWaitEvent(r->tower->device().compute(), m.summed, 0));
        m.apply(*r, t0.device_grads(), a, wa);
      }
    }
    // Every replica done before any tower's next step overwrites a gradient another reads.
    m.sync_replicas();
    m.reduced = m.guarded = false;
  }
  m.opt.count_update();
  return advance();
}

int64_t MirroredParameterStore::skip(UpdateRecord& rec) {
  Impl& m = *impl_;
  if (m.local()) {
    TOWERS_CHECK(rec.tower >= 0 && rec.tower < static_cast<int>(m.reps.size()),
                 "a skip from tower {} of {}", rec.tower, m.reps.size());
    Impl::Replica& r = *m.reps[rec.tower];
    m.stepped(r, false);
    const int64_t v = advance();
    if (++r.local >= m.sync_every) m.exchange(r);
    return v;
  }
  if (m.in_step) m.stepped(*m.reps[0], false);
  m.reduced = m.guarded = false;  // a sum gradient_norm made is dropped
  return advance();
}

bool MirroredParameterStore::guards_on_towers(double bound, bool check) const {
  return impl_->clip == bound && impl_->check == check;
}

double MirroredParameterStore::gradient_norm(const UpdateRecord& rec) {
  Impl& m = *impl_;
  TOWERS_CHECK(m.guards(), "a mirrored store made without a gradient guard");
  if (m.local() || m.in_step) {
    // The step measured (and clipped) its gradient, and has ended.
    const int i = m.local() ? rec.tower : 0;
    TOWERS_CHECK(i >= 0 && i < static_cast<int>(m.reps.size()), "the norm of tower {} of {}", i,
                 m.reps.size());
    Impl::Replica& r = *m.reps[i];
    TOWERS_CHECK(r.prepared && r.stepped, "a gradient norm before the step that measures it");
    return *r.norm_h.as<double>();
  }
  // Several sync towers: the sum now, its guard on every copy of it, read back.
  if (!m.guarded) {
    m.sum_towers();
    for (auto& r : m.reps) {
      if (!m.nccl && r != m.reps[0]) continue;  // one GPU: the sum is the first tower's
      r->tower->device().activate();
      m.guard(*r, r->tower->device().compute(), r->tower->device_grads(), nullptr);
    }
    m.sync_replicas();
    m.guarded = true;
  }
  return *m.reps[0]->norm_h.as<double>();
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
                                               std::function<float(int64_t)>, int64_t, double,
                                               bool) {
  TOWERS_BAD_INPUT("--params mirrored: this towers was built without CUDA");
}
MirroredParameterStore::~MirroredParameterStore() = default;
UpdateAccess MirroredParameterStore::access() const { return UpdateAccess::Exclusive; }
void MirroredParameterStore::restore_version(int64_t v) { InProcessStore::restore_version(v); }
void MirroredParameterStore::attach(const std::vector<Tower*>&) {}
void MirroredParameterStore::detach() {}
int64_t MirroredParameterStore::pull(Tower&) { return version(); }
int64_t MirroredParameterStore::push(const float*, UpdateRecord&, UpdateThreads&) { return advance(); }
int64_t MirroredParameterStore::skip(UpdateRecord&) { return advance(); }
bool MirroredParameterStore::guards_on_towers(double, bool) const { return false; }
double MirroredParameterStore::gradient_norm(const UpdateRecord&) { return 0.0; }
const float* MirroredParameterStore::host_params() { return nullptr; }

}  // namespace towers

#endif
