// step_bench — one training step of a tower (forward, backward, optimizer apply) and the
// GEMM it is built on. Each benchmark validates its result before timing.
//
// Napkin math, cifar10 net at 24x24x3: forward = 2 * (conv1 64x75x576 + conv2 64x1600x144 +
// local3 2304x384 + local4 384x192 + logits 192x10) = 37.3 MFLOP per image; a training step is
// ~3x that (forward, dx, dW; conv1 skips dx), ~110 MFLOP per image, 14.1 GFLOP per batch of 128.
// The limit is the machine's sgemm rate (BM_Sgemm below, per thread), since >90% of the
// FLOPs are GEMMs.
#include <cmath>
#include <vector>

#include <benchmark/benchmark.h>
#include <oneapi/tbb/parallel_for.h>

#include "core/check.h"
#include "core/device.h"
#include "core/rng.h"
#include "kernels/gemm.h"
#include "layers/batchnorm.h"
#include "models/model_file.h"
#include "models/models.h"
#include "optim/optimizer.h"
#include "towers/tower.h"

namespace {

using namespace towers;

// Args: batch, threads. The convolutions' CPU algorithm is `conv` (auto: Winograd where it
// applies, conv2d.h).
void BM_TowerStep(benchmark::State& state, const char* model, ConvAlgorithm conv) {
  const int64_t batch = state.range(0);
  const int threads = static_cast<int>(state.range(1));
  ModelSpec spec = read_model(model);
  set_conv_algorithm(spec, conv);
  auto g = build_graph(spec);
  CpuTower tower(*g, batch, threads);
  std::vector<float> params(g->layout().total());
  g->layout().initialize(params.data(), 1);
  Optimizer opt(g->layout(), {"momentum"});
  Rng rng(2);
  std::vector<float> x(batch * numel(g->input_shape()));
  for (float& v : x) v = rng.uniform(-1.5f, 1.5f);  // standardized-image range, never zeros
  std::vector<int32_t> y(batch);
  for (auto& v : y) v = static_cast<int32_t>(rng.below(10));
  auto step = [&] {
    tower.load_params(params.data());
    StepStats s = tower.compute_gradients(x.data(), y.data(), batch, 1.0f / batch);
    tower.device().execute([&] { opt.apply(params.data(), tower.grads(), 0.01f); });
    return s;
  };
  // Validate: the loss is finite and near log(10) at initialisation, gradients are not zero.
  StepStats s = step();
  double gsum = 0;
  for (int64_t i = 0; i < g->layout().total(); ++i) gsum += std::fabs(tower.grads()[i]);
  if (!std::isfinite(s.loss_sum) || std::fabs(s.loss_sum / batch - std::log(10.0)) > 0.5 || gsum == 0) {
    state.SkipWithError("step failed validation");
    return;
  }
  for (auto _ : state) benchmark::DoNotOptimize(step());
  const double flops = 3.0 * g->flops_per_example();
  state.counters["images_per_sec"] =
      benchmark::Counter(static_cast<double>(batch), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["GFLOP_per_sec"] = benchmark::Counter(batch * flops * 1e-9,
                                                       benchmark::Counter::kIsIterationInvariantRate);
}
// Batch 128 on 1 and 2 threads (fashion: 2 only), in milliseconds of real time.
void step_args(benchmark::internal::Benchmark* b, bool one_thread) {
  b->ArgNames({"batch", "threads"});
  if (one_thread) b->Args({128, 1});
  b->Args({128, 2})->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(3.0);
}
BENCHMARK_CAPTURE(BM_TowerStep, cifar10, "cifar10", ConvAlgorithm::Auto)
    ->Apply([](auto* b) { step_args(b, true); });
// The same with every convolution as im2col + GEMM: what Winograd's conv2 gains.
BENCHMARK_CAPTURE(BM_TowerStep, cifar10_im2col, "cifar10", ConvAlgorithm::Im2col)
    ->Apply([](auto* b) { step_args(b, true); });
BENCHMARK_CAPTURE(BM_TowerStep, fashion, "fashion", ConvAlgorithm::Auto)
    ->Apply([](auto* b) { step_args(b, false); });

// One BatchNorm layer's training forward and backward on batch 128 of (C, H, H), on the
// default threads: resnet-small's three stages (24, 48, 96 channels). Args: C, H. The memory
// the passes stream is the limit: a forward reads x three times (two moments, normalize) and
// writes y, a backward reads x and dy twice (the sums, dx) and writes dx, at 4 bytes each.
void BM_BatchNormStep(benchmark::State& state) {
  const int64_t n = 128, c = state.range(0), h = state.range(1), count = n * c * h * h;
  BatchNorm bn("bn", {});
  bn.bind({c, h, h});
  Rng rng(4);
  std::vector<float> x(count), y(count), dy(count), dx(count);
  for (float& v : x) v = rng.uniform(-2.0f, 3.0f);
  for (float& v : dy) v = rng.uniform(-1.0f, 1.0f);
  std::vector<float> gamma(c, 1.0f), beta(c, 0.0f), mean(c, 0.0f), var(c, 1.0f);
  std::vector<float> dgamma(c), dbeta(c), dmean(c), dvar(c);
  std::vector<double> saved((saved_floats(bn, n) + 1) / 2);  // 8-byte aligned floats
  ForwardArgs f;
  f.n = n, f.x = x.data(), f.y = y.data(), f.saved = reinterpret_cast<float*>(saved.data());
  f.params = {gamma.data(), beta.data(), mean.data(), var.data()};
  BackwardArgs b;
  b.n = n, b.x = x.data(), b.y = y.data(), b.dy = dy.data(), b.dx = dx.data(), b.saved = f.saved;
  b.params = f.params;
  b.grads = {dgamma.data(), dbeta.data(), dmean.data(), dvar.data()};
  // Validate: with gamma 1 and beta 0 each channel of y has mean 0 and variance about 1.
  bn.forward(f);
  double s = 0.0, q = 0.0;
  for (int64_t e = 0; e < n; ++e)
    for (int64_t i = 0; i < h * h; ++i) {
      const double v = y[e * c * h * h + i];
      s += v, q += v * v;
    }
  const double m = static_cast<double>(n * h * h);
  if (std::fabs(s / m) > 1e-4 || std::fabs(q / m - 1.0) > 1e-3) {
    state.SkipWithError("batchnorm forward failed validation");
    return;
  }
  for (auto _ : state) {
    bn.forward(f);
    bn.backward(b);
    benchmark::DoNotOptimize(dx.data());
  }
  state.counters["GB_per_sec"] = benchmark::Counter(4.0 * count * (4 + 5) * 1e-9,
                                                    benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_BatchNormStep)
    ->ArgNames({"C", "H"})
    ->Args({24, 28})
    ->Args({48, 14})
    ->Args({96, 7})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->MinTime(1.0);

// The FLOP-rate limit: single-threaded OpenBLAS sgemm at conv2's shape (64 x 1152 x 1600,
// one chunk of 8 images), run on `threads` threads at once as a tower does.
void BM_Sgemm(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  const int64_t m = 64, n = 1152, k = 1600;
  CpuDevice dev(threads);
  std::vector<std::vector<float>> a(threads, std::vector<float>(m * k)),
      b(threads, std::vector<float>(k * n)), c(threads, std::vector<float>(m * n));
  Rng rng(3);
  for (auto& v : a) for (float& e : v) e = rng.uniform(-1, 1);
  for (auto& v : b) for (float& e : v) e = rng.uniform(-1, 1);
  // Validate one entry against a dot product.
  kernels::cpu::gemm(false, false, m, n, k, 1.0f, a[0].data(), k, b[0].data(), n, 0.0f, c[0].data(), n);
  double ref = 0;
  for (int64_t i = 0; i < k; ++i) ref += static_cast<double>(a[0][i]) * b[0][i * n];
  if (std::fabs(ref - c[0][0]) > 1e-3 * (1 + std::fabs(ref))) {
    state.SkipWithError("sgemm result wrong");
    return;
  }
  for (auto _ : state) {
    dev.execute([&] {
      oneapi::tbb::parallel_for(0, threads, [&](int t) {
        kernels::cpu::gemm(false, false, m, n, k, 1.0f, a[t].data(), k, b[t].data(), n, 0.0f,
                           c[t].data(), n);
      });
    });
  }
  state.counters["GFLOP_per_sec"] = benchmark::Counter(
      2.0 * m * n * k * threads * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_Sgemm)->ArgName("threads")->Arg(1)->Arg(2)->UseRealTime()->MinTime(1.0);

}  // namespace

BENCHMARK_MAIN();
