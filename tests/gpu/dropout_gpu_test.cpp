// GPU twin of dropout (kernels/cuda/dropout.cu) against the CPU twin: the mask is integer
// arithmetic and the kept values one float multiply, so the twins agree bitwise. Through a
// GPU tower: each step's noise reaches the kernels of a replayed CUDA graph (a graph that
// replayed the noise of its capture would draw the captured step's mask at every step and
// leave the CPU tower's gradients). Skips without a CUDA device.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "core/gpu.h"
#include "core/rng.h"
#include "gpu_test_util.h"
#include "layers/dropout.h"
#include "models/model_file.h"
#include "towers/cuda_tower.h"

namespace towers {
namespace {

using gputest::DeviceArray;
using gputest::random_floats;
using gputest::Stream;

TEST(DropoutGpu, ForwardAndBackwardAreBitwiseTheCpuTwin) {
  TOWERS_SKIP_WITHOUT_GPU();
  Stream st;
  for (double rate : {0.1, 0.5}) {
    SCOPED_TRACE(rate);
    Dropout layer("drop", {rate});
    layer.bind({64, 8, 8});
    const int64_t n = 32, count = n * 64 * 64;
    const std::vector<float> x = random_floats(count, 81), dy = random_floats(count, 82);
    const kernels::StepNoise noise{0xabcdef12345ull, 40};
    std::vector<float> y(count), dx(count);
    ForwardArgs f;
    f.n = n, f.x = x.data(), f.y = y.data(), f.noise = &noise;
    layer.forward(f);
    BackwardArgs b;
    b.n = n, b.x = x.data(), b.y = y.data(), b.dy = dy.data(), b.dx = dx.data(), b.noise = &noise;
    layer.backward(b);
    DeviceArray<float> x_d(x), y_d(count), dy_d(dy), dx_d(count);
    DeviceArray<kernels::StepNoise> noise_d(std::vector<kernels::StepNoise>{noise});
    GpuExec e;
    e.stream = st.s;
    f.x = x_d.get(), f.y = y_d.get(), f.noise = noise_d.get();
    layer.forward_gpu(e, f);
    b.x = x_d.get(), b.y = y_d.get(), b.dy = dy_d.get(), b.dx = dx_d.get(), b.noise = noise_d.get();
    layer.backward_gpu(e, b);
    EXPECT_EQ(y_d.download(), y);
    EXPECT_EQ(dx_d.download(), dx);
    int64_t dropped = 0;
    for (float v : y) dropped += v == 0.0f;
    EXPECT_GT(dropped, 0);
    EXPECT_LT(dropped, count);
  }
}

double norm_rel(const float* a, const float* b, int64_t n) {
  double d = 0, r = 0;
  for (int64_t i = 0; i < n; ++i)
    d += (double(a[i]) - b[i]) * (double(a[i]) - b[i]), r += double(b[i]) * b[i];
  return std::sqrt(d / r);
}

TEST(DropoutGpu, EveryReplayedStepDrawsItsOwnMask) {
  TOWERS_SKIP_WITHOUT_GPU();
  const auto g = build_graph(parse_model(R"({"name": "drop", "input": [1, 8, 8], "classes": 10,
    "layers": [
      {"name": "hidden", "type": "dense", "units": 64, "weight_init": {"stddev": 0.2}},
      {"name": "drop", "type": "dropout", "rate": 0.5},
      {"name": "out", "type": "dense", "units": 10, "relu": false, "weight_init": {"stddev": 0.2}}]})",
                                         "drop.json"));
  const int64_t n = 32, total = g->layout().total();
  std::vector<float> params(total);
  g->layout().initialize(params.data(), 5);
  Rng rng(6);
  std::vector<float> images(n * 64);
  for (float& v : images) v = rng.uniform(-1.0f, 1.0f);
  std::vector<int32_t> labels(n);
  for (auto& l : labels) l = static_cast<int32_t>(rng.next_u64() % 10);
  TowerPlacement p;
  p.kind = DeviceKind::Cuda;
  p.cuda_graphs = true;
  CpuTower cpu(*g, n, 1);
  CudaTower cuda(*g, n, p);
  cpu.load_params(params.data());
  cuda.load_params(params.data());
  std::vector<float> previous;
  // The same batch and parameters at every step: only the noise changes. Step 0 runs eagerly,
  // 1 is captured and replayed, 2 to 4 replay.
  for (int step = 0; step < 5; ++step) {
    SCOPED_TRACE(step);
    const kernels::StepNoise noise{1000u + static_cast<uint64_t>(step), 64};
    cpu.set_noise(noise);
    cuda.set_noise(noise);
    const StepStats sc = cpu.compute_gradients(images.data(), labels.data(), n, 1.0f / n);
    const StepStats sg = cuda.compute_gradients(images.data(), labels.data(), n, 1.0f / n);
    EXPECT_NEAR(sg.loss_sum, sc.loss_sum, 1e-5 * std::fabs(sc.loss_sum));
    for (const Variable& v : g->layout().variables())
      EXPECT_LT(norm_rel(cuda.grads() + v.offset, cpu.grads() + v.offset, v.size), 1e-4)
          << v.spec.name;
    const std::vector<float> now(cpu.grads(), cpu.grads() + total);
    if (!previous.empty()) EXPECT_NE(now, previous) << "the mask did not change with the noise";
    previous = now;
  }
  EXPECT_EQ(cuda.graph_captures(), 1);
  EXPECT_EQ(cuda.graph_replays(), 4);
}

}  // namespace
}  // namespace towers
