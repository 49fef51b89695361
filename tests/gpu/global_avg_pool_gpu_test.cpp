// GPU twin of global average pooling (kernels/cuda/pool.cu, through the layer's
// forward_gpu/backward_gpu) against the CPU twin on fresh random inputs. Both sum each plane in
// order in double by one thread and divide once (kernels/global_pool_rules.h), so they agree
// bitwise. Skips without a CUDA device.
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "core/gpu.h"
#include "gpu_test_util.h"
#include "layers/global_avg_pool.h"

namespace towers {
namespace {

using gputest::LayerTwins;
using gputest::random_floats;
using gputest::run_layer_twins;
using gputest::Stream;

struct GapCase {
  std::string name;
  int64_t n;
  Shape in;
};

const std::vector<GapCase> kCases = {
    {"32x64x8x8", 32, {64, 8, 8}},
    {"4x10x27x31", 4, {10, 27, 31}},
    {"5x3x1x1", 5, {3, 1, 1}},
};

TEST(GlobalAvgPoolGpu, ForwardAndBackwardMatchCpuTwinBitwise) {
  TOWERS_SKIP_WITHOUT_GPU();
  Stream st;
  uint64_t seed = 80;
  for (const GapCase& k : kCases) {
    SCOPED_TRACE(k.name);
    GlobalAvgPool layer("gap");
    layer.bind(k.in);
    const int64_t in_count = k.n * numel(k.in), out_count = k.n * k.in[0];
    const std::vector<float> x = random_floats(in_count, ++seed, -3.0f, 3.0f);  // (n, C, H, W)
    const std::vector<float> dy = random_floats(out_count, ++seed);             // (n, C, 1, 1)
    const LayerTwins r = run_layer_twins(layer, k.n, x, dy, st.s);
    const std::vector<float>&y = r.y_gpu, &dx = r.dx_gpu, &y_want = r.y_cpu, &dx_want = r.dx_cpu;
    int64_t y_diff = 0, dx_diff = 0;
    for (int64_t i = 0; i < out_count; ++i) y_diff += y[i] != y_want[i];
    for (int64_t i = 0; i < in_count; ++i) dx_diff += dx[i] != dx_want[i];
    std::printf("  %s: %lld of %lld outputs and %lld of %lld input gradients differ\n",
                k.name.c_str(), static_cast<long long>(y_diff), static_cast<long long>(out_count),
                static_cast<long long>(dx_diff), static_cast<long long>(in_count));
    EXPECT_EQ(y_diff, 0);
    EXPECT_EQ(dx_diff, 0);
  }
}

}  // namespace
}  // namespace towers
