// GPU twins of the convolution's data movers (kernels/cuda/conv.cu) against the CPU twins on
// fresh random inputs: batched im2col/col2im against the per-image CPU forms with ld = n * P,
// and the kernels around the GEMM against the loops of src/layers/conv2d.cpp. Shapes: the
// CIFAR-10 net's conv1 and conv2, and an awkward one. Skips where no CUDA device is usable.
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "conv_reference.h"
#include "core/cuda_check.h"
#include "gpu_test_util.h"
#include "kernels/bias.h"
#include "kernels/conv.h"

namespace towers {
namespace {

using gputest::DeviceArray;
using gputest::max_rel_error;
using gputest::random_floats;
using gputest::Stream;
using kernels::ConvGeometry;
using kernels::Padding;

struct ConvCase {
  std::string name;
  int64_t n, c, h, w;
  int64_t kh, sh;
  Padding ph;
  int64_t kw, sw;
  Padding pw;
  int64_t co;
};

const std::vector<ConvCase> kCases = {
    {"conv1 3x24x24 k5 SAME", 8, 3, 24, 24, 5, 1, Padding::Same, 5, 1, Padding::Same, 64},
    {"conv2 64x12x12 k5 SAME", 16, 64, 12, 12, 5, 1, Padding::Same, 5, 1, Padding::Same, 64},
    {"awkward 5x9x7 k3/2 SAME x k2/3 VALID", 3, 5, 9, 7, 3, 2, Padding::Same, 2, 3, Padding::Valid,
     7},
};

ConvGeometry geometry(const ConvCase& k) {
  ConvGeometry g;
  g.channels = k.c;
  g.height = k.h;
  g.width = k.w;
  g.rows = kernels::make_window(k.h, k.kh, k.sh, k.ph);
  g.cols = kernels::make_window(k.w, k.kw, k.sw, k.pw);
  return g;
}

TEST(ConvGpu, Im2colMatchesCpuTwin) {
  TOWERS_SKIP_WITHOUT_GPU();
  Stream st;
  uint64_t seed = 10;
  for (const ConvCase& k : kCases) {
    SCOPED_TRACE(k.name);
    const ConvGeometry g = geometry(k);
    const int64_t chw = k.c * k.h * k.w, P = g.out_pixels(), ld = k.n * P;
    const std::vector<float> x = random_floats(k.n * chw, ++seed);  // (n, C, H, W)
    std::vector<float> want(g.patch() * ld);                        // (patch, n * P)
    for (int64_t i = 0; i < k.n; ++i)
      kernels::cpu::im2col(g, x.data() + i * chw, want.data() + i * P, ld);
    DeviceArray<float> x_d(x), col_d(g.patch() * ld);
    kernels::cuda::im2col(st.s, g, k.n, x_d.get(), col_d.get());
    EXPECT_EQ(max_rel_error(col_d.download(), want), 0.0);  // data movement: exact
  }
}

TEST(ConvGpu, Col2imMatchesCpuTwin) {
  TOWERS_SKIP_WITHOUT_GPU();
  Stream st;
  uint64_t seed = 20;
  for (const ConvCase& k : kCases) {
    SCOPED_TRACE(k.name);
    const ConvGeometry g = geometry(k);
    const int64_t chw = k.c * k.h * k.w, P = g.out_pixels(), ld = k.n * P;
    const std::vector<float> col = random_floats(g.patch() * ld, ++seed);  // (patch, n * P)
    std::vector<float> want(k.n * chw);                                    // (n, C, H, W)
    for (int64_t i = 0; i < k.n; ++i)
      kernels::cpu::col2im(g, col.data() + i * P, ld, want.data() + i * chw);
    DeviceArray<float> col_d(col), dx_d(k.n * chw);
    kernels::cuda::col2im(st.s, g, k.n, col_d.get(), dx_d.get());
    // Each input element adds its entries in the CPU scatter's order: exact.
    EXPECT_EQ(max_rel_error(dx_d.download(), want), 0.0);
  }
}

TEST(ConvGpu, OutputMatchesLayerScatter) {
  TOWERS_SKIP_WITHOUT_GPU();
  Stream st;
  uint64_t seed = 30;
  for (const ConvCase& k : kCases)
    for (bool relu : {false, true}) {
      SCOPED_TRACE(k.name + (relu ? " relu" : ""));
      const int64_t n = k.n, co = k.co, P = geometry(k).out_pixels(), cols = n * P;
      const std::vector<float> out = random_floats(co * cols, ++seed);  // (co, n * P)
      const std::vector<float> bias = random_floats(co, ++seed);
      const std::vector<float> want = testing::conv_output_reference(n, co, P, out, bias, relu);
      DeviceArray<float> out_d(out), bias_d(bias), y_d(n * co * P);
      kernels::cuda::conv_output(st.s, n, co, P, out_d.get(), bias_d.get(), relu, y_d.get());
      EXPECT_EQ(max_rel_error(y_d.download(), want), 0.0);  // one float add: exact
    }
}

TEST(ConvGpu, GradOutputMatchesLayerMasking) {
  TOWERS_SKIP_WITHOUT_GPU();
  Stream st;
  uint64_t seed = 40;
  for (const ConvCase& k : kCases)
    for (bool relu : {false, true}) {
      SCOPED_TRACE(k.name + (relu ? " relu" : ""));
      const int64_t n = k.n, co = k.co, P = geometry(k).out_pixels(), cols = n * P;
      std::vector<float> y = random_floats(n * co * P, ++seed);  // (n, co, P)
      for (float& v : y) v = std::max(v, 0.0f);                  // a ReLU output: half zeros
      const std::vector<float> dy = random_floats(n * co * P, ++seed);
      std::vector<float> want, db_want;  // (co, n * P), (co); the whole batch as one chunk
      testing::conv_grad_output_reference(n, co, P, y, dy, relu, want, db_want);
      DeviceArray<float> y_d(y), dy_d(dy), g_d(co * cols), db_d(co);
      DeviceArray<double> partials(kernels::cuda::bias_grad_partials(1, co, cols));
      kernels::cuda::conv_grad_output(st.s, n, co, P, y_d.get(), dy_d.get(), relu, g_d.get(),
                                      db_d.get(), partials.get());
      EXPECT_EQ(max_rel_error(g_d.download(), want), 0.0);  // a select: exact
      const std::vector<float> db = db_d.download();
      const double err = max_rel_error(db, db_want);  // double sums in another order
      EXPECT_LT(err, 1e-5);
      // Deterministic: a second run gives the same bits.
      kernels::cuda::conv_grad_output(st.s, n, co, P, y_d.get(), dy_d.get(), relu, g_d.get(),
                                      db_d.get(), partials.get());
      EXPECT_EQ(max_rel_error(db_d.download(), db), 0.0);
    }
}

}  // namespace
}  // namespace towers
