// The per-element rules of the CUDA conv, pool, LRN and bias kernels (kernels/cuda/*_rules.h),
// run on the host over every index (a simulated launch) and compared with the CPU twins. The
// GPU kernels are grid-stride loops over these same rules, so this suite checks their index
// arithmetic and formulas on machines without a GPU. Shapes are chosen to be awkward: odd
// sizes, strides of 2 and 3, SAME padding with an extra pad after, VALID windows that leave
// inputs unread, rows and columns with different windows, several images side by side.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "conv_reference.h"
#include "core/rng.h"
#include "kernels/bias.h"
#include "kernels/conv.h"
#include "kernels/cuda/bias_rules.h"
#include "kernels/cuda/conv_rules.h"
#include "kernels/cuda/lrn_rules.h"
#include "kernels/cuda/pool_rules.h"
#include "kernels/lrn.h"
#include "kernels/pool.h"

namespace towers {
namespace {

namespace kc = kernels::cuda;
using kernels::ConvGeometry;
using kernels::Padding;
using kernels::Window;

const float kNaN = std::numeric_limits<float>::quiet_NaN();

std::vector<float> random_floats(int64_t n, uint64_t seed, float lo = -1.0f, float hi = 1.0f) {
  Rng rng(seed);
  std::vector<float> v(n);
  for (float& x : v) x = rng.uniform(lo, hi);
  return v;
}

// Small integers: ties inside pooling windows, and inputs that are the maximum of several
// overlapping windows, become common.
std::vector<float> random_ints(int64_t n, uint64_t seed, int64_t levels) {
  Rng rng(seed);
  std::vector<float> v(n);
  for (float& x : v) x = static_cast<float>(static_cast<int64_t>(rng.below(levels)) - levels / 2);
  return v;
}

// Bitwise-equal values (0 and -0 compare equal); a failure names the first difference and the
// count rather than printing whole arrays.
::testing::AssertionResult same_floats(const std::vector<float>& got,
                                       const std::vector<float>& want) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure() << "sizes " << got.size() << " vs " << want.size();
  int64_t bad = 0, first = -1;
  for (size_t i = 0; i < got.size(); ++i)
    if (!(got[i] == want[i]) && ++bad == 1) first = static_cast<int64_t>(i);
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << got.size() << " differ; first at "
                                       << first << ": " << got[first] << " vs " << want[first];
}

// Largest |got - want| / max(|want|, floor), the GPU tests' measure.
double max_rel_error(const std::vector<float>& got, const std::vector<float>& want,
                     double floor = 1e-3) {
  EXPECT_EQ(got.size(), want.size());
  double worst = 0.0;
  for (size_t i = 0; i < std::min(got.size(), want.size()); ++i) {
    if (std::isnan(got[i]) || std::isnan(want[i])) return INFINITY;
    const double d = std::fabs(static_cast<double>(got[i]) - want[i]);
    worst = std::max(worst, d / std::max(std::fabs(static_cast<double>(want[i])), floor));
  }
  return worst;
}

// ---- convolution ---------------------------------------------------------------------------

struct ConvCase {
  int64_t c, h, w;
  int64_t kh, sh;
  Padding ph;
  int64_t kw, sw;
  Padding pw;
  int64_t n;
};

std::string describe(const ConvCase& k) {
  auto pad = [](Padding p) { return p == Padding::Same ? "SAME" : "VALID"; };
  return std::to_string(k.n) + "x" + std::to_string(k.c) + "x" + std::to_string(k.h) + "x" +
         std::to_string(k.w) + " rows k" + std::to_string(k.kh) + "/" + std::to_string(k.sh) + " " +
         pad(k.ph) + " cols k" + std::to_string(k.kw) + "/" + std::to_string(k.sw) + " " +
         pad(k.pw);
}

ConvGeometry geometry(const ConvCase& k) {
  ConvGeometry g;
  g.channels = k.c;
  g.height = k.h;
  g.width = k.w;
  g.rows = kernels::make_window(k.h, k.kh, k.sh, k.ph);
  g.cols = kernels::make_window(k.w, k.kw, k.sw, k.pw);
  return g;
}

const std::vector<ConvCase>& conv_cases() {
  static const std::vector<ConvCase> cases = {
      {3, 7, 9, 3, 2, Padding::Same, 3, 2, Padding::Same, 3},    // odd sizes, stride 2
      {2, 8, 5, 3, 2, Padding::Valid, 3, 2, Padding::Valid, 3},  // VALID leaves inputs unread
      {3, 6, 6, 5, 1, Padding::Same, 5, 1, Padding::Same, 3},    // k5 SAME, as conv1/conv2
      {2, 5, 7, 2, 2, Padding::Same, 2, 2, Padding::Same, 3},    // even k: nothing padded
      {2, 6, 7, 4, 1, Padding::Same, 4, 1, Padding::Same, 3},    // even k: the extra pad after
      {2, 8, 7, 2, 3, Padding::Valid, 2, 3, Padding::Valid, 3},  // stride > k: gaps
      {3, 5, 8, 3, 1, Padding::Same, 2, 2, Padding::Valid, 3},   // rows and cols differ
      {1, 1, 1, 1, 1, Padding::Valid, 1, 1, Padding::Valid, 3},  // 1x1
      {2, 3, 4, 5, 2, Padding::Same, 5, 3, Padding::Same, 3},    // window wider than the input
  };
  return cases;
}

TEST(ConvRules, Im2colMatchesCpuTwinPerImage) {
  uint64_t seed = 100;
  for (const ConvCase& k : conv_cases()) {
    SCOPED_TRACE(describe(k));
    const ConvGeometry g = geometry(k);
    const int64_t n = k.n, chw = k.c * k.h * k.w, P = g.out_pixels(), ld = n * P;
    const std::vector<float> x = random_floats(n * chw, ++seed);               // (n, C, H, W)
    std::vector<float> want(g.patch() * ld, kNaN), got(g.patch() * ld, kNaN);  // (patch, n * P)
    for (int64_t i = 0; i < n; ++i)
      kernels::cpu::im2col(g, x.data() + i * chw, want.data() + i * P, ld);
    for (int64_t idx = 0; idx < g.patch() * ld; ++idx)
      got[idx] = kc::im2col_at(g, n, x.data(), idx);
    EXPECT_TRUE(same_floats(got, want));
    for (int32_t idx = 0; idx < g.patch() * ld; ++idx)  // the kernels' 32-bit instantiation
      got[idx] = kc::im2col_at<int32_t>(g, static_cast<int32_t>(n), x.data(), idx);
    EXPECT_TRUE(same_floats(got, want)) << "32-bit indices";
  }
}

TEST(ConvRules, Col2imMatchesCpuTwinPerImage) {
  uint64_t seed = 200;
  for (const ConvCase& k : conv_cases()) {
    SCOPED_TRACE(describe(k));
    const ConvGeometry g = geometry(k);
    const int64_t n = k.n, chw = k.c * k.h * k.w, P = g.out_pixels(), ld = n * P;
    const std::vector<float> col = random_floats(g.patch() * ld, ++seed);  // (patch, n * P)
    std::vector<float> want(n * chw, kNaN), got(n * chw, kNaN);            // (n, C, H, W)
    for (int64_t i = 0; i < n; ++i)
      kernels::cpu::col2im(g, col.data() + i * P, ld, want.data() + i * chw);
    for (int64_t idx = 0; idx < n * chw; ++idx) got[idx] = kc::col2im_at(g, n, col.data(), idx);
    EXPECT_TRUE(same_floats(got, want));  // same additions in the same order
    for (int32_t idx = 0; idx < n * chw; ++idx)
      got[idx] = kc::col2im_at<int32_t>(g, static_cast<int32_t>(n), col.data(), idx);
    EXPECT_TRUE(same_floats(got, want)) << "32-bit indices";
  }
}

// (n, co, P) shapes for the element-wise kernels around the GEMM.
struct OutCase {
  int64_t n, co, p;
};
const std::vector<OutCase> kOutCases = {{3, 5, 7}, {3, 1, 1}, {1, 4, 9}, {3, 7, 20}};

TEST(ConvRules, OutputMatchesLayerScatter) {
  uint64_t seed = 300;
  for (const OutCase& k : kOutCases)
    for (bool relu : {false, true}) {
      SCOPED_TRACE(std::to_string(k.n) + "x" + std::to_string(k.co) + "x" + std::to_string(k.p) +
                   (relu ? " relu" : ""));
      const int64_t n = k.n, co = k.co, P = k.p, cols = n * P;
      const std::vector<float> out = random_floats(co * cols, ++seed);  // (co, n * P)
      const std::vector<float> bias = random_floats(co, ++seed);
      const std::vector<float> want = testing::conv_output_reference(n, co, P, out, bias, relu);
      std::vector<float> got(n * co * P, kNaN);  // (n, co, P)
      for (int64_t idx = 0; idx < n * co * P; ++idx)
        got[idx] = kc::conv_output_at(n, co, P, out.data(), bias.data(), relu, idx);
      EXPECT_TRUE(same_floats(got, want));
      for (int32_t idx = 0; idx < n * co * P; ++idx)
        got[idx] = kc::conv_output_at<int32_t>(static_cast<int32_t>(n), static_cast<int32_t>(co),
                                               static_cast<int32_t>(P), out.data(), bias.data(),
                                               relu, idx);
      EXPECT_TRUE(same_floats(got, want)) << "32-bit indices";
    }
}

// The block reduction of bias_grad simulated on the host: each of `threads` threads sums its
// share with the rule, then the partials are added pairwise (the GPU's tree has another shape,
// so sums are compared to a tolerance; with threads = 1 it is the CPU twin's order exactly).
double simulated_channel_sum(int64_t n, int64_t c, int64_t hw, const float* dy, int64_t ch,
                             int64_t threads) {
  std::vector<double> part(threads);
  for (int64_t t = 0; t < threads; ++t)
    part[t] = kc::bias_grad_partial(n, c, hw, dy, ch, t, threads);
  for (int64_t width = 1; width < threads; width *= 2)
    for (int64_t t = 0; t + width < threads; t += 2 * width) part[t] += part[t + width];
  return part[0];
}

TEST(ConvRules, GradOutputMatchesLayerMasking) {
  uint64_t seed = 400;
  for (const OutCase& k : kOutCases)
    for (bool relu : {false, true}) {
      SCOPED_TRACE(std::to_string(k.n) + "x" + std::to_string(k.co) + "x" + std::to_string(k.p) +
                   (relu ? " relu" : ""));
      const int64_t n = k.n, co = k.co, P = k.p, cols = n * P;
      std::vector<float> y = random_ints(n * co * P, ++seed, 5);  // (n, co, P); zeros are masked
      for (float& v : y) v *= 0.25f;
      const std::vector<float> dy = random_floats(n * co * P, ++seed);
      std::vector<float> want, db_want;  // (co, n * P), (co)
      testing::conv_grad_output_reference(n, co, P, y, dy, relu, want, db_want);
      std::vector<float> got(co * cols, kNaN);
      for (int32_t idx = 0; idx < co * cols; ++idx)  // the kernels' 32-bit instantiation
        got[idx] = kc::conv_grad_output_at<int32_t>(static_cast<int32_t>(n),
                                                    static_cast<int32_t>(co),
                                                    static_cast<int32_t>(P), y.data(), dy.data(),
                                                    relu, idx);
      EXPECT_TRUE(same_floats(got, want)) << "32-bit indices";
      for (int64_t idx = 0; idx < co * cols; ++idx)
        got[idx] = kc::conv_grad_output_at(n, co, P, y.data(), dy.data(), relu, idx);
      EXPECT_TRUE(same_floats(got, want));
      // db is bias_grad over g read as (1, co, n * P).
      std::vector<float> db(co);
      for (int64_t c = 0; c < co; ++c)
        db[c] = kc::bias_grad_finish(simulated_channel_sum(1, co, cols, got.data(), c, 256), 0.0f,
                                     false);
      EXPECT_LT(max_rel_error(db, db_want), 1e-6);
    }
}

// ---- max-pooling ---------------------------------------------------------------------------

struct PoolCase {
  int64_t planes, h, w;
  int64_t kh, sh;
  Padding ph;
  int64_t kw, sw;
  Padding pw;
};

std::string describe(const PoolCase& k) {
  auto pad = [](Padding p) { return p == Padding::Same ? "SAME" : "VALID"; };
  return std::to_string(k.planes) + "x" + std::to_string(k.h) + "x" + std::to_string(k.w) +
         " rows k" + std::to_string(k.kh) + "/" + std::to_string(k.sh) + " " + pad(k.ph) +
         " cols k" + std::to_string(k.kw) + "/" + std::to_string(k.sw) + " " + pad(k.pw);
}

const std::vector<PoolCase> kPoolCases = {
    {6, 9, 7, 3, 2, Padding::Same, 3, 2, Padding::Same},    // the nets' 3x3/2 SAME, odd sizes
    {6, 8, 8, 3, 2, Padding::Same, 3, 2, Padding::Same},    // even sizes: the extra pad after
    {4, 8, 9, 3, 2, Padding::Valid, 3, 2, Padding::Valid},  // VALID: the last input unread
    {3, 7, 5, 3, 1, Padding::Same, 3, 1, Padding::Same},    // stride 1: heavy overlap
    {3, 5, 6, 2, 2, Padding::Same, 2, 2, Padding::Same},    // no overlap
    {2, 6, 9, 4, 3, Padding::Same, 2, 1, Padding::Valid},   // rows and cols differ
    {2, 2, 3, 5, 2, Padding::Same, 5, 2, Padding::Same},    // window wider than the plane
    {2, 1, 1, 1, 1, Padding::Valid, 1, 1, Padding::Valid},  // 1x1
    // Rows of 4 or more windows inside the plane (the CPU twin's vector paths, where it has
    // them: 8 or 4 outputs at a time, the last block overlapping): cifar10's pool1 and pool2,
    // fashion's pool2, resnet-small's pool1, odd and VALID widths.
    {3, 24, 24, 3, 2, Padding::Same, 3, 2, Padding::Same},
    {3, 12, 12, 3, 2, Padding::Same, 3, 2, Padding::Same},
    {2, 14, 14, 3, 2, Padding::Same, 3, 2, Padding::Same},
    {2, 28, 28, 2, 2, Padding::Same, 2, 2, Padding::Same},
    {2, 11, 41, 3, 2, Padding::Valid, 3, 2, Padding::Valid},
    {2, 9, 39, 3, 1, Padding::Same, 5, 2, Padding::Same},
};

struct PoolRun {
  std::vector<float> x, y, argmax;
};

// x, then y and argmax from the forward rule, with its CPU twin's result beside it.
void pool_forward_both(const PoolCase& k, const Window& rows, const Window& cols,
                       const std::vector<float>& x, PoolRun& got, PoolRun& want) {
  const int64_t n_out = k.planes * rows.out * cols.out;
  want.y.assign(n_out, kNaN);
  want.argmax.assign(n_out, kNaN);
  got.y.assign(n_out, kNaN);
  got.argmax.assign(n_out, kNaN);
  kernels::cpu::maxpool_forward(k.planes, k.h, k.w, rows, cols, x.data(), want.y.data(),
                                want.argmax.data());
  const kc::PoolShape<int64_t> wide(rows, cols, k.h, k.w);
  const kc::PoolShape<int32_t> narrow(rows, cols, k.h, k.w);
  for (int64_t idx = 0; idx < n_out; ++idx) {
    int64_t at = -1;
    kc::maxpool_at(wide, x.data(), idx, got.y[idx], at);
    got.argmax[idx] = static_cast<float>(at);
  }
  // The kernels' 32-bit instantiation gives the same.
  for (int32_t idx = 0; idx < n_out; ++idx) {
    int32_t at = -1;
    float y = kNaN;
    kc::maxpool_at<int32_t>(narrow, x.data(), idx, y, at);
    EXPECT_TRUE(y == got.y[idx] && static_cast<float>(at) == got.argmax[idx])
        << "32-bit indices, output " << idx;
  }
}

TEST(PoolRules, ForwardMatchesCpuTwin) {
  uint64_t seed = 500;
  for (const PoolCase& k : kPoolCases)
    for (bool ties : {false, true}) {
      SCOPED_TRACE(describe(k) + (ties ? " with ties" : ""));
      const Window rows = kernels::make_window(k.h, k.kh, k.sh, k.ph);
      const Window cols = kernels::make_window(k.w, k.kw, k.sw, k.pw);
      const int64_t n_in = k.planes * k.h * k.w;
      // All-negative inputs check that padding never wins.
      const std::vector<float> x =
          ties ? random_ints(n_in, ++seed, 3) : random_floats(n_in, ++seed, -2.0f, -1.0f);
      PoolRun got, want;
      pool_forward_both(k, rows, cols, x, got, want);
      EXPECT_TRUE(same_floats(got.y, want.y));
      EXPECT_TRUE(same_floats(got.argmax, want.argmax));
    }
}

TEST(PoolRules, BackwardGatherMatchesCpuScatter) {
  uint64_t seed = 600;
  for (const PoolCase& k : kPoolCases)
    for (bool ties : {false, true}) {
      SCOPED_TRACE(describe(k) + (ties ? " with ties" : ""));
      const Window rows = kernels::make_window(k.h, k.kh, k.sh, k.ph);
      const Window cols = kernels::make_window(k.w, k.kw, k.sw, k.pw);
      const int64_t n_in = k.planes * k.h * k.w, n_out = k.planes * rows.out * cols.out;
      // With ties one input is the argmax of several windows, and their dy are summed.
      const std::vector<float> x =
          ties ? random_ints(n_in, ++seed, 3) : random_floats(n_in, ++seed);
      std::vector<float> argmax(n_out), y(n_out);
      kernels::cpu::maxpool_forward(k.planes, k.h, k.w, rows, cols, x.data(), y.data(),
                                    argmax.data());
      const std::vector<float> dy = random_floats(n_out, ++seed);
      std::vector<float> want(n_in, kNaN), got(n_in, kNaN);
      kernels::cpu::maxpool_backward(k.planes, k.h, k.w, rows, cols, argmax.data(), dy.data(),
                                     want.data());
      const kc::PoolShape<int64_t> wide(rows, cols, k.h, k.w);
      const kc::PoolShape<int32_t> narrow(rows, cols, k.h, k.w);
      for (int64_t idx = 0; idx < n_in; ++idx)
        got[idx] = kc::maxpool_backward_at(wide, argmax.data(), dy.data(), idx);
      // The gather adds each input's windows in the scatter's (row-major) order: exact.
      EXPECT_TRUE(same_floats(got, want));
      for (int32_t idx = 0; idx < n_in; ++idx)
        got[idx] = kc::maxpool_backward_at<int32_t>(narrow, argmax.data(), dy.data(), idx);
      EXPECT_TRUE(same_floats(got, want)) << "32-bit indices";
    }
}

// ---- LRN -----------------------------------------------------------------------------------

struct LrnCase {
  int64_t n, c, hw;
  kernels::LrnParams p;
};

std::string describe(const LrnCase& k) {
  return std::to_string(k.n) + "x" + std::to_string(k.c) + "x" + std::to_string(k.hw) + " r" +
         std::to_string(k.p.depth_radius) + " bias " + std::to_string(k.p.bias) + " alpha " +
         std::to_string(k.p.alpha) + " beta " + std::to_string(k.p.beta);
}

const std::vector<LrnCase> kLrnCases = {
    {3, 64, 6, {4, 1.0f, 0.001f / 9.0f, 0.75f}},  // the CIFAR-10 net's norm1/norm2
    {3, 7, 5, {2, 1.0f, 0.5f, 0.75f}},            // strong normalisation
    {3, 5, 7, {4, 2.0f, 0.3f, 0.5f}},             // window wider than the channels, sqrt path
    {2, 6, 3, {1, 1.5f, 0.2f, 0.6f}},             // powf path
    {3, 9, 4, {0, 1.0f, 1.0f, 0.75f}},            // radius 0: the channel alone
    {2, 1, 5, {3, 1.0f, 0.7f, 0.75f}},            // one channel
    {2, 20, 3, {3, 1.0f, 0.4f, 0.75f}},           // chunks of 8, 8 and 4 channels
    {2, 13, 5, {4, 1.0f, 0.3f, 0.75f}},           // the net's radius, a short last chunk
    {2, 13, 4, {6, 1.0f, 0.2f, 0.75f}},           // a radius past the chunked kernels' 4
};

// The per-element rules over every element, in the kernels' 64-bit and 32-bit instantiations
// (which must agree bitwise); then, where the chunked kernels take the radius, the chunked
// rules over every thread, which must give the per-element rules' floats bit for bit.
void lrn_forward_rules(const LrnCase& k, const std::vector<float>& x, std::vector<float>& y,
                       std::vector<float>& s) {
  const int64_t count = k.n * k.c * k.hw;
  y.assign(count, kNaN);
  s.assign(count, kNaN);
  const kc::LrnShape<int64_t> wide(k.p, k.c, k.hw);
  const kc::LrnShape<int32_t> narrow(k.p, k.c, k.hw);
  for (int64_t idx = 0; idx < count; ++idx) kc::lrn_forward_at(k.p, wide, x.data(), idx, y[idx], s[idx]);
  std::vector<float> y32(count, kNaN), s32(count, kNaN);
  for (int32_t idx = 0; idx < count; ++idx)
    kc::lrn_forward_at<int32_t>(k.p, narrow, x.data(), idx, y32[idx], s32[idx]);
  EXPECT_TRUE(same_floats(y32, y) && same_floats(s32, s)) << "32-bit indices";
  if (!kc::lrn_chunked(k.p)) return;
  const int64_t threads = kc::LrnShape<int64_t>::chunk_threads(k.n, k.c, k.hw);
  std::vector<float> yc(count, kNaN), sc(count, kNaN);
  for (int64_t t = 0; t < threads; ++t)
    kc::lrn_forward_chunk<int64_t>(k.p, wide, x.data(), yc.data(), sc.data(), t);
  EXPECT_TRUE(same_floats(yc, y) && same_floats(sc, s)) << "chunked";
  std::fill(yc.begin(), yc.end(), kNaN);
  std::fill(sc.begin(), sc.end(), kNaN);
  for (int32_t t = 0; t < threads; ++t)
    kc::lrn_forward_chunk<int32_t>(k.p, narrow, x.data(), yc.data(), sc.data(), t);
  EXPECT_TRUE(same_floats(yc, y) && same_floats(sc, s)) << "chunked, 32-bit indices";
}

std::vector<float> lrn_backward_rules(const LrnCase& k, const std::vector<float>& x,
                                      const std::vector<float>& y, const std::vector<float>& scale,
                                      const std::vector<float>& dy) {
  const int64_t count = k.n * k.c * k.hw;
  const kc::LrnShape<int64_t> wide(k.p, k.c, k.hw);
  const kc::LrnShape<int32_t> narrow(k.p, k.c, k.hw);
  std::vector<float> got(count, kNaN), got32(count, kNaN);
  for (int64_t idx = 0; idx < count; ++idx)
    got[idx] = kc::lrn_backward_at(k.p, wide, x.data(), y.data(), scale.data(), dy.data(), idx);
  for (int32_t idx = 0; idx < count; ++idx)
    got32[idx] = kc::lrn_backward_at<int32_t>(k.p, narrow, x.data(), y.data(), scale.data(),
                                              dy.data(), idx);
  EXPECT_TRUE(same_floats(got32, got)) << "32-bit indices";
  if (!kc::lrn_chunked(k.p)) return got;
  const int64_t threads = kc::LrnShape<int64_t>::chunk_threads(k.n, k.c, k.hw);
  std::vector<float> chunked(count, kNaN);
  for (int64_t t = 0; t < threads; ++t)
    kc::lrn_backward_chunk<int64_t>(k.p, wide, x.data(), y.data(), scale.data(), dy.data(),
                                    chunked.data(), t);
  EXPECT_TRUE(same_floats(chunked, got)) << "chunked";
  std::fill(chunked.begin(), chunked.end(), kNaN);
  for (int32_t t = 0; t < threads; ++t)
    kc::lrn_backward_chunk<int32_t>(k.p, narrow, x.data(), y.data(), scale.data(), dy.data(),
                                    chunked.data(), t);
  EXPECT_TRUE(same_floats(chunked, got)) << "chunked, 32-bit indices";
  return got;
}

TEST(LrnRules, ForwardMatchesCpuTwin) {
  uint64_t seed = 700;
  for (const LrnCase& k : kLrnCases) {
    SCOPED_TRACE(describe(k));
    const int64_t count = k.n * k.c * k.hw;
    const std::vector<float> x = random_floats(count, ++seed, -2.0f, 2.0f);  // (n, C, HW)
    std::vector<float> y_want(count), s_want(count), y, s;
    kernels::cpu::lrn_forward(k.p, k.n, k.c, k.hw, x.data(), y_want.data(), s_want.data());
    lrn_forward_rules(k, x, y, s);
    EXPECT_LT(max_rel_error(y, y_want), 1e-5);
    EXPECT_LT(max_rel_error(s, s_want), 1e-5);
  }
}

TEST(LrnRules, BackwardMatchesCpuTwin) {
  uint64_t seed = 800;
  for (const LrnCase& k : kLrnCases) {
    SCOPED_TRACE(describe(k));
    const int64_t count = k.n * k.c * k.hw;
    const std::vector<float> x = random_floats(count, ++seed, -2.0f, 2.0f);
    const std::vector<float> dy = random_floats(count, ++seed);
    std::vector<float> y(count), scale(count), want(count);
    kernels::cpu::lrn_forward(k.p, k.n, k.c, k.hw, x.data(), y.data(), scale.data());
    kernels::cpu::lrn_backward(k.p, k.n, k.c, k.hw, x.data(), y.data(), scale.data(), dy.data(),
                               want.data());
    const std::vector<float> got = lrn_backward_rules(k, x, y, scale, dy);
    // dx is the sum of two terms of order 1 that can cancel, and the CPU twin may be compiled
    // with fma contraction: its error is measured against that order (floor 0.1).
    EXPECT_LT(max_rel_error(got, want, 0.1), 1e-5);
  }
}

// ---- bias ----------------------------------------------------------------------------------

struct BiasCase {
  int64_t n, c, hw;
};
const std::vector<BiasCase> kBiasCases = {{3, 5, 7}, {4, 10, 1}, {1, 3, 300}, {3, 64, 36}};

std::string describe(const BiasCase& k) {
  return std::to_string(k.n) + "x" + std::to_string(k.c) + "x" + std::to_string(k.hw);
}

TEST(BiasRules, AddMatchesCpuTwin) {
  uint64_t seed = 900;
  for (const BiasCase& k : kBiasCases)
    for (bool relu : {false, true}) {
      SCOPED_TRACE(describe(k) + (relu ? " relu" : ""));
      const int64_t count = k.n * k.c * k.hw;
      const std::vector<float> y0 = random_floats(count, ++seed);
      const std::vector<float> bias = random_floats(k.c, ++seed);
      std::vector<float> want = y0, got = y0;
      kernels::cpu::bias_add(k.n, k.c, k.hw, bias.data(), want.data());
      if (relu)
        for (float& v : want) v = std::max(v, 0.0f);  // as the CPU layers apply it
      for (int64_t idx = 0; idx < count; ++idx)
        got[idx] = kc::bias_add_at(kc::Divisor<int64_t>(k.c), kc::Divisor<int64_t>(k.hw),
                                   bias.data(), y0.data(), relu, idx);
      EXPECT_TRUE(same_floats(got, want));
      for (int32_t idx = 0; idx < count; ++idx)  // the kernels' 32-bit instantiation
        got[idx] = kc::bias_add_at<int32_t>(kc::Divisor<int32_t>(static_cast<int32_t>(k.c)),
                                            kc::Divisor<int32_t>(static_cast<int32_t>(k.hw)),
                                            bias.data(), y0.data(), relu, idx);
      EXPECT_TRUE(same_floats(got, want)) << "32-bit indices";
    }
}

TEST(BiasRules, GradMatchesCpuTwin) {
  uint64_t seed = 1000;
  for (const BiasCase& k : kBiasCases)
    for (bool accumulate : {false, true})
      for (int64_t threads : {1, 7, 256}) {
        SCOPED_TRACE(describe(k) + (accumulate ? " accumulate" : "") + " threads " +
                     std::to_string(threads));
        const std::vector<float> dy = random_floats(k.n * k.c * k.hw, ++seed);
        const std::vector<float> db0 = random_floats(k.c, ++seed);
        std::vector<float> want = db0, got = db0;
        kernels::cpu::bias_grad(k.n, k.c, k.hw, dy.data(), want.data(), accumulate);
        for (int64_t ch = 0; ch < k.c; ++ch)
          got[ch] = kc::bias_grad_finish(
              simulated_channel_sum(k.n, k.c, k.hw, dy.data(), ch, threads), db0[ch], accumulate);
        if (threads == 1)
          EXPECT_TRUE(same_floats(got, want));  // one thread adds in the CPU twin's order
        else
          EXPECT_LT(max_rel_error(got, want), 1e-6);
        // The kernels' 32-bit instantiation takes the very same partials.
        for (int32_t ch = 0; ch < k.c; ++ch)
          for (int32_t t = 0; t < threads; ++t) {
            const auto n = static_cast<int32_t>(k.n), c = static_cast<int32_t>(k.c),
                       hw = static_cast<int32_t>(k.hw), th = static_cast<int32_t>(threads);
            EXPECT_EQ(kc::bias_grad_partial<int32_t>(n, c, hw, dy.data(), ch, t, th),
                      kc::bias_grad_partial(k.n, k.c, k.hw, dy.data(), int64_t{ch}, int64_t{t},
                                            threads))
                << "32-bit indices, channel " << ch << " thread " << t;
          }
      }
}

// A channel's terms split into segments (kernels/bias.h): how many, and that the segments
// cover every term once, in order, so that their sums added in order are the channel's sum
// (to the tolerance of another order of double additions).
TEST(BiasRules, SegmentsCoverEveryTermOnce) {
  EXPECT_EQ(kc::bias_grad_segments(64, 128 * 576), 8);  // the CIFAR-10 net's conv1, batch 128
  EXPECT_EQ(kc::bias_grad_segments(384, 128), 1);       // a dense layer: one block per channel
  EXPECT_EQ(kc::bias_grad_segments(3, 320000), 64);     // capped
  EXPECT_EQ(kc::bias_grad_segments(64, 4095), 1);       // too few terms to split
  EXPECT_EQ(kc::bias_grad_segments(64, 4096), 2);
  EXPECT_EQ(kc::bias_grad_partials(128, 384, 1), 0);
  EXPECT_EQ(kc::bias_grad_partials(128, 64, 576), 64 * 8);
  for (int64_t terms : {1, 7, 2049, 4608, 73728})
    for (int64_t k : {1, 2, 3, 8, 64}) {
      int64_t next = 0;
      for (int64_t j = 0; j < k; ++j) {
        int64_t lo, hi;
        kc::bias_grad_segment<int64_t>(terms, k, j, lo, hi);
        EXPECT_EQ(lo, next) << terms << " terms, segment " << j << " of " << k;
        EXPECT_LE(lo, hi);
        next = hi;
      }
      EXPECT_EQ(next, terms) << terms << " terms in " << k << " segments";
    }
  uint64_t seed = 1100;
  for (const BiasCase& k : {BiasCase{3, 5, 1500}, BiasCase{32, 64, 144}}) {
    SCOPED_TRACE(describe(k));
    const std::vector<float> dy = random_floats(k.n * k.c * k.hw, ++seed);
    std::vector<float> want(k.c), got(k.c);
    kernels::cpu::bias_grad(k.n, k.c, k.hw, dy.data(), want.data(), false);
    const int64_t terms = k.n * k.hw, segments = kc::bias_grad_segments(k.c, terms);
    EXPECT_GT(segments, 1);
    for (int64_t ch = 0; ch < k.c; ++ch) {
      double total = 0.0;
      for (int64_t j = 0; j < segments; ++j) {
        int64_t lo, hi;
        kc::bias_grad_segment<int64_t>(terms, segments, j, lo, hi);
        for (int64_t t = 0; t < 256; ++t)
          total += kc::bias_grad_segment_partial<int64_t>(k.c, k.hw, dy.data(), ch, lo, hi, t, 256);
      }
      got[ch] = kc::bias_grad_finish(total, 0.0f, false);
    }
    EXPECT_LT(max_rel_error(got, want), 1e-6);
  }
}

}  // namespace
}  // namespace towers
