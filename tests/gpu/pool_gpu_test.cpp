// GPU twin of max-pooling (kernels/cuda/pool.cu) against the CPU twin on fresh random inputs:
// maxima, argmax and the gathered backward, all exact. Shapes: the CIFAR-10 net's pool1 and
// pool2 (3x3/2 SAME), Fashion-MNIST's pool1, and an awkward one. Skips without a CUDA device.
#include <cstdint>
#include <string>
#include <vector>

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "core/cuda_check.h"
#include "core/rng.h"
#include "gpu_test_util.h"
#include "kernels/pool.h"

namespace towers {
namespace {

using gputest::DeviceArray;
using gputest::max_rel_error;
using gputest::random_floats;
using gputest::Stream;
using kernels::Padding;
using kernels::Window;

struct PoolCase {
  std::string name;
  int64_t planes, h, w;
  int64_t kh, sh;
  Padding ph;
  int64_t kw, sw;
  Padding pw;
  bool ties;  // small-integer inputs: ties, and inputs that are the maximum of several windows
};

const std::vector<PoolCase> kCases = {
    {"pool1 16x64x24x24 3x3/2 SAME", 16 * 64, 24, 24, 3, 2, Padding::Same, 3, 2, Padding::Same,
     false},
    {"pool2 32x64x12x12 3x3/2 SAME", 32 * 64, 12, 12, 3, 2, Padding::Same, 3, 2, Padding::Same,
     false},
    {"fashion 8x64x28x28 3x3/2 SAME, ties", 8 * 64, 28, 28, 3, 2, Padding::Same, 3, 2,
     Padding::Same, true},
    {"awkward 15x9x7 k3/2 VALID x k2/1 SAME, ties", 15, 9, 7, 3, 2, Padding::Valid, 2, 1,
     Padding::Same, true},
};

std::vector<float> inputs(const PoolCase& k, uint64_t seed) {
  const int64_t n = k.planes * k.h * k.w;
  if (!k.ties) return random_floats(n, seed);
  Rng rng(seed);
  std::vector<float> v(n);
  for (float& x : v) x = static_cast<float>(static_cast<int64_t>(rng.below(3)) - 1);
  return v;
}

TEST(PoolGpu, ForwardAndBackwardMatchCpuTwin) {
  TOWERS_SKIP_WITHOUT_GPU();
  Stream st;
  uint64_t seed = 50;
  for (const PoolCase& k : kCases) {
    SCOPED_TRACE(k.name);
    const Window rows = kernels::make_window(k.h, k.kh, k.sh, k.ph);
    const Window cols = kernels::make_window(k.w, k.kw, k.sw, k.pw);
    const int64_t n_in = k.planes * k.h * k.w, n_out = k.planes * rows.out * cols.out;
    const std::vector<float> x = inputs(k, ++seed);  // (planes, H, W)
    std::vector<float> y_want(n_out), argmax_want(n_out), dx_want(n_in);
    kernels::cpu::maxpool_forward(k.planes, k.h, k.w, rows, cols, x.data(), y_want.data(),
                                  argmax_want.data());
    DeviceArray<float> x_d(x), y_d(n_out), argmax_d(n_out);
    kernels::cuda::maxpool_forward(st.s, k.planes, k.h, k.w, rows, cols, x_d.get(), y_d.get(),
                                   argmax_d.get());
    EXPECT_EQ(max_rel_error(y_d.download(), y_want), 0.0);
    EXPECT_EQ(max_rel_error(argmax_d.download(), argmax_want), 0.0);

    // Without argmax (evaluation) the maxima are the same.
    DeviceArray<float> y2_d(n_out);
    kernels::cuda::maxpool_forward(st.s, k.planes, k.h, k.w, rows, cols, x_d.get(), y2_d.get(),
                                   nullptr);
    EXPECT_EQ(max_rel_error(y2_d.download(), y_want), 0.0);

    const std::vector<float> dy = random_floats(n_out, ++seed);
    kernels::cpu::maxpool_backward(k.planes, k.h, k.w, rows, cols, argmax_want.data(), dy.data(),
                                   dx_want.data());
    DeviceArray<float> dy_d(dy), dx_d(n_in);
    kernels::cuda::maxpool_backward(st.s, k.planes, k.h, k.w, rows, cols, argmax_d.get(),
                                    dy_d.get(), dx_d.get());
    // Each input adds its windows' dy in the CPU scatter's (row-major) order: exact.
    EXPECT_EQ(max_rel_error(dx_d.download(), dx_want), 0.0);
  }
}

}  // namespace
}  // namespace towers
