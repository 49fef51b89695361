// GPU twin of LRN (kernels/cuda/lrn.cu) against the CPU twin on fresh random inputs, relative
// error < 1e-5. Shapes: the CIFAR-10 net's norm1/norm2 (64x12x12, depth_radius 4, bias 1,
// alpha 0.001/9, beta 0.75), a 24x24 variant, awkward ones on the sqrt and powf paths, a
// channel count that leaves a short chunk, and a radius past the chunked kernels' 4.
// Skips without a CUDA device.
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "core/cuda_check.h"
#include "gpu_test_util.h"
#include "kernels/lrn.h"

namespace towers {
namespace {

using gputest::DeviceArray;
using gputest::max_rel_error;
using gputest::random_floats;
using gputest::Stream;

struct LrnCase {
  std::string name;
  int64_t n, c, hw;
  kernels::LrnParams p;
};

const std::vector<LrnCase> kCases = {
    {"norm 32x64x12x12", 32, 64, 144, {4, 1.0f, 0.001f / 9.0f, 0.75f}},
    {"norm 8x64x24x24", 8, 64, 576, {4, 1.0f, 0.001f / 9.0f, 0.75f}},
    {"awkward 3x5x7 r4 beta 0.5", 3, 5, 7, {4, 2.0f, 0.3f, 0.5f}},
    {"awkward 2x6x3 r1 beta 0.6 (powf)", 2, 6, 3, {1, 1.5f, 0.2f, 0.6f}},
    {"chunks of 8, 8 and 4 channels 2x20x9 r3", 2, 20, 9, {3, 1.0f, 0.4f, 0.75f}},
    {"radius 6, the per-element kernels 2x13x4", 2, 13, 4, {6, 1.0f, 0.2f, 0.75f}},
    {"the net's radius, a short last chunk 2x13x5 r4", 2, 13, 5, {4, 1.0f, 0.001f / 9.0f, 0.75f}},
    {"radius 0 2x9x1", 2, 9, 1, {0, 1.0f, 0.3f, 0.75f}},
    {"one channel, one pixel 3x1x1 r4", 3, 1, 1, {4, 2.0f, 0.3f, 0.5f}},
};

TEST(LrnGpu, ForwardAndBackwardMatchCpuTwin) {
  TOWERS_SKIP_WITHOUT_GPU();
  Stream st;
  uint64_t seed = 60;
  for (const LrnCase& k : kCases) {
    SCOPED_TRACE(k.name);
    const int64_t count = k.n * k.c * k.hw;
    // Inputs of a conv+ReLU+pool scale would barely normalise with alpha 0.001/9; a wider
    // range makes the window sums matter.
    const std::vector<float> x = random_floats(count, ++seed, -8.0f, 8.0f);  // (n, C, HW)
    const std::vector<float> dy = random_floats(count, ++seed);
    std::vector<float> y_want(count), s_want(count), dx_want(count);
    kernels::cpu::lrn_forward(k.p, k.n, k.c, k.hw, x.data(), y_want.data(), s_want.data());
    kernels::cpu::lrn_backward(k.p, k.n, k.c, k.hw, x.data(), y_want.data(), s_want.data(),
                               dy.data(), dx_want.data());

    DeviceArray<float> x_d(x), y_d(count), s_d(count), dy_d(dy), dx_d(count);
    kernels::cuda::lrn_forward(st.s, k.p, k.n, k.c, k.hw, x_d.get(), y_d.get(), s_d.get());
    kernels::cuda::lrn_backward(st.s, k.p, k.n, k.c, k.hw, x_d.get(), y_d.get(), s_d.get(),
                                dy_d.get(), dx_d.get());
    const double ey = max_rel_error(y_d.download(), y_want);
    const double es = max_rel_error(s_d.download(), s_want);
    // dx is the sum of two terms of order 1 that can cancel; its error is measured against that
    // order (floor 0.1), since a last-bit difference in either term (powf, fma contraction in
    // the CPU twin) is large relative to a cancelled dx.
    const double edx = max_rel_error(dx_d.download(), dx_want, 0.1);
    std::printf("  %s: max relative error y %.3g, scale %.3g, dx %.3g\n", k.name.c_str(), ey, es,
                edx);
    EXPECT_LT(ey, 1e-5);
    EXPECT_LT(es, 1e-5);
    EXPECT_LT(edx, 1e-5);
  }
}

}  // namespace
}  // namespace towers
