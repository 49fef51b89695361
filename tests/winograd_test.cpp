// Winograd convolution (kernels/winograd.h) against the direct sums in double: the forward,
// the weight gradient and the input gradient of F(2x2, 5x5) and F(4x4, 3x3), on tile-aligned
// and ragged planes.
//
// The bound is normwise, as Winograd's error analyses are: the transforms mix a whole tile, so
// an output whose direct terms are all zero (a tap that only meets padding) still carries
// the rounding of its neighbours. For each tensor, the largest |error| is held to
// kFactor * eps * the largest sum of |terms| of any of its outputs' direct sums. A float sum's
// own error is about len * eps * sum |terms|; the transforms add a constant factor (their
// entries reach 16/15 and 8 and mix alpha^2 products). The ratios seen are printed (about 1
// to 15 on the cases below); a wrong coefficient or index gives errors of the order of the
// outputs themselves, millions of times over the bound.
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/check.h"
#include "core/rng.h"
#include "kernels/conv.h"
#include "kernels/winograd.h"
#include "layers/conv2d.h"

namespace towers {
namespace {

namespace kc = kernels::cpu;

constexpr double kEps = std::numeric_limits<float>::epsilon();
constexpr double kFactor = 64.0;

std::vector<float> normal(int64_t n, uint64_t seed) {
  Rng rng(seed);
  std::vector<float> v(n);
  for (float& e : v) e = static_cast<float>(rng.normal());
  return v;
}

struct Case {
  int r;
  int64_t ci, co, h, w, images;
};

std::string name(const Case& c) {
  return "k" + std::to_string(c.r) + "_" + std::to_string(c.ci) + "to" + std::to_string(c.co) +
         "_" + std::to_string(c.h) + "x" + std::to_string(c.w) + "_n" + std::to_string(c.images);
}

kc::WinogradShape shape_of(const Case& c) {
  return kc::winograd_shape(c.r, 1, kernels::Padding::Same, c.h, c.w);
}

// Largest |got - want| over a tensor, and where, against eps * its largest sum of |terms|.
struct Worst {
  double error = 0.0, scale = 0.0;
  int64_t at = -1;
  void see(double got, double want, double mag, int64_t i) {
    const double e = std::isfinite(got) ? std::fabs(got - want) : INFINITY;
    if (e > error || at < 0) error = e, at = i;
    scale = std::max(scale, mag);
  }
  double ratio() const { return error / (kEps * scale); }
};

class WinogradTest : public ::testing::TestWithParam<Case> {};

TEST_P(WinogradTest, ForwardAndGradientsAreTheDirectSumsWithinTheBound) {
  const Case c = GetParam();
  const kc::WinogradShape s = shape_of(c);
  ASSERT_EQ(s.r, c.r);
  ASSERT_EQ(s.m, c.r == 5 ? 2 : 4);
  const int64_t n = c.images, H = c.h, W = c.w, R = c.r, P = (c.r - 1) / 2;
  const int64_t pos = s.positions();
  const auto x = normal(n * c.ci * H * W, 1), w = normal(c.co * c.ci * R * R, 2),
             bias = normal(c.co, 3), g = normal(n * c.co * H * W, 4);
  std::vector<float> u(pos * c.co * c.ci), ut(u.size()), y(g.size()), dw(w.size()), dx(x.size());
  kc::winograd_weights(s, c.co, c.ci, w.data(), false, u.data());
  kc::winograd_weights(s, c.co, c.ci, w.data(), true, ut.data());
  kc::winograd_forward(s, c.co, c.ci, n, u.data(), x.data(), bias.data(), false, y.data());
  kc::winograd_backward(s, c.co, c.ci, n, ut.data(), x.data(), g.data(), dw.data(), dx.data());

  auto X = [&](int64_t i, int64_t ch, int64_t yy, int64_t xx) -> double {
    if (yy < 0 || yy >= H || xx < 0 || xx >= W) return 0.0;
    return x[((i * c.ci + ch) * H + yy) * W + xx];
  };
  auto Wt = [&](int64_t o, int64_t ch, int64_t ky, int64_t kx) -> double {
    return w[((o * c.ci + ch) * R + ky) * R + kx];
  };
  auto G = [&](int64_t i, int64_t o, int64_t yy, int64_t xx) -> double {
    if (yy < 0 || yy >= H || xx < 0 || xx >= W) return 0.0;
    return g[((i * c.co + o) * H + yy) * W + xx];
  };
  Worst fy, fdw, fdx;
  // y[i][o][yy][xx] = bias[o] + sum w[o][ch][ky][kx] x[i][ch][yy + ky - P][xx + kx - P]
  for (int64_t i = 0; i < n; ++i)
    for (int64_t o = 0; o < c.co; ++o)
      for (int64_t yy = 0; yy < H; ++yy)
        for (int64_t xx = 0; xx < W; ++xx) {
          double sum = bias[o], mag = std::fabs(bias[o]);
          for (int64_t ch = 0; ch < c.ci; ++ch)
            for (int64_t ky = 0; ky < R; ++ky)
              for (int64_t kx = 0; kx < R; ++kx) {
                const double t = Wt(o, ch, ky, kx) * X(i, ch, yy + ky - P, xx + kx - P);
                sum += t, mag += std::fabs(t);
              }
          const int64_t at = ((i * c.co + o) * H + yy) * W + xx;
          fy.see(y[at], sum, mag, at);
        }
  // dw[o][ch][ky][kx] = sum over i, yy, xx of g[i][o][yy][xx] x[i][ch][yy + ky - P][xx + kx - P]
  for (int64_t o = 0; o < c.co; ++o)
    for (int64_t ch = 0; ch < c.ci; ++ch)
      for (int64_t ky = 0; ky < R; ++ky)
        for (int64_t kx = 0; kx < R; ++kx) {
          double sum = 0.0, mag = 0.0;
          for (int64_t i = 0; i < n; ++i)
            for (int64_t yy = 0; yy < H; ++yy)
              for (int64_t xx = 0; xx < W; ++xx) {
                const double t = G(i, o, yy, xx) * X(i, ch, yy + ky - P, xx + kx - P);
                sum += t, mag += std::fabs(t);
              }
          const int64_t at = ((o * c.ci + ch) * R + ky) * R + kx;
          fdw.see(dw[at], sum, mag, at);
        }
  // dx[i][ch][yy][xx] = sum over o, ky, kx of g[i][o][yy - ky + P][xx - kx + P] w[o][ch][ky][kx]
  for (int64_t i = 0; i < n; ++i)
    for (int64_t ch = 0; ch < c.ci; ++ch)
      for (int64_t yy = 0; yy < H; ++yy)
        for (int64_t xx = 0; xx < W; ++xx) {
          double sum = 0.0, mag = 0.0;
          for (int64_t o = 0; o < c.co; ++o)
            for (int64_t ky = 0; ky < R; ++ky)
              for (int64_t kx = 0; kx < R; ++kx) {
                const double t = G(i, o, yy - ky + P, xx - kx + P) * Wt(o, ch, ky, kx);
                sum += t, mag += std::fabs(t);
              }
          const int64_t at = ((i * c.ci + ch) * H + yy) * W + xx;
          fdx.see(dx[at], sum, mag, at);
        }
  std::printf("%s: largest error / (eps * largest sum |terms|): forward %.2f, dW %.2f, dx %.2f\n",
              name(c).c_str(), fy.ratio(), fdw.ratio(), fdx.ratio());
  EXPECT_LE(fy.ratio(), kFactor) << "forward, at " << fy.at;
  EXPECT_LE(fdw.ratio(), kFactor) << "dW, at " << fdw.at;
  EXPECT_LE(fdx.ratio(), kFactor) << "dx, at " << fdx.at;
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, WinogradTest,
    ::testing::Values(Case{5, 64, 64, 12, 12, 4},  // cifar10's conv2, one chunk
                      Case{5, 3, 5, 7, 9, 2},      // ragged: tiles hang over both edges
                      Case{5, 2, 3, 1, 1, 1},      // one pixel: every tap but the centre pads
                      Case{3, 16, 8, 28, 28, 1},   // resnet-small's size
                      Case{3, 5, 7, 6, 10, 3}),    // ragged for 4x4 tiles
    [](const ::testing::TestParamInfo<Case>& i) { return name(i.param); });

TEST(Winograd, AppliesToStrideOneSameConvolutionsWithThreeOrFiveTaps) {
  auto shape = [](int64_t k, int64_t stride, kernels::Padding p) {
    return kc::winograd_shape(k, stride, p, 10, 10);
  };
  EXPECT_EQ(shape(5, 1, kernels::Padding::Same).m, 2);
  EXPECT_EQ(shape(3, 1, kernels::Padding::Same).m, 4);
  EXPECT_EQ(shape(5, 2, kernels::Padding::Same).m, 0);
  EXPECT_EQ(shape(5, 1, kernels::Padding::Valid).m, 0);
  EXPECT_EQ(shape(4, 1, kernels::Padding::Same).m, 0);
  EXPECT_EQ(shape(7, 1, kernels::Padding::Same).m, 0);
}

TEST(Winograd, AutoPicksItForWideThreeAndFiveByFiveLayersOnly) {
  auto algo = [](int64_t ci, int64_t co, int64_t k, ConvAlgorithm a) {
    Conv2DConfig c{co, k, 1, kernels::Padding::Same, true};
    c.algorithm = a;
    Conv2D conv("conv", c);
    conv.bind({ci, 12, 12});
    return conv.cpu_algorithm();
  };
  EXPECT_EQ(algo(64, 64, 5, ConvAlgorithm::Auto), ConvAlgorithm::Winograd);  // cifar10's conv2
  EXPECT_EQ(algo(3, 64, 5, ConvAlgorithm::Auto), ConvAlgorithm::Im2col);     // conv1: 3 channels
  EXPECT_EQ(algo(64, 64, 3, ConvAlgorithm::Auto), ConvAlgorithm::Winograd);  // F(4x4, 3x3)
  EXPECT_EQ(algo(24, 16, 3, ConvAlgorithm::Auto), ConvAlgorithm::Winograd);
  EXPECT_EQ(algo(1, 24, 3, ConvAlgorithm::Auto), ConvAlgorithm::Im2col);  // resnet-small's stem
  EXPECT_EQ(algo(24, 8, 3, ConvAlgorithm::Auto), ConvAlgorithm::Im2col);
  EXPECT_EQ(algo(64, 64, 1, ConvAlgorithm::Auto), ConvAlgorithm::Im2col);  // no transform
  EXPECT_EQ(algo(64, 64, 3, ConvAlgorithm::Winograd), ConvAlgorithm::Winograd);
  EXPECT_EQ(algo(64, 64, 5, ConvAlgorithm::Im2col), ConvAlgorithm::Im2col);
}

TEST(Winograd, ForAKernelItCannotComputeIsAnErrorNamingTheLayer) {
  Conv2DConfig c{8, 5, 2, kernels::Padding::Same, true};
  c.algorithm = ConvAlgorithm::Winograd;
  Conv2D conv("conv7", c);
  try {
    conv.bind({8, 12, 12});
    FAIL() << "a stride-2 winograd convolution was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("conv7"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("stride 2"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace towers
