// engine_bench — the tower engine's own costs, each validated before it is timed:
//   BM_GroupSteps      16 updates of a TowerGroup (mlp, batch 64 per tower) in each mode at
//                      1, 2 and 4 towers of one thread: engine overhead, not arithmetic
//   BM_GradientAverage the tree sum of N gradient buffers of the cifar10 net (1.07 M floats)
//   BM_OptimizerApply  one update of the cifar10 net's parameters, exclusive and shared
//   BM_Memcpy          the same number of bytes copied: the memory-bandwidth yardstick
// Bytes/s counters count bytes read + written: the average reads N buffers and writes one;
// momentum reads w, a, g and writes w, a (20 bytes per parameter); sgd 12 bytes.
#include <cstring>
#include <vector>

#include <benchmark/benchmark.h>

#include "core/device.h"
#include "core/parallel.h"
#include "core/rng.h"
#include "data/augment.h"
#include "data/synthetic.h"
#include "kernels/reduce.h"
#include "models/models.h"
#include "optim/optimizer.h"
#include "towers/tower_group.h"

namespace {

using namespace towers;

void BM_GroupSteps(benchmark::State& state, Mode mode) {
  const int n = static_cast<int>(state.range(0));
  const int64_t batch = 64, updates = 16;
  auto g = build_model("mlp");
  data::DataSplit d = data::make_synthetic(1, 28, 28, 10, 4096, 64, 1);
  data::AugmentConfig aug = data::tutorial_eval_config(28);
  std::vector<float> params(g->layout().total());
  g->layout().initialize(params.data(), 1);
  Optimizer opt(g->layout(), {"sgd"});
  EngineConfig ec;
  ec.mode = mode, ec.towers = n, ec.threads_per_tower = 1, ec.staleness = 1;
  LocalParameterStore store(params.data(), opt, store_access(ec), store_locking(ec), false);
  TowerGroup group(*g, ec, batch, store);
  int64_t applied = 0;
  double loss = 0;
  RunHooks hooks;
  hooks.lr_at = [](int64_t) { return 0.01f; };
  hooks.on_update = [&](const UpdateRecord& r) { ++applied, loss = r.loss; return false; };
  hooks.side_work = [](int64_t) {};
  hooks.stop_requested = [] { return false; };
  int64_t v = 0;
  group.run(d.train, aug, 1, v, v + updates, 0, hooks);  // validate: every update recorded
  v += updates;
  if (applied != updates || !(loss > 0 && loss < 10)) {
    state.SkipWithError("group run failed validation");
    return;
  }
  for (auto _ : state) {
    group.run(d.train, aug, 1, v, v + updates, v * (mode == Mode::Sync ? n : 1), hooks);
    v += updates;
  }
  const int64_t per_update = mode == Mode::Sync ? batch * n : batch;
  state.counters["updates_per_sec"] =
      benchmark::Counter(static_cast<double>(updates), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["images_per_sec"] = benchmark::Counter(
      static_cast<double>(updates * per_update), benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK_CAPTURE(BM_GroupSteps, sync, Mode::Sync)->ArgName("towers")->Arg(1)->Arg(2)->Arg(4)->UseRealTime()->MinTime(1.0);
BENCHMARK_CAPTURE(BM_GroupSteps, async, Mode::Async)->ArgName("towers")->Arg(1)->Arg(2)->Arg(4)->UseRealTime()->MinTime(1.0);
BENCHMARK_CAPTURE(BM_GroupSteps, ssp, Mode::Ssp)->ArgName("towers")->Arg(1)->Arg(2)->Arg(4)->UseRealTime()->MinTime(1.0);

int64_t cifar10_params() { return build_model("cifar10")->layout().total(); }

void BM_GradientAverage(benchmark::State& state) {
  const int n = static_cast<int>(state.range(0));
  const int64_t p = cifar10_params();
  std::vector<std::vector<float>> bufs(n, std::vector<float>(p));
  std::vector<float*> blocks(n);
  CpuDevice host(hardware_threads());
  auto fill = [&] {
    for (int i = 0; i < n; ++i) {
      std::fill(bufs[i].begin(), bufs[i].end(), static_cast<float>(i + 1));  // integers: exact
      blocks[i] = bufs[i].data();
    }
  };
  auto reduce = [&] {
    host.execute([&] {
      for_chunks(p, 1 << 15, [&](int64_t, int64_t b, int64_t e) { kernels::cpu::tree_sum(blocks.data(), n, b, e); });
    });
  };
  fill();
  reduce();
  if (bufs[0][0] != n * (n + 1) / 2.0f || bufs[0][p - 1] != n * (n + 1) / 2.0f) {
    state.SkipWithError("tree sum wrong");
    return;
  }
  for (auto _ : state) reduce();  // sums of sums: values grow but stay finite for the run
  state.counters["bytes_per_sec"] = benchmark::Counter(4.0 * p * (n + 1), benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_GradientAverage)->ArgName("towers")->Arg(2)->Arg(4)->UseRealTime()->MinTime(0.5);

void BM_OptimizerApply(benchmark::State& state, const char* name, bool shared) {
  auto g = build_model("cifar10");
  const int64_t p = g->layout().total();
  std::vector<float> w(p, 1.0f), grad(p, 0.5f);
  Optimizer opt(g->layout(), {name});
  CpuDevice host(hardware_threads());
  host.execute([&] { shared ? opt.apply_shared(w.data(), grad.data(), 0.25f, false) : opt.apply(w.data(), grad.data(), 0.25f); });
  // sgd/momentum first step, no decay on conv1: w = 1 - 0.25 * 0.5
  const int64_t o = g->layout().find("conv1/weight").offset;
  if (w[o] != 0.875f) {
    state.SkipWithError("optimizer result wrong");
    return;
  }
  for (auto _ : state)
    host.execute([&] { shared ? opt.apply_shared(w.data(), grad.data(), 1e-6f, false) : opt.apply(w.data(), grad.data(), 1e-6f); });
  const double bytes = std::string(name) == "sgd" ? 12.0 : 20.0;
  state.counters["bytes_per_sec"] = benchmark::Counter(bytes * p, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK_CAPTURE(BM_OptimizerApply, sgd, "sgd", false)->UseRealTime();
BENCHMARK_CAPTURE(BM_OptimizerApply, momentum, "momentum", false)->UseRealTime();
BENCHMARK_CAPTURE(BM_OptimizerApply, momentum_shared, "momentum", true)->UseRealTime();

void BM_Memcpy(benchmark::State& state) {
  const int64_t p = cifar10_params();
  std::vector<float> a(p, 1.0f), b(p);
  std::memcpy(b.data(), a.data(), 4 * p);
  if (b[p - 1] != 1.0f) {
    state.SkipWithError("memcpy wrong");
    return;
  }
  for (auto _ : state) {
    std::memcpy(b.data(), a.data(), 4 * p);
    benchmark::ClobberMemory();
  }
  state.counters["bytes_per_sec"] = benchmark::Counter(8.0 * p, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_Memcpy)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
