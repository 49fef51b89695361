// gpu_bench — the GPU side of towers, as Google Benchmark counters (DESIGN.md, bench/):
//   BM_GpuTowerStep      a cifar10 tower step at batch 128 on one GPU, images/s: parameters
//                        H2D, forward, backward, gradients D2H (overlapped), the momentum
//                        apply on the host parameters; CUDA graph replay vs plain launches,
//                        FP32 vs TF32.
//   BM_GpuModelStep      the same step for the airbench and resnet-small-cifar nets, batch 512
//                        (BM_GpuMirroredModelStep: with --params mirrored).
//   BM_GpuMirroredStep   the same step with --params mirrored (parameters, momentum and the
//                        update on the GPU, inside the step's graph), batch 128 and 512; with
//                        input 1 and 2, each step's batch comes from the training pipeline
//                        (the tutorial's transform of 32x32 images, cropped to 24): augmented
//                        by the host and copied in (--input host), or drawn by the host and
//                        made on the GPU (--input device); with branches 1, each layer's
//                        weight gradients run on a second stream beside its input gradient
//                        (--backward-branches: parallel branches of the graph); cudnn 0 is
//                        im2col + cuBLAS, 1 cuDNN with deterministic algorithms (the default),
//                        2 cuDNN with any (--cudnn-nondeterministic, PyTorch's default), 3 and
//                        4 as 1 and 2 with the algorithms chosen by timing them
//                        (--cudnn-benchmark, torch.backends.cudnn.benchmark), 5 and 6 as 1
//                        and 3 kept to cuDNN's GEMM family (--cudnn-gemm-only: no FFT or
//                        Winograd).
//   BM_GpuComputeOnly    forward+backward alone (no host apply), graph vs plain launches: the
//                        launch overhead a graph removes.
//   BM_HostMomentumApply the momentum apply on the host parameters alone (the host's share).
//   BM_ParamBroadcast    host->device parameter copy of a tower (GB/s) next to a plain pinned
//                        cudaMemcpy of the same bytes: the PCIe limit.
//   BM_GradAverageHost / BM_GradAverageNccl   averaging N towers' gradients: landing buffers
//                        tree-summed on the host, or an NCCL all-reduce and one copy out.
//   BM_DenseGemm         each GEMM of the cifar10 net's dense layers at batch 128, alone, 20
//                        calls in a CUDA graph: as the tower calls cuBLAS (cublasSgemm: algo
//                        -1), the transposed product with the operands swapped and then
//                        transposed (algo -2), and the product through cuBLASLt with each of
//                        its heuristic's first 8 candidates (algo 0..7; the label names the
//                        candidate's kernel configuration). The 2026-11-27 profile found the
//                        softmax layer's weight gradient (10 x 192, k = 128) taking 57 us, five
//                        times local3's (2304 x 384): these rows measure the alternatives.
//                        Not in run-gpu.sh's bench phase (its profile phase runs them).
// Every benchmark validates its result before timing and skips (with the reason) without a
// GPU. Napkin math: a cifar10 step is 106 MFLOP per image, 13.6 GFLOP per batch of 128; at an
// H100's FP32 rate (67 TFLOP/s SXM) that is 0.2 ms per batch, 630 K images/s.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>
#include <cuda_runtime.h>
#include <fmt/format.h>
#if defined(TOWERS_BENCH_CUBLASLT)
#include <cublasLt.h>
#include <cublas_v2.h>

#include "core/cuda_device.h"  // CUBLAS_CHECK
#endif

#include "core/check.h"
#include "core/cuda_check.h"
#include "core/gpu.h"
#include "core/parallel.h"
#include "core/rng.h"
#include "data/augment.h"
#include "data/pipeline.h"
#include "data/synthetic.h"
#include "kernels/gemm.h"
#include "kernels/reduce.h"
#include "models/model_file.h"
#include "models/models.h"
#include "optim/optimizer.h"
#include "towers/cuda_tower.h"
#include "towers/mirrored_store.h"
#include "towers/nccl_reduce.h"

// Seconds each timed benchmark runs at least (per repetition): TOWERS_BENCH_MIN_TIME, default
// 2 (the transfer and host-apply figures run half as long). A lease on a GPU machine is short,
// so bench/run-gpu.sh asks for less; a 2 ms step still runs hundreds of times per repetition.
static double bench_min_time(double scale) {
  const char* env = std::getenv("TOWERS_BENCH_MIN_TIME");
  double seconds = env != nullptr ? std::atof(env) : 0.0;
  return (seconds > 0.0 ? seconds : 2.0) * scale;
}

namespace {

using namespace towers;

bool skip_without_gpus(benchmark::State& state, size_t need = 1) {
  const GpuList g = list_gpus();
  if (g.gpus.size() >= need) return false;
  state.SkipWithError(g.gpus.empty() ? ("no GPU: " + g.why_none).c_str()
                                     : ("needs " + std::to_string(need) + " GPUs").c_str());
  return true;
}

// model with its GPU convolutions through cuDNN (the default) or im2col + cuBLAS.
std::unique_ptr<Graph> model_conv(const std::string& model, bool cudnn) {
  ModelSpec spec = read_model(model);
  set_conv_algorithm(spec, cudnn ? ConvAlgorithm::Auto : ConvAlgorithm::Im2col);
  return build_graph(spec);
}

struct Inputs {
  std::vector<float> x;
  std::vector<int32_t> y;
};

Inputs random_inputs(const Graph& g, int64_t batch) {
  Rng rng(2);
  Inputs in;
  in.x.resize(batch * numel(g.input_shape()));
  for (float& v : in.x) v = rng.uniform(-1.5f, 1.5f);  // standardized-image range, never zeros
  in.y.resize(batch);
  for (auto& v : in.y) v = static_cast<int32_t>(rng.below(g.num_classes()));
  return in;
}

TowerPlacement placement(bool graphs, bool tf32, int gpu = 0, int threads = 8) {
  TowerPlacement p;
  p.kind = DeviceKind::Cuda;
  p.gpu = gpu;
  p.cuda_graphs = graphs;
  p.tf32 = tf32;
  p.threads = threads;
  return p;
}

// The cuDNN algorithms a tower's plans chose, on stderr, once per distinct set (the benchmark
// output stays a table; the log keeps what ran).
void log_plans(const CudaTower& tower, const std::string& what) {
  static std::set<std::vector<std::string>> logged;
  const std::vector<std::string>& notes = tower.gpu_plan_notes();
  if (notes.empty() || !logged.insert(notes).second) return;
  std::fprintf(stderr, "cuDNN plans of %s:\n", what.c_str());
  for (const std::string& n : notes) std::fprintf(stderr, "  %s\n", n.c_str());
}

bool valid_step(benchmark::State& state, const StepStats& s, const float* grads, int64_t total,
                int64_t batch) {
  double gsum = 0;
  for (int64_t i = 0; i < total; ++i) gsum += std::fabs(grads[i]);
  if (!std::isfinite(s.loss_sum) || std::fabs(s.loss_sum / batch - std::log(10.0)) > 0.5 ||
      gsum == 0) {
    state.SkipWithError("step failed validation");
    return false;
  }
  return true;
}

// The cuDNN rules of a benchmark's cudnn argument (see the top of the file).
void set_cudnn_rules(TowerPlacement& where, int cudnn) {
  where.cudnn.nondeterministic = cudnn == 2 || cudnn == 4;
  where.cudnn.benchmark = cudnn == 3 || cudnn == 4 || cudnn == 6;
  where.cudnn.gemm_only = cudnn >= 5;
}

// One host-parameter tower step of model at batch, timed: parameters H2D, forward,
// backward, gradients D2H, the momentum apply on the host.
void time_host_param_step(benchmark::State& state, const std::string& model, int64_t batch,
                          bool graphs, bool tf32, int cudnn = 1) {
  if (skip_without_gpus(state)) return;
  auto g = model_conv(model, cudnn != 0);
  const int64_t total = g->layout().total();
  TowerPlacement where = placement(graphs, tf32);
  set_cudnn_rules(where, cudnn);
  CudaTower tower(*g, batch, where);
  std::vector<float> params(total);
  g->layout().initialize(params.data(), 1);
  auto pin = pin_host_memory(params.data(), sizeof(float) * total);
  Optimizer opt(g->layout(), {"momentum"});
  Inputs in = random_inputs(*g, batch);
  auto step = [&] {
    tower.load_params(params.data());
    StepStats s = tower.compute_gradients(in.x.data(), in.y.data(), batch, 1.0f / batch);
    tower.host().execute([&] { opt.apply(params.data(), tower.grads(), 0.01f); });
    return s;
  };
  if (!valid_step(state, step(), tower.grads(), total, batch)) return;
  log_plans(tower, model + ", host parameters");
  for (int i = 0; i < 10; ++i) step();  // warm-up
  for (auto _ : state) benchmark::DoNotOptimize(step());
  state.counters["images_per_sec"] =
      benchmark::Counter(static_cast<double>(batch), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["GFLOP_per_sec"] = benchmark::Counter(
      batch * 3.0 * g->flops_per_example() * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

// Args: graphs (0/1), tf32 (0/1), cudnn (1: cuDNN convolutions with deterministic algorithms,
// 2: with any algorithm, --cudnn-nondeterministic; 3, 4: as 1, 2, timed, --cudnn-benchmark;
// 5, 6: as 1, 3, GEMM family only, --cudnn-gemm-only; 0: im2col + cuBLAS).
void BM_GpuTowerStep(benchmark::State& state) {
  time_host_param_step(state, "cifar10", 128, state.range(0) != 0, state.range(1) != 0,
                       static_cast<int>(state.range(2)));
}
BENCHMARK(BM_GpuTowerStep)->ArgNames({"graph", "tf32", "cudnn"})->Args({1, 0, 1})
    ->Args({1, 0, 0})->Args({0, 0, 1})->Args({1, 1, 1})
    ->UseRealTime()->MinTime(bench_min_time(1.0))->Repetitions(3)->ReportAggregatesOnly(true);

// The step of BM_GpuTowerStep (host parameters, graph replay) for the nets of the fast
// CIFAR-10 recipe, at batch 512: airbench (the airbench94 layout, BatchNorm and GELU) and
// resnet-small-cifar. bench/run-gpu.sh times the same nets in PyTorch
// (torch_cifar10.py --model FILE). Args: tf32 (0/1).
void BM_GpuModelStep(benchmark::State& state, const std::string& model) {
  time_host_param_step(state, model, 512, true, state.range(0) != 0);
}
BENCHMARK_CAPTURE(BM_GpuModelStep, airbench, std::string("airbench"))
    ->ArgName("tf32")->Arg(0)->Arg(1)->UseRealTime()->MinTime(bench_min_time(1.0))->Repetitions(3)
    ->ReportAggregatesOnly(true);
BENCHMARK_CAPTURE(BM_GpuModelStep, resnet_small_cifar, std::string("resnet-small-cifar"))
    ->ArgName("tf32")->Arg(0)->Arg(1)->UseRealTime()->MinTime(bench_min_time(1.0))->Repetitions(3)
    ->ReportAggregatesOnly(true);

// --params mirrored: the same step with the parameters and momentum on the GPU, the update the
// last kernels of the step's graph; nothing crosses PCIe but the batch and the losses.
// Args: batch, tf32 (0/1), cudnn (as BM_GpuTowerStep), input (0: one
// fixed batch of floats; 1: the host pipeline's batches; 2: the device-input pipeline's plans),
// branches (0/1: --backward-branches).
void time_mirrored_step(benchmark::State& state, const std::string& model, int64_t batch,
                        bool tf32, int cudnn, int64_t input, bool branches) {
  if (skip_without_gpus(state)) return;
  auto g = model_conv(model, cudnn != 0);
  const int64_t total = g->layout().total();
  TowerPlacement where = placement(true, tf32);
  where.backward_branches = branches;
  set_cudnn_rules(where, cudnn);
  CudaTower tower(*g, batch, where);
  std::vector<float> params(total), init(total);
  g->layout().initialize(params.data(), 1);
  init = params;
  Optimizer opt(g->layout(), {"momentum"});
  MirroredParameterStore store(params.data(), opt, Reduce::Host, [](int64_t) { return 0.01f; });
  store.attach({&tower});
  Inputs in = random_inputs(*g, batch);
  // Input 1 and 2: a CIFAR-10-sized synthetic training set (32x32, cropped to the net's 24x24).
  data::DataSplit d;
  const data::AugmentConfig aug = data::tutorial_train_config(24);
  std::unique_ptr<data::BatchPipeline> pipe;
  if (input > 0) {
    d = data::make_synthetic(3, 32, 32, 10, 50000, 10, 3);
    pipe = std::make_unique<data::BatchPipeline>(d.train, aug, batch, 1, 0, 2, 1, input == 2);
  }
  if (input == 2) tower.hold_train_data(d.train, aug);
  auto step = [&] {
    store.pull(tower);
    StepStats s;
    if (input == 0) {
      s = tower.compute_gradients(in.x.data(), in.y.data(), batch, 1.0f / batch);
    } else {
      const data::Batch b = pipe->next();
      s = input == 1 ? tower.compute_gradients(b.images.data(), b.labels.data(), batch, 1.0f / batch)
                     : tower.compute_gradients_planned(b.plans.data(), b.labels.data(), batch,
                                                       1.0f / batch);
    }
    UpdateRecord rec;
    rec.lr = 0.01f;
    store.push(nullptr, rec, tower);
    return s;
  };
  const StepStats first = step();
  const float* now = store.host_params();
  if (!std::isfinite(first.loss_sum) ||
      std::fabs(first.loss_sum / batch - std::log(10.0)) > 0.5 ||
      std::memcmp(now, init.data(), sizeof(float) * total) == 0) {
    state.SkipWithError("step failed validation (loss, or no update applied)");
    store.detach();
    return;
  }
  log_plans(tower, model + ", mirrored parameters");
  for (int i = 0; i < 10; ++i) step();  // warm-up, capture
  for (auto _ : state) benchmark::DoNotOptimize(step());
  store.detach();
  state.counters["images_per_sec"] =
      benchmark::Counter(static_cast<double>(batch), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["GFLOP_per_sec"] = benchmark::Counter(
      batch * 3.0 * g->flops_per_example() * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}
void BM_GpuMirroredStep(benchmark::State& state) {
  time_mirrored_step(state, "cifar10", state.range(0), state.range(1) != 0,
                     static_cast<int>(state.range(2)), state.range(3), state.range(4) != 0);
}
BENCHMARK(BM_GpuMirroredStep)->ArgNames({"batch", "tf32", "cudnn", "input", "branches"})
    ->Args({128, 0, 1, 0, 0})->Args({128, 1, 1, 0, 0})->Args({512, 0, 1, 0, 0})
    ->Args({512, 1, 1, 0, 0})->Args({128, 0, 0, 0, 0})->Args({512, 0, 0, 0, 0})
    ->Args({128, 0, 1, 1, 0})->Args({128, 0, 1, 2, 0})->Args({512, 0, 1, 1, 0})
    ->Args({512, 0, 1, 2, 0})
    ->Args({128, 0, 1, 0, 1})->Args({128, 1, 1, 0, 1})->Args({512, 0, 1, 0, 1})
    ->Args({128, 0, 2, 0, 0})->Args({128, 1, 2, 0, 0})->Args({512, 0, 2, 0, 0})
    ->Args({128, 0, 3, 0, 0})->Args({128, 1, 3, 0, 0})->Args({512, 0, 3, 0, 0})
    ->Args({128, 0, 4, 0, 0})->Args({128, 1, 4, 0, 0})
    ->Args({128, 0, 5, 0, 0})->Args({128, 1, 5, 0, 0})->Args({512, 0, 5, 0, 0})
    ->Args({128, 0, 6, 0, 0})
    ->UseRealTime()->MinTime(bench_min_time(1.0))->Repetitions(3)->ReportAggregatesOnly(true);

// BM_GpuModelStep's nets with mirrored parameters (BatchNorm's running statistics updated on
// the GPU with the momentum), batch 512: the step bench/run-gpu.sh puts next to PyTorch's.
// Args: tf32 (0/1), branches (0/1).
void BM_GpuMirroredModelStep(benchmark::State& state, const std::string& model) {
  time_mirrored_step(state, model, 512, state.range(0) != 0, true, 0, state.range(1) != 0);
}
BENCHMARK_CAPTURE(BM_GpuMirroredModelStep, airbench, std::string("airbench"))
    ->ArgNames({"tf32", "branches"})->Args({0, 0})->Args({1, 0})->Args({0, 1})->Args({1, 1})
    ->UseRealTime()->MinTime(bench_min_time(1.0))->Repetitions(3)->ReportAggregatesOnly(true);
BENCHMARK_CAPTURE(BM_GpuMirroredModelStep, resnet_small_cifar, std::string("resnet-small-cifar"))
    ->ArgNames({"tf32", "branches"})->Args({0, 0})->Args({1, 0})->Args({0, 1})
    ->UseRealTime()->MinTime(bench_min_time(1.0))->Repetitions(3)->ReportAggregatesOnly(true);

// Forward + backward on the device only: the same step without the host's share.
// Args: graphs (0/1), cudnn (0/1).
void BM_GpuComputeOnly(benchmark::State& state) {
  if (skip_without_gpus(state)) return;
  const int64_t batch = 128;
  auto g = model_conv("cifar10", state.range(1) != 0);
  const int64_t total = g->layout().total();
  CudaTower tower(*g, batch, placement(state.range(0) != 0, false));
  tower.set_grads_to_host(false);
  std::vector<float> params(total);
  g->layout().initialize(params.data(), 1);
  tower.load_params(params.data());
  Inputs in = random_inputs(*g, batch);
  StepStats s = tower.compute_gradients(in.x.data(), in.y.data(), batch, 1.0f / batch);
  if (!std::isfinite(s.loss_sum)) {
    state.SkipWithError("loss is not finite");
    return;
  }
  for (int i = 0; i < 10; ++i) tower.compute_gradients(in.x.data(), in.y.data(), batch, 1.0f / batch);
  for (auto _ : state)
    benchmark::DoNotOptimize(tower.compute_gradients(in.x.data(), in.y.data(), batch, 1.0f / batch));
  state.counters["images_per_sec"] =
      benchmark::Counter(static_cast<double>(batch), benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_GpuComputeOnly)->ArgNames({"graph", "cudnn"})->Args({1, 1})->Args({1, 0})
    ->Args({0, 1})->UseRealTime()->MinTime(bench_min_time(1.0))
    ->Repetitions(3)->ReportAggregatesOnly(true);

// The host's share of BM_GpuTowerStep that is not a copy: the momentum apply to the 1.07 M
// pinned host parameters on the tower's host threads (8, as in BM_GpuTowerStep).
void BM_HostMomentumApply(benchmark::State& state) {
  if (skip_without_gpus(state)) return;
  auto g = build_model("cifar10");
  const int64_t total = g->layout().total();
  CpuDevice host(placement(true, false).threads);  // what a CudaTower's host() is
  std::vector<float> params(total), grads(total);
  g->layout().initialize(params.data(), 1);
  Rng rng(4);
  for (float& v : grads) v = rng.uniform(-1e-3f, 1e-3f);
  auto pin = pin_host_memory(params.data(), sizeof(float) * total);
  Optimizer opt(g->layout(), {"momentum"});
  for (auto _ : state) host.execute([&] { opt.apply(params.data(), grads.data(), 0.01f); });
  state.counters["params_per_sec"] = benchmark::Counter(
      static_cast<double>(total), benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_HostMomentumApply)->UseRealTime()->MinTime(bench_min_time(0.5));

// Arg: 0 = a tower's load_params (pinned host parameters, the copy stream), 1 = a plain
// cudaMemcpy from pinned memory: the same 4.3 MB.
void BM_ParamBroadcast(benchmark::State& state) {
  if (skip_without_gpus(state)) return;
  auto g = build_model("cifar10");
  const int64_t total = g->layout().total();
  const size_t bytes = sizeof(float) * total;
  std::vector<float> params(total);
  g->layout().initialize(params.data(), 1);
  auto pin = pin_host_memory(params.data(), bytes);
  if (state.range(0) == 0) {
    CudaTower tower(*g, 1, placement(true, false));
    tower.load_params(params.data());
    tower.device().synchronize();
    std::vector<float> back(total);
    CUDA_CHECK(cudaMemcpy(back.data(), tower.device_params(), bytes, cudaMemcpyDeviceToHost));
    if (std::memcmp(back.data(), params.data(), bytes) != 0) {
      state.SkipWithError("broadcast copied wrong bytes");
      return;
    }
    for (auto _ : state) {
      tower.load_params(params.data());
      tower.device().synchronize();
    }
  } else {
    float* d = nullptr;
    CUDA_CHECK(cudaMalloc(&d, bytes));
    for (auto _ : state) CUDA_CHECK(cudaMemcpy(d, params.data(), bytes, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaFree(d));
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(bytes));
}
BENCHMARK(BM_ParamBroadcast)->ArgName("plain_memcpy")->Arg(0)->Arg(1)->UseRealTime()->MinTime(bench_min_time(0.5));

// N towers (tower i on GPU i % GPUs), gradients computed once; timed: the average.
struct GradSetup {
  std::unique_ptr<Graph> g;
  std::vector<std::unique_ptr<CudaTower>> towers;
  Inputs in;
  GradSetup(int n, int gpus) : g(build_model("cifar10")), in(random_inputs(*g, 64)) {
    std::vector<float> params(g->layout().total());
    g->layout().initialize(params.data(), 1);
    for (int i = 0; i < n; ++i) {
      towers.push_back(std::make_unique<CudaTower>(*g, 64, placement(true, false, i % gpus)));
      towers.back()->load_params(params.data());
    }
  }
  void compute() {
    for (auto& t : towers) t->compute_gradients(in.x.data(), in.y.data(), 64, 1.0f / 64);
  }
  // Every tower has the same batch and parameters, so the sum is N x tower 0's gradient.
  bool sum_is_right(const float* sum, const std::vector<float>& one) const {
    const double n = static_cast<double>(towers.size());
    for (size_t i = 0; i < one.size(); ++i)
      if (std::fabs(sum[i] - n * one[i]) > 1e-5 * (std::fabs(n * one[i]) + 1e-6)) return false;
    return true;
  }
};

void BM_GradAverageHost(benchmark::State& state) {
  if (skip_without_gpus(state)) return;
  const int n = static_cast<int>(state.range(0));
  GradSetup s(n, static_cast<int>(list_gpus().gpus.size()));
  const int64_t total = s.g->layout().total();
  CpuDevice host(8);
  s.compute();  // the landing buffers are filled by the step itself
  const std::vector<float> one(s.towers[0]->grads(), s.towers[0]->grads() + total);
  std::vector<float*> blocks;
  for (auto& t : s.towers) blocks.push_back(t->mutable_grads());
  auto average = [&] {
    host.execute([&] {
      for_chunks(total, 1 << 15, [&](int64_t, int64_t b, int64_t e) {
        kernels::cpu::tree_sum(blocks.data(), n, b, e);
      });
    });
  };
  average();
  if (!s.sum_is_right(blocks[0], one)) {
    state.SkipWithError("host average gave a wrong sum");
    return;
  }
  // Timed on the same buffers: the sum overwrites tower 0's, the work is the same.
  for (auto _ : state) average();
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * n * total * 4);
}
BENCHMARK(BM_GradAverageHost)->ArgName("towers")->Arg(2)->Arg(4)->UseRealTime()->MinTime(bench_min_time(0.5));

void BM_GradAverageNccl(benchmark::State& state) {
  const int n = static_cast<int>(state.range(0));
  if (skip_without_gpus(state, n)) return;
  GradSetup s(n, n);
  std::vector<Tower*> ts;
  for (auto& t : s.towers) ts.push_back(t.get());
  NcclReducer nccl(ts);
  std::vector<float> out(s.g->layout().total());
  auto pin = pin_host_memory(out.data(), sizeof(float) * out.size());
  s.compute();
  CUDA_CHECK(cudaMemcpy(out.data(), s.towers[0]->device_grads(), sizeof(float) * out.size(),
                        cudaMemcpyDeviceToHost));
  const std::vector<float> one = out;
  nccl.sum_to_host(out.data());
  if (!s.sum_is_right(out.data(), one)) {
    state.SkipWithError("NCCL average gave a wrong sum");
    return;
  }
  // Timed on the same buffers (the all-reduce is in place, so the values grow; the work and
  // the bytes moved are the same).
  for (auto _ : state) nccl.sum_to_host(out.data());
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * n * out.size() * 4);
}
BENCHMARK(BM_GradAverageNccl)->ArgName("towers")->Arg(2)->Arg(4)->UseRealTime()->MinTime(bench_min_time(0.5));

#if defined(TOWERS_BENCH_CUBLASLT)
// The products of Dense::forward_gpu and Dense::backward_gpu (src/layers/dense.cpp) for the
// cifar10 net's dense layers at batch 128, as row-major kernels::cuda::gemm calls.
struct DenseGemm {
  const char* name;
  bool trans_a, trans_b;
  int64_t m, n, k, lda, ldb, ldc;
};
std::vector<DenseGemm> dense_gemms() {
  const int64_t n = 128;
  struct Layer {
    const char* name;
    int64_t in, out;
  };
  std::vector<DenseGemm> out;
  for (const Layer& l : {Layer{"local3", 2304, 384}, Layer{"local4", 384, 192},
                         Layer{"softmax_linear", 192, 10}}) {
    out.push_back({l.name, false, true, n, l.out, l.in, l.in, l.in, l.out});   // y = x W^T
    out.push_back({l.name, true, false, l.out, l.in, n, l.out, l.in, l.in});   // dW = g^T x
    out.push_back({l.name, false, false, n, l.in, l.out, l.out, l.in, l.in});  // dx = g W
  }
  return out;
}

// What BM_DenseGemm holds on the GPU, released however it ends.
struct DenseGemmResources {
  std::vector<void*> buffers;
  cudaStream_t stream = nullptr;
  cublasHandle_t blas = nullptr;
  cublasLtHandle_t lt = nullptr;
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  cudaGraphExec_t graph = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  float* alloc(size_t bytes) {
    void* p = nullptr;
    CUDA_CHECK(cudaMalloc(&p, bytes));
    buffers.push_back(p);
    return static_cast<float*>(p);
  }
  ~DenseGemmResources() {
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    if (stream != nullptr && cudaStreamIsCapturing(stream, &capturing) == cudaSuccess &&
        capturing != cudaStreamCaptureStatusNone) {  // a call failed while being captured
      cudaGraph_t partial = nullptr;
      if (cudaStreamEndCapture(stream, &partial) == cudaSuccess && partial != nullptr)
        cudaGraphDestroy(partial);
    }
    if (stream != nullptr) cudaStreamSynchronize(stream);
    if (graph != nullptr) cudaGraphExecDestroy(graph);
    if (start != nullptr) cudaEventDestroy(start);
    if (stop != nullptr) cudaEventDestroy(stop);
    if (pref != nullptr) cublasLtMatmulPreferenceDestroy(pref);
    for (cublasLtMatrixLayout_t l : {la, lb, lc})
      if (l != nullptr) cublasLtMatrixLayoutDestroy(l);
    if (op != nullptr) cublasLtMatmulDescDestroy(op);
    if (lt != nullptr) cublasLtDestroy(lt);
    if (blas != nullptr) cublasDestroy(blas);
    if (stream != nullptr) cudaStreamDestroy(stream);
    for (void* p : buffers) cudaFree(p);
  }
};

// One product (dense_gemms()[product]) one way (algo: -2, -1 or a cuBLASLt candidate); the
// label, or throws with what went wrong.
void dense_gemm_case(benchmark::State& state, int product, int algo) {
  const DenseGemm d = dense_gemms()[product];
  static const char* kProducts[] = {"forward", "weight gradient", "input gradient"};
  std::string label = std::string(d.name) + " " + kProducts[product % 3];
  DenseGemmResources r;
  CUDA_CHECK(cudaStreamCreateWithFlags(&r.stream, cudaStreamNonBlocking));
  const int64_t a_rows = d.trans_a ? d.k : d.m, b_rows = d.trans_b ? d.n : d.k;
  std::vector<float> a(a_rows * d.lda), b(b_rows * d.ldb);
  Rng rng(9);
  for (float& v : a) v = rng.uniform(-1.0f, 1.0f);
  for (float& v : b) v = rng.uniform(-1.0f, 1.0f);
  const size_t c_bytes = sizeof(float) * d.m * d.ldc;
  float* a_d = r.alloc(sizeof(float) * a.size());
  float* b_d = r.alloc(sizeof(float) * b.size());
  float* c_d = r.alloc(c_bytes);
  float* want_d = r.alloc(c_bytes);
  float* ct_d = r.alloc(sizeof(float) * d.m * d.n);  // algo -2: the transposed product
  const size_t ws_bytes = size_t{32} << 20;          // the tower's cuBLAS workspace
  float* ws = r.alloc(ws_bytes);
  CUDA_CHECK(cudaMemcpyAsync(a_d, a.data(), sizeof(float) * a.size(), cudaMemcpyHostToDevice,
                             r.stream));
  CUDA_CHECK(cudaMemcpyAsync(b_d, b.data(), sizeof(float) * b.size(), cudaMemcpyHostToDevice,
                             r.stream));
  CUBLAS_CHECK(cublasCreate(&r.blas));
  CUBLAS_CHECK(cublasSetStream(r.blas, r.stream));
  CUBLAS_CHECK(cublasSetWorkspace(r.blas, ws, ws_bytes));
  // The tower's call (FP32: the handle's default math mode), which is also the reference.
  auto sgemm = [&](float* c) {
    kernels::cuda::gemm(r.blas, d.trans_a, d.trans_b, d.m, d.n, d.k, 1.0f, a_d, d.lda, b_d,
                        d.ldb, 0.0f, c, d.ldc);
  };
  sgemm(want_d);
  const float one = 1.0f, zero = 0.0f;
  std::function<void()> run;
  cublasLtMatmulHeuristicResult_t found[8];
  if (algo == -1) {
    run = [&] { sgemm(c_d); };
    label += ", cublasSgemm as the tower calls it";
  } else if (algo == -2) {
    // C^T (n, m) = op(B)^T op(A)^T with the operands' roles swapped, then transposed into C by
    // cublasSgeam: the same product, another kernel choice.
    run = [&] {
      kernels::cuda::gemm(r.blas, !d.trans_b, !d.trans_a, d.n, d.m, d.k, 1.0f, b_d, d.ldb, a_d,
                          d.lda, 0.0f, ct_d, d.m);
      // Row-major C^T (n, m) is column-major (m, n) with ld m; row-major C (m, n) is
      // column-major (n, m) with ld ldc: C = (C^T)^T.
      CUBLAS_CHECK(cublasSgeam(r.blas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(d.n),
                               static_cast<int>(d.m), &one, ct_d, static_cast<int>(d.m), &zero, c_d,
                               static_cast<int>(d.ldc), c_d, static_cast<int>(d.ldc)));
    };
    label += ", operands swapped (C^T), then cublasSgeam's transpose";
  } else {
    // cuBLASLt: the same column-major call (kernels/gemm.h's mapping).
    const kernels::cuda::SgemmCall call = kernels::cuda::sgemm_call(
        d.trans_a, d.trans_b, d.m, d.n, d.k, a_d, d.lda, b_d, d.ldb, c_d, d.ldc);
    const kernels::cuda::ColMajorGemm g = call.g;
    const kernels::cuda::CublasInts x = call.x;
    CUBLAS_CHECK(cublasLtCreate(&r.lt));
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&r.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t ta = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t tb = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(r.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(r.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&r.la, CUDA_R_32F, g.trans_a ? x.k : x.m,
                                            g.trans_a ? x.m : x.k, x.lda));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&r.lb, CUDA_R_32F, g.trans_b ? x.n : x.k,
                                            g.trans_b ? x.k : x.n, x.ldb));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&r.lc, CUDA_R_32F, x.m, x.n, x.ldc));
    CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&r.pref));
    const uint64_t ws_limit = ws_bytes;
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        r.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_limit, sizeof ws_limit));
    int count = 0;
    CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(r.lt, r.op, r.la, r.lb, r.lc, r.lc, r.pref, 8,
                                                found, &count));
    if (algo >= count) {
      state.SkipWithError(fmt::format("{}: cuBLASLt's heuristic offered {} candidates", label,
                                      count).c_str());
      return;
    }
    const cublasLtMatmulAlgo_t* al = &found[algo].algo;
    int32_t id = 0, splitk = 0;
    uint32_t tile = 0, stages = 0, reduction = 0;
    size_t size = 0;
    cublasLtMatmulAlgoConfigGetAttribute(al, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof id, &size);
    cublasLtMatmulAlgoConfigGetAttribute(al, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof tile,
                                         &size);
    cublasLtMatmulAlgoConfigGetAttribute(al, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages,
                                         sizeof stages, &size);
    cublasLtMatmulAlgoConfigGetAttribute(al, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk,
                                         sizeof splitk, &size);
    cublasLtMatmulAlgoConfigGetAttribute(al, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &reduction,
                                         sizeof reduction, &size);
    label += fmt::format(", cuBLASLt candidate {} of {}: algo id {}, tile {}, stages {}, split-K "
                         "{} (reduction {}), workspace {} B, waves {:.2f}",
                         algo, count, id, tile, stages, splitk, reduction,
                         found[algo].workspaceSize, found[algo].wavesCount);
    const size_t ws_size = found[algo].workspaceSize;
    run = [&, g, al, ws_size] {
      CUBLAS_CHECK(cublasLtMatmul(r.lt, r.op, &one, g.a, r.la, g.b, r.lb, &zero, c_d, r.lc, c_d,
                                  r.lc, al, ws, ws_size, r.stream));
    };
  }
  // Validation: the product against the tower's, within FP32 summation noise; an element left
  // unwritten (NaN) fails.
  CUDA_CHECK(cudaMemsetAsync(c_d, 0xff, c_bytes, r.stream));
  run();
  std::vector<float> got(d.m * d.ldc), want(d.m * d.ldc);
  CUDA_CHECK(cudaMemcpyAsync(got.data(), c_d, c_bytes, cudaMemcpyDeviceToHost, r.stream));
  CUDA_CHECK(cudaMemcpyAsync(want.data(), want_d, c_bytes, cudaMemcpyDeviceToHost, r.stream));
  CUDA_CHECK(cudaStreamSynchronize(r.stream));
  for (size_t i = 0; i < got.size(); ++i)
    if (!(std::fabs(got[i] - want[i]) <= 1e-3f * std::max(1.0f, std::fabs(want[i])))) {
      state.SkipWithError(fmt::format("{}: element {} is {}, cublasSgemm's {}", label, i, got[i],
                                      want[i]).c_str());
      return;
    }
  // Timed: kCalls calls captured in one CUDA graph, so that the GPU runs them back to back and
  // the time is the kernels', not the host's launch rate.
  constexpr int kCalls = 20;
  cudaGraph_t graph;
  CUDA_CHECK(cudaStreamBeginCapture(r.stream, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < kCalls; ++i) run();
  CUDA_CHECK(cudaStreamEndCapture(r.stream, &graph));
  const cudaError_t inst = cudaGraphInstantiate(&r.graph, graph, 0);
  cudaGraphDestroy(graph);
  CUDA_CHECK(inst);
  CUDA_CHECK(cudaEventCreate(&r.start));
  CUDA_CHECK(cudaEventCreate(&r.stop));
  CUDA_CHECK(cudaGraphLaunch(r.graph, r.stream));  // warm-up
  for (auto _ : state) {
    CUDA_CHECK(cudaEventRecord(r.start, r.stream));
    CUDA_CHECK(cudaGraphLaunch(r.graph, r.stream));
    CUDA_CHECK(cudaEventRecord(r.stop, r.stream));
    CUDA_CHECK(cudaEventSynchronize(r.stop));
    float ms = 0.0f;
    CUDA_CHECK(cudaEventElapsedTime(&ms, r.start, r.stop));
    state.SetIterationTime(1e-3 * ms / kCalls);
  }
  state.counters["GFLOP_per_sec"] = benchmark::Counter(
      2e-9 * d.m * d.n * d.k, benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(label);
}

// Args: the product (dense_gemms() index: layer x {forward, weight gradient, input gradient}),
// algo (-2: the transposed product and a transpose, -1: cublasSgemm as the tower calls it,
// 0..7: cuBLASLt's heuristic candidate). Each row runs a fixed 50 iterations of 20 calls.
void BM_DenseGemm(benchmark::State& state) {
  if (skip_without_gpus(state)) return;
  try {
    dense_gemm_case(state, static_cast<int>(state.range(0)), static_cast<int>(state.range(1)));
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}
BENCHMARK(BM_DenseGemm)
    ->ArgNames({"product", "algo"})
    ->ArgsProduct({benchmark::CreateDenseRange(0, 8, 1), benchmark::CreateDenseRange(-2, 7, 1)})
    ->UseManualTime()
    ->Iterations(50)
    ->Unit(benchmark::kMicrosecond);
#endif  // TOWERS_BENCH_CUBLASLT

}  // namespace

BENCHMARK_MAIN();
