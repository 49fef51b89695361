// GPU twins of the bias kernels (kernels/cuda/bias.cu) against the CPU twins on fresh random
// inputs: the add (with the fused ReLU) exactly, the gradient (double sums in another order)
// to 1e-6 and bitwise the same from run to run. Shapes: a conv layer's (n, 64, 12x12), a dense
// layer's (n, 384, 1), and awkward ones. Skips without a CUDA device.
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "core/cuda_check.h"
#include "gpu_test_util.h"
#include "kernels/bias.h"

namespace towers {
namespace {

using gputest::DeviceArray;
using gputest::max_rel_error;
using gputest::random_floats;
using gputest::Stream;

struct BiasCase {
  int64_t n, c, hw;
};

std::string describe(const BiasCase& k) {
  return std::to_string(k.n) + "x" + std::to_string(k.c) + "x" + std::to_string(k.hw);
}

const std::vector<BiasCase> kCases = {{32, 64, 144}, {128, 384, 1}, {3, 5, 7}, {1, 3, 1000}};

TEST(BiasGpu, AddMatchesCpuTwin) {
  TOWERS_SKIP_WITHOUT_GPU();
  Stream st;
  uint64_t seed = 70;
  for (const BiasCase& k : kCases)
    for (bool relu : {false, true}) {
      SCOPED_TRACE(describe(k) + (relu ? " relu" : ""));
      const int64_t count = k.n * k.c * k.hw;
      const std::vector<float> y0 = random_floats(count, ++seed);  // (n, C, HW)
      const std::vector<float> bias = random_floats(k.c, ++seed);
      std::vector<float> want = y0;
      kernels::cpu::bias_add(k.n, k.c, k.hw, bias.data(), want.data());
      if (relu)
        for (float& v : want) v = std::max(v, 0.0f);  // as the CPU layers apply it
      DeviceArray<float> y_d(y0), bias_d(bias);
      kernels::cuda::bias_add(st.s, k.n, k.c, k.hw, bias_d.get(), y_d.get(), relu);
      EXPECT_EQ(max_rel_error(y_d.download(), want), 0.0);  // one float add: exact
    }
}

TEST(BiasGpu, GradMatchesCpuTwinAndIsDeterministic) {
  TOWERS_SKIP_WITHOUT_GPU();
  Stream st;
  uint64_t seed = 80;
  std::vector<BiasCase> cases = kCases;
  cases.push_back({4, 3, 0});  // no terms: db = 0, or unchanged when accumulating
  // Few channels, many terms: each channel's sum in segments, a block each (8 for the CIFAR-10
  // net's conv1 at batch 128; 64, the most, for 3 channels of 320,000 terms).
  cases.push_back({128, 64, 576});
  cases.push_back({64, 3, 5000});
  for (const BiasCase& k : cases)
    for (bool accumulate : {false, true}) {
      SCOPED_TRACE(describe(k) + (accumulate ? " accumulate" : ""));
      const std::vector<float> dy = random_floats(k.n * k.c * k.hw, ++seed);
      const std::vector<float> db0 = random_floats(k.c, ++seed);
      std::vector<float> want = db0;
      kernels::cpu::bias_grad(k.n, k.c, k.hw, dy.data(), want.data(), accumulate);
      DeviceArray<float> dy_d(dy), db_d(db0);
      const int64_t np = kernels::cuda::bias_grad_partials(k.n, k.c, k.hw);
      DeviceArray<double> partials(np);
      double* p = np > 0 ? partials.get() : nullptr;
      kernels::cuda::bias_grad(st.s, k.n, k.c, k.hw, dy_d.get(), db_d.get(), accumulate, p);
      const std::vector<float> db = db_d.download();
      EXPECT_LT(max_rel_error(db, want), 1e-6);
      db_d.upload(db0);
      kernels::cuda::bias_grad(st.s, k.n, k.c, k.hw, dy_d.get(), db_d.get(), accumulate, p);
      EXPECT_EQ(max_rel_error(db_d.download(), db), 0.0);
    }
}

}  // namespace
}  // namespace towers
