// A GPU tower against its CPU twin: the same parameters and batch give the same loss,
// accuracy and gradients (every layer's GPU path at once, the cuBLAS GEMMs included); a
// replayed CUDA graph gives bitwise the gradients of eager launches; evaluation agrees; and
// the numerical gradient check passes on the GPU too.
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include <gtest/gtest.h>

#include "core/rng.h"
#include "gpu_test_util.h"
#include "gradcheck.h"
#include "models/models.h"
#include "towers/cuda_tower.h"

namespace towers {
namespace {

struct Batch {
  std::vector<float> images;
  std::vector<int32_t> labels;
};

Batch random_batch(const Graph& g, int64_t n, uint64_t seed) {
  Rng rng(seed);
  Batch b;
  b.images.resize(n * numel(g.input_shape()));
  for (float& v : b.images) v = rng.uniform(-1.5f, 1.5f);
  for (int64_t i = 0; i < n; ++i) b.labels.push_back(static_cast<int32_t>(rng.next_u64() % g.num_classes()));
  return b;
}

// ||a - b|| / ||b|| over a whole gradient.
double norm_rel(const float* a, const float* b, int64_t n) {
  double d = 0, r = 0;
  for (int64_t i = 0; i < n; ++i) d += (double(a[i]) - b[i]) * (double(a[i]) - b[i]), r += double(b[i]) * b[i];
  return std::sqrt(d / r);
}

TowerPlacement gpu(bool graphs, bool tf32 = false) {
  TowerPlacement p;
  p.kind = DeviceKind::Cuda;
  p.cuda_graphs = graphs;
  p.tf32 = tf32;
  return p;
}

class TowerGpu : public ::testing::TestWithParam<const char*> {};

TEST_P(TowerGpu, MatchesTheCpuTower) {
  TOWERS_SKIP_WITHOUT_GPU();
  auto g = build_model(GetParam());
  const int64_t n = 32, total = g->layout().total();
  std::vector<float> params(total);
  g->layout().initialize(params.data(), 7);
  Batch b = random_batch(*g, n, 8);
  CpuTower cpu(*g, n, 2);
  CudaTower cuda(*g, n, gpu(false));
  cpu.load_params(params.data());
  cuda.load_params(params.data());
  StepStats sc = cpu.compute_gradients(b.images.data(), b.labels.data(), n, 1.0f / n);
  StepStats sg = cuda.compute_gradients(b.images.data(), b.labels.data(), n, 1.0f / n);
  EXPECT_NEAR(sg.loss_sum, sc.loss_sum, 1e-5 * std::fabs(sc.loss_sum));
  EXPECT_EQ(sg.correct, sc.correct);
  // Per variable, norm-wise: cuBLAS sums a conv's dW over n * pixels products (4,608 for
  // conv2 at n = 32, 18,432 for conv1) in another order than OpenBLAS's chunks, and the
  // differences pass through every layer below, so a whole tower is held to 1e-4; each kernel
  // alone is held to 1e-5 in the kernel tests.
  for (const Variable& v : g->layout().variables())
    EXPECT_LT(norm_rel(cuda.grads() + v.offset, cpu.grads() + v.offset, v.size), 1e-4)
        << v.spec.name;
  StepStats ec = cpu.evaluate(b.images.data(), b.labels.data(), n);
  StepStats eg = cuda.evaluate(b.images.data(), b.labels.data(), n);
  EXPECT_NEAR(eg.loss_sum, ec.loss_sum, 1e-5 * std::fabs(ec.loss_sum));
  EXPECT_EQ(eg.correct, ec.correct);
}

TEST_P(TowerGpu, CudaGraphReplayIsBitwiseEagerLaunches) {
  TOWERS_SKIP_WITHOUT_GPU();
  auto g = build_model(GetParam());
  const int64_t n = 16, total = g->layout().total();
  std::vector<float> params(total);
  g->layout().initialize(params.data(), 9);
  CudaTower eager(*g, n, gpu(false)), graphed(*g, n, gpu(true));
  // Steps 0 and 3 (a new batch size) run eagerly, 1 and 4 capture and replay, 2 replays.
  for (int step = 0; step < 5; ++step) {
    Batch b = random_batch(*g, n, 100 + step);
    const int64_t m = step >= 3 ? n / 2 : n;
    eager.load_params(params.data());
    graphed.load_params(params.data());
    StepStats se = eager.compute_gradients(b.images.data(), b.labels.data(), m, 1.0f / m);
    StepStats sg = graphed.compute_gradients(b.images.data(), b.labels.data(), m, 1.0f / m);
    EXPECT_EQ(se.loss_sum, sg.loss_sum) << "step " << step;
    EXPECT_EQ(std::memcmp(eager.grads(), graphed.grads(), sizeof(float) * total), 0) << "step " << step;
    for (int64_t i = 0; i < total; ++i) params[i] -= 0.1f * eager.grads()[i];
  }
  EXPECT_EQ(graphed.graph_captures(), 2);
  EXPECT_EQ(graphed.graph_replays(), 3);  // steps 1, 2 and 4
  EXPECT_EQ(eager.graph_replays(), 0);
}

INSTANTIATE_TEST_SUITE_P(Models, TowerGpu, ::testing::Values("cifar10", "fashion", "mlp"));

TEST(TowerGpu, Tf32StaysCloseToFp32) {
  TOWERS_SKIP_WITHOUT_GPU();
  auto g = build_model("cifar10");
  const int64_t n = 32, total = g->layout().total();
  std::vector<float> params(total);
  g->layout().initialize(params.data(), 7);
  Batch b = random_batch(*g, n, 8);
  CudaTower fp32(*g, n, gpu(true)), tf32(*g, n, gpu(true, true));
  fp32.load_params(params.data());
  tf32.load_params(params.data());
  StepStats a = fp32.compute_gradients(b.images.data(), b.labels.data(), n, 1.0f / n);
  StepStats t = tf32.compute_gradients(b.images.data(), b.labels.data(), n, 1.0f / n);
  // TF32 keeps 10 mantissa bits: about 1e-3 relative per product, so 1e-2 on the loss. The
  // gradients of the lower layers are sums with much cancellation, computed through every
  // layer above: with TF32 rounding emulated on the host they differ from FP32 by up to 4.5%
  // (conv1/weight), so whole gradients are held to 1e-1 norm-wise.
  EXPECT_NEAR(t.loss_sum, a.loss_sum, 1e-2 * std::fabs(a.loss_sum));
  double worst = 0.0;
  for (const Variable& v : g->layout().variables()) {
    const double e = norm_rel(tf32.grads() + v.offset, fp32.grads() + v.offset, v.size);
    EXPECT_LT(e, 1e-1) << v.spec.name;
    worst = std::max(worst, e);
  }
  // Identical gradients would mean --tf32 changed nothing.
  EXPECT_GT(worst, 1e-6) << "TF32 was not in effect";
}

TEST(TowerGpu, WholeCifar10NetGradientMatchesNumerical) {
  TOWERS_SKIP_WITHOUT_GPU();
  auto g = build_model("cifar10");
  const int64_t n = 2;
  CudaTower tower(*g, n, gpu(false));
  std::vector<float> params(g->layout().total());
  g->layout().initialize(params.data(), 3);
  const Variable& sl = g->layout().find("softmax_linear/weight");
  Rng rng(5);
  for (int64_t i = 0; i < sl.size; ++i) params[sl.offset + i] = rng.uniform(-0.5f, 0.5f);
  // The inputs of the CPU tower's check (tests/models_test.cpp), drawn the same way: an
  // instance known to keep the finite differences clear of ReLU and max-pool kinks.
  Batch b;
  b.images.resize(n * 3 * 24 * 24);
  for (float& v : b.images) v = rng.uniform(-1.5f, 1.5f);
  b.labels = {3, 8};
  tower.load_params(params.data());
  tower.compute_gradients(b.images.data(), b.labels.data(), n, 1.0f / n);
  std::vector<float> grads(tower.grads(), tower.grads() + g->layout().total());
  auto loss = [&] {
    tower.load_params(params.data());
    return tower.evaluate(b.images.data(), b.labels.data(), n).loss_sum / n;
  };
  for (const Variable& v : g->layout().variables()) {
    std::vector<int64_t> idx;
    for (int64_t i : testing::sample_indices(v.size, 12, v.offset)) idx.push_back(v.offset + i);
    auto r = testing::check_gradient(loss, params.data(), grads.data(), idx, v.spec.name, 2e-3f,
                                     2e-4, 5e-2);
    EXPECT_TRUE(r.ok()) << v.spec.name << ": " << r.worst;
    EXPECT_GE(r.checked, 6) << v.spec.name;
  }
}

}  // namespace
}  // namespace towers
