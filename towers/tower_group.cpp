#include "towers/tower_group.h"

#include <algorithm>
#include <chrono>
#include <thread>

#include <oneapi/tbb/global_control.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/task_arena.h>
#include <oneapi/tbb/task_group.h>

#include "core/check.h"
#include "core/parallel.h"
#include "core/gpu.h"
#include "kernels/reduce.h"
#include "towers/nccl_reduce.h"

namespace towers {

namespace {
using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}
}  // namespace

Mode parse_mode(const std::string& s) {
  if (s == "sync") return Mode::Sync;
  if (s == "async") return Mode::Async;
  if (s == "ssp") return Mode::Ssp;
  TOWERS_BAD_INPUT("--mode: unknown mode '{}' (known: sync, async, ssp)", s);
}

std::string to_string(Mode m) {
  return m == Mode::Sync ? "sync" : m == Mode::Async ? "async" : "ssp";
}

Reduce parse_reduce(const std::string& s) {
  if (s == "host") return Reduce::Host;
  if (s == "nccl") return Reduce::Nccl;
  TOWERS_BAD_INPUT("--reduce: unknown reduction '{}' (known: host, nccl)", s);
}

std::string to_string(Reduce r) { return r == Reduce::Host ? "host" : "nccl"; }

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
               "the parameter store's update access does not suit mode {}", to_string(cfg_.mode));
  if (cfg_.replicas_to_aggregate == 0) cfg_.replicas_to_aggregate = cfg_.towers;
  const bool cuda = cfg_.device == DeviceKind::Cuda;
  TOWERS_CHECK(!cuda || cfg_.gpus >= 1, "a CUDA tower group needs at least one GPU");
  for (int i = 0; i < cfg_.towers; ++i) {
    TowerPlacement p;
    p.kind = cfg_.device;
    p.threads = cfg_.threads_per_tower;
    p.gpu = cuda ? i % cfg_.gpus : 0;
    p.tf32 = cfg_.tf32;
    p.cuda_graphs = cfg_.cuda_graphs;
    towers_.push_back(make(graph, batch, p));
  }
  const int64_t total = graph.layout().total();
  if (cfg_.towers > 1) grad_sum_.resize(total);
  if (cuda && cfg_.towers > 1)
    pinned_sum_ = pin_host_memory(grad_sum_.data(), sizeof(float) * total);
  if (cfg_.reduce == Reduce::Nccl) {
    TOWERS_REQUIRE(cuda, "--reduce nccl needs --device cuda");
    TOWERS_REQUIRE(cfg_.mode == Mode::Sync && cfg_.replicas_to_aggregate == cfg_.towers,
                   "--reduce nccl is for sync mode without backup towers (it averages every "
                   "tower's gradient at once)");
    if (cfg_.towers > 1) {
      std::vector<Tower*> ts;
      for (auto& t : towers_) ts.push_back(t.get());
      nccl_ = std::make_unique<NcclReducer>(ts);
    }
  }
}

TowerGroup::~TowerGroup() = default;

int64_t TowerGroup::examples_per_update() const {
  if (cfg_.mode == Mode::Sync) return batch_ * cfg_.replicas_to_aggregate;
  return batch_;
}

void TowerGroup::straggle(int tower) const {
  for (const auto& [t, ms] : cfg_.stragglers)
    if (t == tower) std::this_thread::sleep_for(std::chrono::milliseconds(ms));
}

void TowerGroup::run(const data::Dataset& train, const data::AugmentConfig& augment,
                     uint64_t seed, int64_t start_version, int64_t end_version,
                     int64_t first_batch, RunHooks hooks) {
  store_.restore_version(start_version);
  // N towers of T threads each may want more threads than the default pool has.
  const int want = cfg_.towers * cfg_.threads_per_tower + 1;
  std::unique_ptr<oneapi::tbb::global_control> more;
  if (want > oneapi::tbb::info::default_concurrency())
    more = std::make_unique<oneapi::tbb::global_control>(
        oneapi::tbb::global_control::max_allowed_parallelism, want);
  const bool plain_sync =
      cfg_.mode == Mode::Sync && cfg_.replicas_to_aggregate == cfg_.towers;
  if (plain_sync)
    run_sync(train, augment, seed, end_version, hooks);
  else
    run_tasks(train, augment, seed, end_version, first_batch, hooks);
}

// ---- sync: one global batch, N slices, an ordered average, one apply ----------------------
void TowerGroup::run_sync(const data::Dataset& train, const data::AugmentConfig& augment,
                          uint64_t seed, int64_t end_version, RunHooks& hooks) {
  const int n = cfg_.towers;
  const int64_t global = batch_ * n;
  const int64_t per = numel(graph_.input_shape());
  const int64_t total = graph_.layout().total();
  data::BatchPipeline pipe(train, augment, global, seed, store_.version(), 2);
  oneapi::tbb::task_arena outer(n);
  std::vector<StepStats> st(n);
  std::vector<double> secs(n);
  while (store_.version() < end_version && !hooks.stop_requested()) {
    data::Batch b = pipe.next();
    const float lr = hooks.lr_at(store_.version());
    auto work = [&](int i) {
      const auto t0 = Clock::now();
      Tower& t = *towers_[i];
      store_.pull(t);
      st[i] = t.compute_gradients(b.images.data() + i * batch_ * per, b.labels.data() + i * batch_,
                                  batch_, 1.0f / static_cast<float>(global));
      straggle(i);
      secs[i] = seconds_since(t0);
    };
    const float* grads = towers_[0]->grads();
    if (n == 1) {
      work(0);
    } else if (nccl_) {
      outer.execute([&] {
        oneapi::tbb::parallel_for(0, n, work, oneapi::tbb::simple_partitioner());
      });
      nccl_->sum_to_host(grad_sum_.data());
      grads = grad_sum_.data();
    } else {
      outer.execute([&] {
        oneapi::tbb::parallel_for(0, n, work, oneapi::tbb::simple_partitioner());
        // The average: a tree sum over the towers in tower order (kernels/reduce.h), into
        // tower 0's buffer. Each tower's gradient is already scaled by 1/global, so the sum
        // is the mean over the global batch, and it is bitwise the same whichever thread
        // did what.
        std::vector<float*> blocks(n);
        for (int i = 0; i < n; ++i) blocks[i] = towers_[i]->mutable_grads();
        for_chunks(total, 1 << 15, [&](int64_t, int64_t b0, int64_t b1) {
          kernels::cpu::tree_sum(blocks.data(), n, b0, b1);
        });
      });
    }
    const int64_t v = store_.push(grads, lr, towers_[0]->host());
    store_.wait(v);
    UpdateRecord rec;
    rec.version = v;
    rec.tower = n == 1 ? 0 : -1;
    rec.contributors = n;
    rec.lr = lr;
    rec.examples = global;
    for (int i = 0; i < n; ++i) {
      rec.loss += st[i].loss_sum;
      rec.correct += st[i].correct;
      stats_.tower_step(i, secs[i], batch_);
      stats_.contributed(i);
    }
    rec.loss /= static_cast<double>(global);
    stats_.update(0);
    if (hooks.on_update(rec)) hooks.side_work(v);
  }
}

// ---- async, ssp, backup towers: a task per tower step ---------------------------------------
void TowerGroup::run_tasks(const data::Dataset& train, const data::AugmentConfig& augment,
                           uint64_t seed, int64_t end_version, int64_t first_batch,
                           RunHooks& hooks) {
  const int n = cfg_.towers;
  const bool backup = cfg_.mode == Mode::Sync;  // with K < N
  const bool ssp = cfg_.mode == Mode::Ssp;
  const int k_needed = cfg_.replicas_to_aggregate;
  const int64_t total = graph_.layout().total();

  std::vector<std::unique_ptr<data::BatchPipeline>> pipes;
  for (int i = 0; i < n; ++i)
    pipes.push_back(std::make_unique<data::BatchPipeline>(train, augment, batch_, seed,
                                                          first_batch + i, 2, n));

  std::mutex mu;                  // records, SSP clocks, parked towers, the backup accumulator
  std::shared_mutex gate;         // steps hold it shared; side work holds it exclusively
  std::atomic<bool> stop{false};
  std::atomic<int64_t> tickets{store_.version()};  // async: updates claimed, so none overshoot
  std::vector<int64_t> clock(n, 0), submitted(n, -1);
  std::vector<bool> parked(n, false);
  int acc_count = 0;
  UpdateRecord acc_rec;
  oneapi::tbb::task_arena arena(n);
  oneapi::tbb::task_group tasks;
  std::function<void(int)> step;
  // Enqueued, not spawned: the arena's queue is first in, first out, so a tower that
  // re-launches its next step goes behind the others and every tower keeps its turn even
  // when there are fewer threads than towers.
  auto launch = [&](int i) { arena.enqueue(tasks.defer([&step, i] { step(i); })); };
  auto min_clock = [&] { return *std::min_element(clock.begin(), clock.end()); };

  step = [&](int i) {
    if (stop.load() || store_.version() >= end_version || hooks.stop_requested()) {
      stop.store(true);
      return;
    }
    {
      std::lock_guard<std::mutex> l(mu);
      // SSP: a tower that has done more than `staleness` steps beyond the slowest waits.
      if (ssp && clock[i] - min_clock() > cfg_.staleness) {
        parked[i] = true;
        return;
      }
      // Backup towers: after submitting for version v, wait until v has been applied.
      if (backup && submitted[i] == store_.version()) {
        parked[i] = true;
        return;
      }
    }
    std::vector<int> wake;
    bool side = false;
    int64_t produced = 0;  // the version this step's update produced (records only)
    try {
      data::Batch b = pipes[i]->next();
      std::shared_lock<std::shared_mutex> g(gate);
      Tower& t = *towers_[i];
      const auto t0 = Clock::now();
      const int64_t v_read = store_.pull(t);
      StepStats s = t.compute_gradients(b.images.data(), b.labels.data(), batch_,
                                        1.0f / static_cast<float>(batch_));
      straggle(i);
      const double secs = seconds_since(t0);
      if (backup) {
        std::lock_guard<std::mutex> l(mu);
        stats_.tower_step(i, secs, batch_);
        if (v_read != store_.version() || store_.version() >= end_version) {
          stats_.dropped(i);  // late: its version has been applied without it
        } else {
          submitted[i] = v_read;
          float* sum = grad_sum_.data();
          const float* gr = t.grads();
          t.host().execute([&] {
            for_chunks(total, 1 << 15, [&](int64_t, int64_t b0, int64_t b1) {
              for (int64_t j = b0; j < b1; ++j) sum[j] = acc_count == 0 ? gr[j] : sum[j] + gr[j];
            });
          });
          if (acc_count == 0) acc_rec = UpdateRecord{};
          ++acc_count;
          stats_.contributed(i);
          acc_rec.loss += s.loss_sum, acc_rec.correct += s.correct, acc_rec.examples += batch_;
          if (acc_count == k_needed) {
            const float lr = hooks.lr_at(v_read);
            const float scale = 1.0f / static_cast<float>(k_needed);
            t.host().execute([&] {
              for_chunks(total, 1 << 15, [&](int64_t, int64_t b0, int64_t b1) {
                for (int64_t j = b0; j < b1; ++j) sum[j] *= scale;
              });
            });
            produced = store_.push(sum, lr, t.host());
            store_.wait(produced);
            acc_rec.version = produced;
            acc_rec.tower = -1;
            acc_rec.contributors = k_needed;
            acc_rec.lr = lr;
            acc_rec.loss /= static_cast<double>(acc_rec.examples);
            stats_.update(0);
            side = hooks.on_update(acc_rec);
            acc_count = 0;
            for (int j = 0; j < n; ++j)
              if (parked[j]) parked[j] = false, wake.push_back(j);
          }
        }
      } else {
        const int64_t ticket = tickets.fetch_add(1);
        if (ticket >= end_version) {
          stop.store(true);
          return;
        }
        float lr = hooks.lr_at(ticket);
        const int64_t staleness = store_.version() - v_read;
        if (cfg_.staleness_aware_lr) lr /= static_cast<float>(std::max<int64_t>(1, staleness));
        produced = store_.push(t.grads(), lr, t.host());
        store_.wait(produced);
        std::lock_guard<std::mutex> l(mu);
        stats_.tower_step(i, secs, batch_);
        stats_.update(staleness);
        stats_.contributed(i);
        ++clock[i];
        UpdateRecord rec;
        rec.version = produced;
        rec.tower = i;
        rec.staleness = staleness;
        rec.loss = s.loss_sum / static_cast<double>(batch_);
        rec.correct = s.correct;
        rec.examples = batch_;
        rec.lr = lr;
        side = hooks.on_update(rec);
        if (ssp) {
          const int64_t lo = min_clock();
          for (int j = 0; j < n; ++j)
            if (parked[j] && clock[j] - lo <= cfg_.staleness) parked[j] = false, wake.push_back(j);
        }
      }
    } catch (...) {
      stop.store(true);
      throw;
    }
    if (side) {
      // With the gate held exclusively no update is in flight (every apply and version
      // increment happens under the shared gate), so the version read here is exactly the
      // state of the parameters and optimizer: label the evaluation or checkpoint with it,
      // not with `produced`, which other towers may have passed in the meantime.
      std::unique_lock<std::shared_mutex> g(gate);
      hooks.side_work(store_.version());
    }
    for (int j : wake) launch(j);
    launch(i);
  };

  for (int i = 0; i < n; ++i) launch(i);
  arena.execute([&] { tasks.wait(); });
}

}  // namespace towers
