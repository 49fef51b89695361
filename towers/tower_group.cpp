#include "towers/tower_group.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <mutex>
#include <shared_mutex>
#include <thread>

#include <oneapi/tbb/global_control.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/task_arena.h>
#include <oneapi/tbb/task_group.h>

#include "core/check.h"
#include "core/clock.h"
#include "core/parallel.h"
#include "core/gpu.h"
#include "core/rng.h"
#include "kernels/norm_rules.h"
#include "towers/nccl_reduce.h"
#include "towers/tower_exchange.h"

namespace towers {

std::optional<Reduce> reduce_named(const std::string& s) {
  if (s == "host") return Reduce::Host;
  if (s == "nccl") return Reduce::Nccl;
  return std::nullopt;
}

UpdateAccess store_access(const EngineConfig& cfg) {
  const int k = cfg.replicas_to_aggregate == 0 ? cfg.towers : cfg.replicas_to_aggregate;
  return cfg.mode == Mode::Sync && k == cfg.towers ? UpdateAccess::Exclusive
                                                   : UpdateAccess::Concurrent;
}

bool store_locking(const EngineConfig& cfg) { return cfg.mode != Mode::Sync && cfg.use_locking; }

TowerGroup::TowerGroup(const Graph& graph, EngineConfig cfg, int64_t batch, ParameterStore& store,
                       const TowerFactory& make)
    : graph_(graph), cfg_(std::move(cfg)), batch_(batch), store_(store), stats_(cfg_.towers) {
  TOWERS_CHECK(cfg_.towers >= 1 && cfg_.threads_per_tower >= 1, "bad tower config");
  TOWERS_CHECK(store_.access() == store_access(cfg_),
               "the parameter store's update access does not suit mode {}", mode_name(cfg_.mode));
  if (cfg_.replicas_to_aggregate == 0) cfg_.replicas_to_aggregate = cfg_.towers;
  if (!cfg_.late_towers.empty()) {
    // A late tower waits until the others can go no further without it (step): they must be
    // able to, or it waits forever.
    const int late = static_cast<int>(cfg_.late_towers.size());
    const bool backup = cfg_.mode == Mode::Sync && late <= cfg_.towers - cfg_.replicas_to_aggregate;
    const bool ssp = cfg_.mode == Mode::Ssp && late < cfg_.towers;
    TOWERS_CHECK((backup || ssp) && cfg_.total_towers() == cfg_.towers,
                 "late towers need sync with that many backup towers, or ssp with a tower that "
                 "is not late, in one process");
  }
  const bool cuda = cfg_.device == DeviceKind::Cuda;
  TOWERS_CHECK(!cuda || cfg_.gpus >= 1, "a CUDA tower group needs at least one GPU");
  for (int i = 0; i < cfg_.towers; ++i) {
    TowerPlacement p;
    p.kind = cfg_.device;
    p.threads = cfg_.threads_per_tower;
    p.gpu = cuda ? i % cfg_.gpus : 0;
    p.tf32 = cfg_.tf32;
    p.cuda_graphs = cfg_.cuda_graphs;
    p.backward_branches = cfg_.backward_branches;
    p.cudnn = cfg_.cudnn;
    towers_.push_back(make(graph, batch, p));
  }
  if (cfg_.sync_bn && cfg_.towers > 1) {
    TOWERS_CHECK(cfg_.mode == Mode::Sync && cfg_.replicas_to_aggregate == cfg_.towers &&
                     cfg_.total_towers() == cfg_.towers,
                 "--sync-bn is for sync towers of one process without backup towers");
    exchange_ = std::make_unique<TowerExchangeGroup>(cfg_.towers);
    for (int i = 0; i < cfg_.towers; ++i) towers_[i]->set_exchange(&exchange_->member(i));
  }
  const int64_t total = graph.layout().total();
  clipped_.resize(cfg_.towers);
  std::vector<Tower*> ts;
  for (auto& t : towers_) ts.push_back(t.get());
  if (store_.gradients_on_towers()) {
    // The store averages on the towers' devices and applies there (sync), or applies each
    // tower's gradient to the tower's own replica (async, SSP): no host sum, no guard that
    // reads the gradient.
    TOWERS_CHECK(cfg_.mode != Mode::Sync || cfg_.replicas_to_aggregate == cfg_.towers,
                 "a store that keeps the gradients on the towers has no backup towers");
    TOWERS_CHECK(cfg_.mode == Mode::Sync || !cfg_.staleness_aware_lr,
                 "a store that applies inside the step sets the learning rate at the pull");
    TOWERS_CHECK((cfg_.clip_grad_norm == 0.0 && !cfg_.check_grad_norm) ||
                     store_.guards_on_towers(cfg_.clip_grad_norm, cfg_.check_grad_norm),
                 "a store that averages on the towers and does not clip or check the gradient "
                 "there");
    store_.attach(ts);
    return;
  }
  if (cfg_.towers > 1) grad_sum_.resize(total);
  if (cuda && cfg_.towers > 1)
    pinned_sum_ = pin_host_memory(grad_sum_.data(), sizeof(float) * total);
  if (cfg_.reduce == Reduce::Nccl) {
    TOWERS_CHECK(cuda, "an NCCL reduction needs CUDA towers");
    TOWERS_CHECK(cfg_.mode == Mode::Sync && cfg_.replicas_to_aggregate == cfg_.towers,
                 "an NCCL reduction is for sync mode without backup towers (it averages every "
                 "tower's gradient at once)");
    if (cfg_.towers > 1) nccl_ = std::make_unique<NcclReducer>(ts);
  }
  store_.attach(ts);
}

// The store gives back what it keeps on the towers' devices while they still exist.
TowerGroup::~TowerGroup() { store_.detach(); }

namespace {
// The noise key of the training step on the batch at `step` of the run's data stream (a
// sync global batch, or one tower's batch): a function of the seed and the batch alone, so a
// resumed run draws the masks of the uninterrupted one.
uint64_t step_key(uint64_t seed, int64_t step) {
  return hash_combine(seed, static_cast<uint64_t>(step));
}

// The L2 norm of x over the trainable variables (a state variable's delta is no gradient), in
// double, in the order of kernels/norm_rules.h: chunks of fixed size, each in its lanes, the
// chunks' totals added in chunk order. The same bits for any number of threads, and those a
// store that keeps the gradients on a GPU computes there (MirroredParameterStore).
double l2_norm(const float* x, const ParameterLayout& layout) {
  const std::vector<int64_t> keep = layout.trainable_ranges();
  const int64_t nkeep = static_cast<int64_t>(keep.size() / 2);
  std::vector<double> part(static_cast<size_t>(kernels::norm_chunks(layout.total())), 0.0);
  for_chunks(layout.total(), kernels::kNormChunk, [&](int64_t k, int64_t b, int64_t e) {
    part[k] = kernels::norm_chunk(x, b, e, keep.data(), nkeep);
  });
  double s = 0.0;
  for (double p : part) s += p;
  return std::sqrt(s);
}
}  // namespace

void TowerGroup::guarded_push(const float* grads, int tower, UpdateRecord& rec) {
  CpuDevice& host = towers_[tower]->host();
  const int64_t total = graph_.layout().total();
  bool finite = std::isfinite(rec.loss);
  // grads is null when the store keeps the gradients on the towers: it measures the norm, and
  // clips, there (guards_on_towers).
  if (finite && (cfg_.clip_grad_norm > 0.0 || cfg_.check_grad_norm)) {
    rec.grad_norm = grads != nullptr
                        ? host.execute([&] { return l2_norm(grads, graph_.layout()); })
                        : store_.gradient_norm(rec);
    finite = std::isfinite(rec.grad_norm);
  }
  if (!finite) {
    rec.skipped = true;
    rec.version = store_.skip(rec);
    return;
  }
  if (grads != nullptr && cfg_.clip_grad_norm > 0.0 && rec.grad_norm > cfg_.clip_grad_norm) {
    // Scaled to the bound (norm_clip_scale), into a buffer of the pushing tower: the gradient buffer belongs to
    // a tower or to the sum. Towers push one update at a time each.
    HostBuffer& buf = clipped_[tower];
    if (buf.size() != total) buf = HostBuffer(total);
    float* dst = buf.data();
    const float scale = kernels::norm_clip_scale(rec.grad_norm, cfg_.clip_grad_norm);
    host.execute([&] {
      for_chunks(total, 1 << 15, [&](int64_t, int64_t b, int64_t e) {
        for (int64_t j = b; j < e; ++j) dst[j] = grads[j] * scale;
      });
    });
    for (const Variable& v : graph_.layout().variables())  // state deltas are not clipped
      if (!v.spec.trainable) std::copy(grads + v.offset, grads + v.offset + v.size, dst + v.offset);
    grads = dst;
  }
  rec.version = store_.push(grads, rec, *towers_[tower]);
  store_.wait(rec.version);
}

void TowerGroup::straggle(int tower) const {
  // Stragglers are named by global tower (a remote group's towers of every worker).
  for (const auto& [t, ms] : cfg_.stragglers)
    if (t == cfg_.first_tower + tower) std::this_thread::sleep_for(std::chrono::milliseconds(ms));
}

bool TowerGroup::late(int tower) const {
  const std::vector<int>& l = cfg_.late_towers;
  return std::find(l.begin(), l.end(), cfg_.first_tower + tower) != l.end();
}

void TowerGroup::run(const data::Dataset& train, const data::AugmentConfig& augment,
                     uint64_t seed, int64_t start_version, int64_t end_version,
                     int64_t first_batch, RunHooks hooks) {
  store_.restore_version(start_version);
  store_.reset_clocks(cfg_.towers);
  const std::unique_ptr<ModePolicy> made = make_policy(cfg_);  // fresh bookkeeping every run
  ModePolicy& policy = *made;
  const int n = cfg_.towers;
  // N towers of T threads each may want more threads than the default pool has.
  const int want = n * cfg_.threads_per_tower + 1;
  std::unique_ptr<oneapi::tbb::global_control> more;
  if (want > oneapi::tbb::info::default_concurrency())
    more = std::make_unique<oneapi::tbb::global_control>(
        oneapi::tbb::global_control::max_allowed_parallelism, want);

  // The batches: lockstep, one stream of global batches of N x B (tower i takes slice i of
  // the batch of the version it pulls); free-running, tower i reads its own stream.
  const bool lockstep = policy.lockstep();
  const int64_t per = numel(graph_.input_shape());
  // Over every process of a remote group: tower i here is global tower first + i of all.
  const int first = cfg_.first_tower, all = cfg_.total_towers();
  // --input device: the batches are plans, and each tower makes its pixels on its GPU.
  const bool planned = cfg_.device_input;
  if (planned)
    for (auto& t : towers_) t->hold_train_data(train, augment);
  std::vector<std::unique_ptr<data::BatchPipeline>> pipes;
  if (lockstep)
    pipes.push_back(std::make_unique<data::BatchPipeline>(train, augment, batch_ * all, seed,
                                                          store_.version(), 2, 1, planned));
  else
    for (int i = 0; i < n; ++i)
      pipes.push_back(std::make_unique<data::BatchPipeline>(
          train, augment, batch_, seed, first_batch + first + i, 2, all, planned));
  data::Batch global;               // lockstep: the batch of version global_version
  int64_t global_version = -1;
  const int64_t pipe_first = store_.version();  // the version of the pipeline's first batch
  const float grad_scale = 1.0f / static_cast<float>(lockstep ? batch_ * all : batch_);

  std::mutex mu;           // records, statistics, parked towers, the policy's bookkeeping
  std::shared_mutex gate;  // steps hold it shared; side work holds it exclusively
  std::atomic<bool> stop{false};
  std::vector<bool> parked(n, false);
  // --sync-bn: side work is due and not yet done. A tower must not start the next version's
  // step meanwhile: it would wait in the exchange for the tower doing the side work, which
  // waits for that step to leave the gate. Towers park instead, and are woken after it.
  bool side_due = false;
  ModeContext ctx{cfg_, store_, towers_, stats_, grad_sum_, nccl_.get(), batch_, end_version, mu,
                  hooks.lr_at,
                  [&](const float* g, int tower, UpdateRecord& rec) { guarded_push(g, tower, rec); },
                  [&](const UpdateRecord& r) {  // under mu
                    stats_.update(r.staleness);
                    const bool due = hooks.on_update(r);
                    if (due && exchange_) side_due = true;
                    return due;
                  }};
  policy.begin(ctx);

  oneapi::tbb::task_arena arena(n);
  oneapi::tbb::task_group tasks;
  std::function<void(int)> step;
  // Enqueued, not spawned: the arena's queue is first in, first out, so a tower that
  // re-launches its next step goes behind the others and every tower keeps its turn even
  // when there are fewer threads than towers.
  auto launch = [&](int i) { arena.enqueue(tasks.defer([&step, i] { step(i); })); };

  // A tower that leaves the run releases the towers waiting for it in the exchange.
  auto leave = [&] {
    stop.store(true);
    if (exchange_) exchange_->abandon();
  };
  // The run is being stopped (by a tower that left, a signal or the target accuracy).
  auto stopping = [&] { return stop.load() || hooks.stop_requested(); };
  if (exchange_) exchange_->reset();
  step = [&](int i) {
    Submitted out;
    try {
      bool ended = false;
      {
        std::lock_guard<std::mutex> l(mu);
        // The end is read under this lock: where the policy makes its updates under it
        // (backup towers), a tower that reached it while another made the last update would
        // otherwise start a step whose gradient no update can take (counted as dropped). The
        // other modes' gates stop such a step themselves.
        ended = stopping() || store_.version() >= end_version;
        if (!ended && (side_due || !policy.may_start(i, ctx))) {
          parked[i] = true;
          return;
        }
        // Each version's batch once, in order. The version may move on by more than one
        // between two fetches (a remote group whose late gradients were dropped): the batches
        // in between are skipped, so that batch v is always the one of version v.
        while (!ended && lockstep && global_version < store_.version()) {
          global = pipes[0]->next();
          global_version = global_version < 0 ? pipe_first : global_version + 1;
        }
      }
      if (ended) {
        leave();
        return;
      }
      const float* images = nullptr;
      const kernels::ExamplePlan* plans = nullptr;
      const int32_t* labels = nullptr;
      data::Batch own;
      kernels::StepNoise noise;  // what dropout draws from: see Tower::set_noise
      if (lockstep) {
        const int64_t at = (first + i) * batch_;
        if (planned)
          plans = global.plans.data() + at;
        else
          images = global.images.data() + at * per;
        labels = global.labels.data() + at;
        noise = {step_key(seed, global.step), at};
      } else {
        own = pipes[i]->next();
        images = own.images.data();
        plans = own.plans.data();
        labels = own.labels.data();
        noise = {step_key(seed, own.step), 0};
      }
      std::shared_lock<std::shared_mutex> g(gate);
      Tower& t = *towers_[i];
      const auto t0 = Clock::now();
      TowerStep s;
      s.tower = i;
      s.version_read = store_.pull(t);
      t.set_noise(noise);
      s.stats = planned ? t.compute_gradients_planned(plans, labels, batch_, grad_scale)
                        : t.compute_gradients(images, labels, batch_, grad_scale);
      straggle(i);
      if (late(i)) {
        // Always late: hold the gradient until the others can go no further without it.
        // Backup towers: until the version it was computed on has been applied without it.
        // SSP: until every tower that is not late waits at the bound for it (with a large
        // bound that is many steps of theirs for each of its own). Outside the
        // gate, which side work (made due by an update meanwhile) takes exclusively, and
        // which the towers that apply need.
        g.unlock();
        const bool ssp = cfg_.mode == Mode::Ssp;
        auto others_wait = [&] {
          std::lock_guard<std::mutex> l(mu);
          for (int j = 0; j < n; ++j)
            if (!late(j) && !parked[j]) return false;
          return true;
        };
        while (!stopping() && store_.version() < end_version &&
               (ssp ? !others_wait() : store_.version() <= s.version_read))
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        g.lock();
        if (stopping()) {
          leave();  // the run is ending: the gradient is not given, in time or late
          return;
        }
      }
      s.seconds = seconds_since(t0);
      out = policy.submit(s, ctx);
    } catch (const ExchangeAbandoned&) {
      leave();  // another tower left the run mid-step: this step has no update to join
      return;
    } catch (...) {
      leave();
      throw;
    }
    if (out.stop) {
      leave();
      return;
    }
    if (out.side_work && !stop.load()) {
      // With the gate held exclusively no update is in flight (every apply and version
      // increment happens under the shared gate), so the version read here is exactly the
      // state of the parameters and optimizer: label the evaluation or checkpoint with it,
      // not with the version this step produced, which other towers may have passed since.
      std::unique_lock<std::shared_mutex> g(gate);
      try {
        hooks.side_work(store_.version());
      } catch (...) {
        leave();
        throw;
      }
    }
    std::vector<int> wake;
    {
      std::lock_guard<std::mutex> l(mu);
      if (out.side_work) side_due = false;
      if (out.recheck_parked)
        for (int j = 0; j < n; ++j)
          if (parked[j] && policy.may_start(j, ctx)) parked[j] = false, wake.push_back(j);
    }
    for (int j : wake) launch(j);
    launch(i);
  };

  for (int i = 0; i < n; ++i) launch(i);
  arena.execute([&] { tasks.wait(); });
}

}  // namespace towers
