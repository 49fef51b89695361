// GPU twin of GELU (kernels/cuda/activation.cu, through the layer's forward_gpu/backward_gpu)
// against the CPU twin on fresh random inputs. Both run the rule of kernels/activation_rules.h
// in double, rounded once to float: relative error < 1e-6 (the device's double tanh may differ
// from the host's in its last bits). Skips without a CUDA device.
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "core/gpu.h"
#include "gpu_test_util.h"
#include "layers/gelu.h"

namespace towers {
namespace {

using gputest::LayerTwins;
using gputest::max_rel_error;
using gputest::random_floats;
using gputest::run_layer_twins;
using gputest::Stream;

struct GeluCase {
  std::string name;
  int64_t n;
  Shape in;
  float range;  // inputs in [-range, range]
};

const std::vector<GeluCase> kCases = {
    {"conv output 32x64x8x8", 32, {64, 8, 8}, 4.0f},
    {"dense output 7x37, tails", 7, {37}, 12.0f},
    {"odd 3x5x3x7", 3, {5, 3, 7}, 1.0f},
};

TEST(GeluGpu, ForwardAndBackwardMatchCpuTwin) {
  TOWERS_SKIP_WITHOUT_GPU();
  Stream st;
  uint64_t seed = 70;
  for (const GeluCase& k : kCases) {
    SCOPED_TRACE(k.name);
    Gelu layer("act");
    layer.bind(k.in);
    const int64_t count = k.n * numel(k.in);
    const std::vector<float> x = random_floats(count, ++seed, -k.range, k.range);  // (n, in)
    const std::vector<float> dy = random_floats(count, ++seed);
    const LayerTwins r = run_layer_twins(layer, k.n, x, dy, st.s);
    const double ey = max_rel_error(r.y_gpu, r.y_cpu);
    const double edx = max_rel_error(r.dx_gpu, r.dx_cpu);
    std::printf("  %s: max relative error y %.3g, dx %.3g\n", k.name.c_str(), ey, edx);
    EXPECT_LT(ey, 1e-6);
    EXPECT_LT(edx, 1e-6);
  }
}

}  // namespace
}  // namespace towers
