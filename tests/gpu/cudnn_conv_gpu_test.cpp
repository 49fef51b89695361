// Convolutions through cuDNN (core/cudnn_conv.h, the cuDNN path of layers/conv2d.cpp): the
// layer's GPU forward and backward against its CPU twin (im2col + GEMM) on fresh random inputs,
// for shapes cuDNN's symmetric padding fits and one it does not (which keeps im2col); one plan
// per batch size, reused; two runs give the same bits; the algorithm choice skips what is not
// deterministic or does not fit the workspace, and says so when nothing fits. On the emulator
// the cuDNN calls are the CPU twin (tests/emu/emu_cudnn.cpp), whose ranking is known, so the
// choice itself is checked there. Skips where no CUDA device is usable.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include <cublas_v2.h>
#include <cudnn.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "core/check.h"
#include "core/cudnn_conv.h"
#include "core/gpu.h"
#include "gpu_test_util.h"
#include "layers/conv2d.h"

namespace towers {
namespace {

using gputest::DeviceArray;
using gputest::max_rel_error;
using gputest::random_floats;
using gputest::Stream;
using kernels::Padding;

struct Case {
  std::string name;
  int64_t n, c, h, w;
  Conv2DConfig cfg;
  bool cudnn;  // whether cuDNN's padding fits (else the layer keeps im2col)
};

Conv2DConfig conv(int64_t co, int64_t k, int64_t stride, Padding p, bool relu) {
  Conv2DConfig c;
  c.out_channels = co, c.kernel = k, c.stride = stride, c.padding = p, c.relu = relu;
  return c;
}

const std::vector<Case> kCases = {
    {"conv1 3x24x24 k5 SAME relu", 8, 3, 24, 24, conv(16, 5, 1, Padding::Same, true), true},
    {"8x10x10 k3 SAME", 5, 8, 10, 10, conv(6, 3, 1, Padding::Same, false), true},
    {"5x9x9 k3/2 SAME (pads 1 and 1) relu", 3, 5, 9, 9, conv(7, 3, 2, Padding::Same, true), true},
    {"4x9x11 k3/2 VALID relu", 3, 4, 9, 11, conv(5, 3, 2, Padding::Valid, true), true},
    {"4x10x10 k3/2 SAME (pads 0 and 1): im2col", 2, 4, 10, 10, conv(5, 3, 2, Padding::Same, true),
     false},
};

double norm_rel(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0, r = 0;
  for (size_t i = 0; i < a.size(); ++i) d += (double(a[i]) - b[i]) * (double(a[i]) - b[i]), r += double(b[i]) * b[i];
  return std::sqrt(d / r);
}

// A tower's GPU context, as CudaTower builds it: cuBLAS and cuDNN bound to one stream, plans,
// scratch for n examples of the layer.
struct Context {
  Stream st;
  cublasHandle_t blas = nullptr;
  cudnnHandle_t dnn = nullptr;
  GpuPlans plans;
  std::unique_ptr<DeviceArray<float>> scratch;
  GpuExec exec(const Layer& l, int64_t n) {
    if (!scratch) scratch = std::make_unique<DeviceArray<float>>(std::max<int64_t>(l.gpu_scratch(n), 1));
    return GpuExec{st.s, blas, scratch->get(), scratch->size(), dnn, &plans, false};
  }
  Context() {
    EXPECT_EQ(cublasCreate(&blas), CUBLAS_STATUS_SUCCESS);
    EXPECT_EQ(cublasSetStream(blas, st.s), CUBLAS_STATUS_SUCCESS);
    EXPECT_EQ(cudnnCreate(&dnn), CUDNN_STATUS_SUCCESS);
    EXPECT_EQ(cudnnSetStream(dnn, st.s), CUDNN_STATUS_SUCCESS);
  }
  ~Context() {
    cudnnDestroy(dnn);
    cublasDestroy(blas);
  }
};

struct Results {
  std::vector<float> y, dx, dw, db;
};

// One forward and backward of layer on the GPU with exec.
Results run_gpu(const Layer& layer, const GpuExec& e, int64_t n, const std::vector<float>& x,
                const std::vector<float>& dy, const std::vector<float>& w,
                const std::vector<float>& b) {
  DeviceArray<float> x_d(x), dy_d(dy), w_d(w), b_d(b), y_d(static_cast<int64_t>(dy.size())),
      dx_d(static_cast<int64_t>(x.size())), dw_d(static_cast<int64_t>(w.size())),
      db_d(static_cast<int64_t>(b.size()));
  ForwardArgs f;
  f.n = n, f.x = x_d.get(), f.y = y_d.get();
  f.params[Conv2D::kWeight] = w_d.get(), f.params[Conv2D::kBias] = b_d.get();
  layer.forward_gpu(e, f);
  BackwardArgs bw;
  bw.n = n, bw.x = x_d.get(), bw.y = y_d.get(), bw.dy = dy_d.get(), bw.dx = dx_d.get();
  bw.params = f.params;
  bw.grads[Conv2D::kWeight] = dw_d.get(), bw.grads[Conv2D::kBias] = db_d.get();
  layer.backward_gpu(e, bw);
  return {y_d.download(), dx_d.download(), dw_d.download(), db_d.download()};
}

TEST(CudnnConvGpu, LayerMatchesCpuTwin) {
  TOWERS_SKIP_WITHOUT_GPU();
  uint64_t seed = 500;
  for (const Case& k : kCases) {
    SCOPED_TRACE(k.name);
    Conv2D layer("conv", k.cfg);
    layer.bind({k.c, k.h, k.w});
    ASSERT_EQ(layer.cpu_algorithm(), ConvAlgorithm::Im2col);
    const int64_t in = k.n * numel(layer.in_shape()), out = k.n * numel(layer.out_shape());
    const auto specs = layer.params();
    const std::vector<float> x = random_floats(in, ++seed), dy = random_floats(out, ++seed),
                             w = random_floats(numel(specs[0].shape), ++seed, -0.3f, 0.3f),
                             b = random_floats(numel(specs[1].shape), ++seed, -0.3f, 0.3f);
    Results cpu{std::vector<float>(out), std::vector<float>(in), std::vector<float>(w.size()),
                std::vector<float>(b.size())};
    ForwardArgs f;
    f.n = k.n, f.x = x.data(), f.y = cpu.y.data();
    f.params[Conv2D::kWeight] = w.data(), f.params[Conv2D::kBias] = b.data();
    layer.forward(f);
    BackwardArgs bw;
    bw.n = k.n, bw.x = x.data(), bw.y = cpu.y.data(), bw.dy = dy.data(), bw.dx = cpu.dx.data();
    bw.params = f.params;
    bw.grads[Conv2D::kWeight] = cpu.dw.data(), bw.grads[Conv2D::kBias] = cpu.db.data();
    layer.backward(bw);

    Context ctx;
    const GpuExec e = ctx.exec(layer, k.n);
    EXPECT_EQ(layer.gpu_uses_cudnn(e), k.cudnn);
    const Results gpu = run_gpu(layer, e, k.n, x, dy, w, b);
    // One plan for the batch size, made by the forward and reused by the backward.
    EXPECT_EQ(ctx.plans.size(), k.cudnn ? 1u : 0u);
    // float32 sums in other orders than OpenBLAS's: norm-wise, and element-wise relative to
    // max(|value|, 1e-3), as the residual block's test.
    for (auto [name, got, want] : {std::tuple{"y", &gpu.y, &cpu.y}, {"dx", &gpu.dx, &cpu.dx},
                                   {"dW", &gpu.dw, &cpu.dw}, {"db", &gpu.db, &cpu.db}}) {
      const double en = norm_rel(*got, *want), ee = max_rel_error(*got, *want);
      std::printf("  %s: %s norm %.3g, element %.3g\n", k.name.c_str(), name, en, ee);
      EXPECT_LT(en, 1e-5) << name;
      EXPECT_LT(ee, 2e-3) << name;
    }
    // Twice the same call gives the same bits (deterministic algorithms, one plan).
    const Results again = run_gpu(layer, e, k.n, x, dy, w, b);
    EXPECT_EQ(std::memcmp(again.y.data(), gpu.y.data(), sizeof(float) * out), 0);
    EXPECT_EQ(std::memcmp(again.dx.data(), gpu.dx.data(), sizeof(float) * in), 0);
    EXPECT_EQ(std::memcmp(again.dw.data(), gpu.dw.data(), sizeof(float) * w.size()), 0);
    EXPECT_EQ(ctx.plans.size(), k.cudnn ? 1u : 0u);
    // Without a cuDNN handle, or with --conv im2col, the layer keeps im2col.
    GpuExec bare = e;
    bare.dnn = nullptr;
    EXPECT_FALSE(layer.gpu_uses_cudnn(bare));
    Conv2DConfig im2col = k.cfg;
    im2col.algorithm = ConvAlgorithm::Im2col;
    Conv2D forced("forced", im2col);
    forced.bind({k.c, k.h, k.w});
    EXPECT_FALSE(forced.gpu_uses_cudnn(e));
  }
}

TEST(CudnnConvGpu, WindowFitsOnlyWhereSymmetric) {
  using kernels::make_window;
  EXPECT_TRUE(cudnn_window_fits(make_window(24, 5, 1, Padding::Same)));    // 2 and 2
  EXPECT_TRUE(cudnn_window_fits(make_window(9, 3, 2, Padding::Same)));     // 1 and 1
  EXPECT_FALSE(cudnn_window_fits(make_window(10, 3, 2, Padding::Same)));   // 0 and 1
  EXPECT_FALSE(cudnn_window_fits(make_window(8, 4, 1, Padding::Same)));    // 1 and 2
  EXPECT_TRUE(cudnn_window_fits(make_window(9, 3, 2, Padding::Valid)));
  EXPECT_TRUE(cudnn_window_fits(make_window(32, 1, 2, Padding::Same)));    // 0 and 0
}

CudnnConv::Shape shape_of(int64_t n, int64_t c, int64_t h, int64_t co, int64_t k) {
  CudnnConv::Shape s;
  s.n = n, s.out_channels = co;
  s.geo.channels = c, s.geo.height = h, s.geo.width = h;
  s.geo.rows = s.geo.cols = kernels::make_window(h, k, 1, Padding::Same);
  return s;
}

// Whatever the ranking, the plan takes its first deterministic entry (in FP32 not a tensor-op
// one), runs it in the workspace offered where it fits and in a workspace of its own where not,
// and computes the same function either way. The emulator's ranking is known: its deterministic
// backward algorithms need workspace, its first forward ones are tensor-op (offered only with
// TF32) and then GEMM (which needs workspace).
TEST(CudnnConvGpu, ChoiceKeepsToWorkspaceAndDeterminism) {
  TOWERS_SKIP_WITHOUT_GPU();
  Context ctx;
  const CudnnConv::Shape s = shape_of(4, 8, 12, 16, 5);
  const size_t big = sizeof(float) * s.geo.patch() * s.n * s.geo.out_pixels();
  CudnnConv roomy(ctx.dnn, s, false, big, "roomy");
  CudnnConv roomy_tf32(ctx.dnn, s, true, big, "roomy, TF32");
  std::printf("  FP32, %zu B offered: %s\n", big, roomy.algorithms().c_str());
  std::printf("  TF32, %zu B offered: %s\n", big, roomy_tf32.algorithms().c_str());
  // cuDNN's non-deterministic algorithms (they add with atomics) are never chosen.
  for (const std::string& chosen : {roomy.algorithms(), roomy_tf32.algorithms()})
    for (const char* banned :
         {"backward-data ALGO_0", "backward-filter ALGO_0", "backward-filter ALGO_3"})
      EXPECT_EQ(chosen.find(banned), std::string::npos) << chosen;
  // No workspace offered: a direction that needs some runs in a workspace of the plan's own
  // (cuDNN's deterministic backward-filter algorithms often want a little more than the layer's
  // im2col scratch), and computes what the roomy plan computes: bitwise where both chose the
  // same algorithm, within FP32 rounding where not.
  CudnnConv tight(ctx.dnn, s, false, 0, "tight");
  std::printf("  FP32, no workspace: %s\n", tight.algorithms().c_str());
  EXPECT_EQ(tight.workspace_bytes(), 0u);
  const int64_t xs = s.n * s.geo.channels * s.geo.height * s.geo.width;
  const int64_t ys = s.n * s.out_channels * s.geo.rows.out * s.geo.cols.out;
  const int64_t ws = s.out_channels * s.geo.patch();
  const std::vector<float> x = random_floats(xs, 71), w = random_floats(ws, 72),
                           dy = random_floats(ys, 73);
  DeviceArray<float> x_d(x), w_d(w), dy_d(dy), out_d(std::max({xs, ys, ws})),
      scratch_d(std::max<int64_t>(static_cast<int64_t>(big / sizeof(float)), 1));
  // Each direction of both plans, poisoned output first; the roomy plan in the scratch.
  const auto run = [&](const CudnnConv& plan, int direction, float* ws_ptr, int64_t count) {
    out_d.upload(std::vector<float>(std::max({xs, ys, ws}), NAN));
    if (direction == 0) plan.forward(x_d.get(), w_d.get(), out_d.get(), ws_ptr);
    if (direction == 1) plan.backward_data(w_d.get(), dy_d.get(), out_d.get(), ws_ptr);
    if (direction == 2) plan.backward_filter(x_d.get(), dy_d.get(), out_d.get(), ws_ptr);
    CUDA_CHECK(cudaStreamSynchronize(ctx.st.s));
    std::vector<float> got = out_d.download();
    got.resize(count);
    return got;
  };
  const std::string names[3] = {"forward", "backward-data", "backward-filter"};
  const int64_t counts[3] = {ys, xs, ws};
  for (int d = 0; d < 3; ++d) {
    SCOPED_TRACE(names[d]);
    const std::vector<float> want = run(roomy, d, scratch_d.get(), counts[d]);
    const std::vector<float> got = run(tight, d, nullptr, counts[d]);
    for (float v : got) ASSERT_TRUE(std::isfinite(v)) << "an output the tight plan left unwritten";
    EXPECT_LT(norm_rel(got, want), 1e-5) << tight.algorithms() << " against " << roomy.algorithms();
  }
  // Without the determinism requirement (--cudnn-nondeterministic) the first of the ranking
  // that fits is taken, whatever it is; it computes the same function.
  CudnnConv any(ctx.dnn, s, false, big, "any", CudnnRules{.nondeterministic = true});
  std::printf("  FP32, any algorithm, %zu B offered: %s\n", big, any.algorithms().c_str());
  for (int d = 0; d < 3; ++d) {
    SCOPED_TRACE(names[d] + std::string(", any algorithm"));
    const std::vector<float> want = run(roomy, d, scratch_d.get(), counts[d]);
    const std::vector<float> got = run(any, d, scratch_d.get(), counts[d]);
    EXPECT_LT(norm_rel(got, want), 1e-5) << any.algorithms() << " against " << roomy.algorithms();
  }
  // Timed (--cudnn-benchmark): the same rules over cuDNN's measured order instead of its
  // ranking, with the workspace offered or none; each computes the same function (within 1e-4:
  // timing may pick an FFT or Winograd algorithm, which round differently), every direction
  // says what its choice measured, and the deterministic ones take no non-deterministic
  // algorithm. timed_tight has the same shape and rules as timed: it takes the process's first
  // search's choice.
  CudnnConv timed(ctx.dnn, s, false, big, "timed", CudnnRules{.benchmark = true});
  CudnnConv timed_any(ctx.dnn, s, false, big, "timed, any",
                      CudnnRules{.nondeterministic = true, .benchmark = true});
  CudnnConv timed_tight(ctx.dnn, s, false, 0, "timed, tight", CudnnRules{.benchmark = true});
  for (const CudnnConv* plan : {&timed, &timed_any, &timed_tight}) {
    const std::string chosen = plan->algorithms();
    std::printf("  FP32, %s\n", chosen.c_str());
    EXPECT_EQ(chosen.rfind("timed: forward ", 0), 0u) << chosen;
    int measured = 0;
    for (size_t at = chosen.find(" ms)"); at != std::string::npos; at = chosen.find(" ms)", at + 1))
      ++measured;
    EXPECT_EQ(measured, 3) << chosen;
    for (int d = 0; d < 3; ++d) {
      SCOPED_TRACE(names[d] + std::string(", ") + chosen);
      const std::vector<float> want = run(roomy, d, scratch_d.get(), counts[d]);
      const std::vector<float> got =
          run(*plan, d, plan == &timed_tight ? nullptr : scratch_d.get(), counts[d]);
      EXPECT_LT(norm_rel(got, want), 1e-4) << " against " << roomy.algorithms();
    }
  }
  EXPECT_EQ(timed_tight.algorithms().substr(0, 40), timed.algorithms().substr(0, 40));
  for (const std::string& chosen : {timed.algorithms(), timed_tight.algorithms()})
    for (const char* banned :
         {"backward-data ALGO_0", "backward-filter ALGO_0", "backward-filter ALGO_3"})
      EXPECT_EQ(chosen.find(banned), std::string::npos) << chosen;
  // With TF32 allowed, timed TF32 against the ranked TF32 plan (both round their products'
  // inputs to TF32, in different algorithms).
  CudnnConv timed_tf32(ctx.dnn, s, true, big, "timed, TF32", CudnnRules{.benchmark = true});
  std::printf("  TF32, %s\n", timed_tf32.algorithms().c_str());
  for (int d = 0; d < 3; ++d) {
    SCOPED_TRACE(names[d] + std::string(", TF32, ") + timed_tf32.algorithms());
    const std::vector<float> want = run(roomy_tf32, d, scratch_d.get(), counts[d]);
    const std::vector<float> got = run(timed_tf32, d, scratch_d.get(), counts[d]);
    EXPECT_LT(norm_rel(got, want), 2e-3) << " against " << roomy_tf32.algorithms();
  }
  if (testutil::emulated_gpu()) {
    // The emulator's timed order passes over a failed FFT trial, then puts the algorithms without
    // workspace first: the timed forward is IMPLICIT_GEMM where the ranking's is GEMM (TF32:
    // the tensor-op IMPLICIT_PRECOMP_GEMM, as ranked), and without the determinism requirement
    // the backward directions take ALGO_0. timed_tight runs its two backward directions (ALGO_1,
    // one image's im2col buffer each) in workspaces of its own.
    EXPECT_EQ(timed.algorithms().substr(0, 30), "timed: forward IMPLICIT_GEMM (")
        << timed.algorithms();
    EXPECT_NE(timed.algorithms().find("backward-data ALGO_1"), std::string::npos);
    EXPECT_NE(timed_any.algorithms().find("backward-data ALGO_0"), std::string::npos);
    EXPECT_NE(timed_any.algorithms().find("backward-filter ALGO_0"), std::string::npos);
    EXPECT_EQ(timed_tight.own_workspace_bytes(), 2 * big / s.n) << timed_tight.algorithms();
    EXPECT_EQ(timed_tf32.algorithms().substr(0, 38), "timed: forward IMPLICIT_PRECOMP_GEMM (")
        << timed_tf32.algorithms();
    // The emulator ranks the non-deterministic backward algorithms first.
    EXPECT_NE(any.algorithms().find("backward-data ALGO_0"), std::string::npos) << any.algorithms();
    EXPECT_NE(any.algorithms().find("backward-filter ALGO_0"), std::string::npos)
        << any.algorithms();
    EXPECT_EQ(roomy.algorithms().substr(0, 12), "forward GEMM");
    EXPECT_NE(roomy.algorithms().find("backward-data ALGO_1"), std::string::npos);
    EXPECT_NE(roomy.algorithms().find("backward-filter ALGO_1"), std::string::npos);
    EXPECT_EQ(roomy_tf32.algorithms().substr(0, 29), "forward IMPLICIT_PRECOMP_GEMM");
    EXPECT_EQ(roomy.own_workspace_bytes(), 0u);
    // The emulator ranks only ALGO_1 (im2col's bytes) as deterministic for both backward
    // directions and GEMM first for the forward, each needing one image's im2col buffer, so the
    // tight plan runs all three in workspaces of its own of that size.
    EXPECT_EQ(tight.own_workspace_bytes(), 3 * big / s.n) << tight.algorithms();
    const std::string chosen = tight.algorithms();
    EXPECT_EQ(chosen.substr(0, 12), "forward GEMM") << chosen;
    EXPECT_NE(chosen.find("backward-data ALGO_1 ("), std::string::npos) << chosen;
    EXPECT_NE(chosen.find("backward-filter ALGO_1 ("), std::string::npos) << chosen;
    int owned = 0;
    for (size_t at = chosen.find("its own"); at != std::string::npos;
         at = chosen.find("its own", at + 1))
      ++owned;
    EXPECT_EQ(owned, 3) << chosen;
  }
}

// A timed plan whose trials all fail (the emulator's TOWERS_EMU_CUDNN_FIND_FAILS) takes
// cuDNN's heuristic ranking instead, direction by direction, and says so: the ranked plan's
// algorithms, each marked "ranked".
TOWERS_EMULATOR_TEST(CudnnConvGpu, TimedPlanWithoutAUsableTrialTakesTheRanking) {
  TOWERS_SKIP_WITHOUT_GPU();
  Context ctx;
  const CudnnConv::Shape s = shape_of(2, 3, 9, 7, 3);
  const size_t big = sizeof(float) * s.geo.patch() * s.n * s.geo.out_pixels();
  setenv("TOWERS_EMU_CUDNN_FIND_FAILS", "1", 1);
  CudnnConv timed(ctx.dnn, s, false, big, "timed", CudnnRules{.benchmark = true});
  unsetenv("TOWERS_EMU_CUDNN_FIND_FAILS");
  CudnnConv ranked(ctx.dnn, s, false, big, "ranked");
  std::string expected = "timed: " + ranked.algorithms();
  for (size_t at = expected.find(")"); at != std::string::npos; at = expected.find(")", at + 9)) {
    expected.insert(at, ", ranked");
  }
  EXPECT_EQ(timed.algorithms(), expected);
}

}  // namespace
}  // namespace towers
