// Kernel tests: softmax cross-entropy, standardization, ReLU, the GEMM wrapper and the
// optimizer updates against their formulas.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/check.h"
#include "core/rng.h"
#include "gradcheck.h"
#include "kernels/activation.h"
#include "kernels/gemm.h"
#include "kernels/optimizer.h"
#include "kernels/softmax_xent.h"
#include "kernels/standardize.h"
#include "optim/optimizer.h"
#include "optim/schedule.h"

namespace towers {
namespace {

TEST(SoftmaxXent, LossAndAccuracyOnKnownLogits) {
  // logits (2, 3): uniform row gives log 3; a confident right answer gives ~0.
  std::vector<float> z = {0, 0, 0, 10, -10, -10};
  std::vector<int32_t> y = {1, 0};
  auto r = kernels::cpu::softmax_xent(2, 3, z.data(), y.data(), 0.0f, 0.0f, nullptr);
  EXPECT_NEAR(r.loss_sum, std::log(3.0) + std::log(1 + 2 * std::exp(-20.0)), 1e-6);
  EXPECT_EQ(r.correct, 1);  // argmax of the uniform row is 0, label 1
}

TEST(SoftmaxXent, GradientMatchesNumerical) {
  const int64_t n = 5, k = 7;
  Rng rng(3);
  std::vector<float> z(n * k), g(n * k);
  std::vector<int32_t> y(n);
  for (float& v : z) v = rng.uniform(-3, 3);
  for (auto& v : y) v = static_cast<int32_t>(rng.below(k));
  kernels::cpu::softmax_xent(n, k, z.data(), y.data(), 0.0f, 1.0f / n, g.data());
  auto loss = [&] { return kernels::cpu::softmax_xent(n, k, z.data(), y.data(), 0.0f, 0.0f, nullptr).loss_sum / n; };
  auto r = testing::check_gradient(loss, z.data(), g.data(), testing::sample_indices(n * k, 100, 1), "logits");
  EXPECT_TRUE(r.ok()) << r.worst;
  EXPECT_EQ(r.checked, n * k);
}

// Label smoothing eps: the target is q = (1 - eps) onehot + eps / k; the loss is -sum q log p,
// computed here from the softmax directly, and the gradient is its derivative.
TEST(SoftmaxXent, LabelSmoothingLossAndGradient) {
  const int64_t n = 6, k = 5;
  const float eps = 0.2f;
  Rng rng(4);
  std::vector<float> z(n * k), g(n * k);
  std::vector<int32_t> y(n);
  for (float& v : z) v = rng.uniform(-4, 4);
  for (auto& v : y) v = static_cast<int32_t>(rng.below(k));
  const auto r = kernels::cpu::softmax_xent(n, k, z.data(), y.data(), eps, 1.0f / n, g.data());
  double want = 0.0;
  for (int64_t b = 0; b < n; ++b) {
    double sum = 0.0;
    for (int64_t j = 0; j < k; ++j) sum += std::exp(static_cast<double>(z[b * k + j]));
    for (int64_t j = 0; j < k; ++j) {
      const double q = (j == y[b] ? 1.0 - eps : 0.0) + eps / static_cast<double>(k);
      want -= q * std::log(std::exp(static_cast<double>(z[b * k + j])) / sum);
    }
  }
  EXPECT_NEAR(r.loss_sum, want, 1e-9 * want);
  // Smoothing moves the loss off the plain cross-entropy, and the gradient rows still sum to 0.
  const auto plain = kernels::cpu::softmax_xent(n, k, z.data(), y.data(), 0.0f, 0.0f, nullptr);
  EXPECT_GT(std::abs(r.loss_sum - plain.loss_sum), 1e-3);
  for (int64_t b = 0; b < n; ++b) {
    double row = 0.0;
    for (int64_t j = 0; j < k; ++j) row += g[b * k + j];
    EXPECT_NEAR(row, 0.0, 1e-6);
  }
  auto loss = [&] {
    return kernels::cpu::softmax_xent(n, k, z.data(), y.data(), eps, 0.0f, nullptr).loss_sum / n;
  };
  auto c = testing::check_gradient(loss, z.data(), g.data(), testing::sample_indices(n * k, 100, 1),
                                   "logits");
  EXPECT_TRUE(c.ok()) << c.worst;
  EXPECT_EQ(c.checked, n * k);
}

TEST(Standardize, ZeroMeanUnitStdAndTheFloor) {
  std::vector<float> x = {1, 2, 3, 4, 5, 6, 7, 8, 5, 5, 5, 5, 5, 5, 5, 5};
  std::vector<float> y(16);
  kernels::cpu::standardize(2, 8, x.data(), y.data());
  double m = 0, s = 0;
  for (int i = 0; i < 8; ++i) m += y[i];
  for (int i = 0; i < 8; ++i) s += y[i] * y[i];
  EXPECT_NEAR(m / 8, 0.0, 1e-6);
  EXPECT_NEAR(s / 8, 1.0, 1e-5);
  for (int i = 8; i < 16; ++i) EXPECT_EQ(y[i], 0.0f);  // constant image: stddev floored, no NaN
}

TEST(Relu, ForwardAndBackward) {
  std::vector<float> x = {-1, 0, 2, -3, 4}, y(5), dy = {1, 1, 1, 1, 1}, dx(5);
  kernels::cpu::relu_forward(5, x.data(), y.data());
  EXPECT_EQ(y, (std::vector<float>{0, 0, 2, 0, 4}));
  kernels::cpu::relu_backward(5, y.data(), dy.data(), dx.data());
  EXPECT_EQ(dx, (std::vector<float>{0, 0, 1, 0, 1}));
}

// beta = 0: whatever C held (NaN here) is overwritten, never added, with or without row
// padding (ldc > n: the columns past n are left alone) and when k = 0 (C = 0); beta != 0
// still scales C. Against the sums in double.
TEST(Gemm, BetaZeroOverwritesCAndLeavesItsRowPaddingAlone) {
  struct Case {
    int64_t pad, k;
    float alpha, beta;
  };
  const int64_t m = 5, n = 7;
  const float sentinel = 12345.0f;
  for (const Case cs : {Case{3, 9, 2.0f, 0.0f}, Case{3, 9, 2.0f, 0.5f}, Case{0, 9, 1.0f, 0.0f},
                        Case{0, 0, 1.0f, 0.0f}}) {
    const int64_t k = cs.k, ldc = n + cs.pad;
    Rng rng(61);
    std::vector<float> a(m * std::max<int64_t>(k, 1)), b(std::max<int64_t>(k, 1) * n), c0(m * ldc);
    for (auto* v : {&a, &b, &c0})
      for (float& e : *v) e = rng.uniform(-1, 1);
    std::vector<float> c(m * ldc);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < ldc; ++j)
        c[i * ldc + j] = j >= n            ? sentinel
                         : cs.beta == 0.0f ? std::numeric_limits<float>::quiet_NaN()
                                           : c0[i * ldc + j];
    kernels::cpu::gemm(false, false, m, n, k, cs.alpha, a.data(), std::max<int64_t>(k, 1), b.data(),
                       n, cs.beta, c.data(), ldc);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < ldc; ++j) {
        const std::string at = "k " + std::to_string(k) + ", ldc " + std::to_string(ldc) +
                               ", beta " + std::to_string(cs.beta) + " at " + std::to_string(i) +
                               "," + std::to_string(j);
        if (j >= n) {
          EXPECT_EQ(c[i * ldc + j], sentinel) << at;
          continue;
        }
        double want = cs.beta == 0.0f ? 0.0 : static_cast<double>(cs.beta) * c0[i * ldc + j];
        for (int64_t l = 0; l < k; ++l) want += double{cs.alpha} * a[i * k + l] * b[l * n + j];
        EXPECT_NEAR(c[i * ldc + j], want, 1e-5) << at;
      }
  }
}

// One variable of 3 floats through the Optimizer, checked step by step against the formulas.
struct OptFixture {
  ParameterLayout layout{{ParamSpec{"v/weight", {3}, Init::constant(0), 0.5f}}};
  std::vector<float> w = std::vector<float>(layout.total(), 0.0f);
  std::vector<float> g = std::vector<float>(layout.total(), 0.0f);
  OptFixture() { w[0] = 1.0f, w[1] = -2.0f, w[2] = 0.5f, g[0] = 0.1f, g[1] = 0.2f, g[2] = -0.3f; }
};

TEST(Optimizer, SgdWithWeightDecay) {
  OptFixture f;
  Optimizer opt(f.layout, {"sgd"});
  opt.apply(f.w.data(), f.g.data(), 0.1f);
  EXPECT_FLOAT_EQ(f.w[0], 1.0f - 0.1f * (0.1f + 0.5f * 1.0f));
  EXPECT_FLOAT_EQ(f.w[1], -2.0f - 0.1f * (0.2f + 0.5f * -2.0f));
}

// State variables (running statistics) take state += state_rate x delta at every update, in
// apply and apply_shared alike, whatever the lr and the optimizer; their slots stay untouched,
// and a state variable of rate 0 never changes.
TEST(Optimizer, StateVariablesFollowTheirRunningAverage) {
  ParamSpec w{"l/weight", {3}, Init::constant(0), 0.0f};
  ParamSpec mean{"l/moving_mean", {2}, Init::constant(0), 0.0f};
  ParamSpec frozen{"l/frozen", {2}, Init::constant(0), 0.0f};
  mean.trainable = frozen.trainable = false;
  mean.state_rate = 0.25f;
  const ParameterLayout layout({w, mean, frozen});
  for (bool shared : {false, true}) {
    std::vector<float> p(layout.total(), 1.0f), g(layout.total(), 0.5f);
    const int64_t m = layout.find("l/moving_mean").offset, fz = layout.find("l/frozen").offset;
    g[m] = 2.0f, g[m + 1] = -4.0f;
    Optimizer opt(layout, {"momentum"});
    if (shared)
      opt.apply_shared(p.data(), g.data(), 0.1f, false);
    else
      opt.apply(p.data(), g.data(), 0.1f);
    EXPECT_FLOAT_EQ(p[0], 1.0f - 0.1f * 0.5f) << shared;
    EXPECT_EQ(p[m], 1.0f + 0.25f * 2.0f) << shared;
    EXPECT_EQ(p[m + 1], 1.0f + 0.25f * -4.0f) << shared;
    EXPECT_EQ(p[fz], 1.0f) << shared;
    EXPECT_EQ(opt.slot("momentum")[m], 0.0f) << shared;
  }
}

// --ema: the average starts at the weights before the first update and follows TF's
// ExponentialMovingAverage with num_updates; state variables are averaged too; the slot is
// checkpointed as "ema". Shared (Hogwild) applies compute the same values.
TEST(Optimizer, EmaStartsAtTheInitialWeightsWithTfWarmup) {
  ParamSpec w{"l/weight", {3}, Init::constant(0), 0.0f};
  ParamSpec mean{"l/moving_mean", {2}, Init::constant(0), 0.0f};
  mean.trainable = false;
  mean.state_rate = 0.5f;
  const ParameterLayout layout({w, mean});
  for (bool shared : {false, true}) {
    OptimizerConfig c{"sgd"};
    c.ema = 0.5;
    Optimizer opt(layout, c);
    ASSERT_EQ(opt.slot_names(), (std::vector<std::string>{"ema"}));
    std::vector<float> p(layout.total(), 2.0f), g(layout.total(), 1.0f);
    double e = 2.0, em = 2.0, x = 2.0, m = 2.0;
    for (int t = 1; t <= 4; ++t) {
      if (shared)
        opt.apply_shared(p.data(), g.data(), 0.25f, false);
      else
        opt.apply(p.data(), g.data(), 0.25f);
      x -= 0.25, m += 0.5;
      const double d = std::min(0.5, (1.0 + t) / (10.0 + t));  // 2/11, 3/12, 4/13, then 0.5
      e = d * e + (1 - d) * x, em = d * em + (1 - d) * m;
      EXPECT_NEAR(opt.slot("ema")[0], e, 1e-6) << shared << " update " << t;
      EXPECT_NEAR(opt.slot("ema")[layout.find("l/moving_mean").offset], em, 1e-6) << shared;
    }
  }
}

// --lookahead K: every K updates the fast weights go back to slow + alpha (fast - slow), which
// becomes the slow weights; state variables are left to their running averages.
TEST(Optimizer, LookaheadPullsTheFastWeightsBackEveryKUpdates) {
  ParamSpec w{"l/weight", {2}, Init::constant(0), 0.0f};
  ParamSpec mean{"l/moving_mean", {1}, Init::constant(0), 0.0f};
  mean.trainable = false;
  mean.state_rate = 1.0f;
  const ParameterLayout layout({w, mean});
  for (bool shared : {false, true}) {
    OptimizerConfig c{"sgd"};
    c.lookahead_k = 3;
    c.lookahead_alpha = 0.5f;
    Optimizer opt(layout, c);
    std::vector<float> p(layout.total(), 1.0f), g(layout.total(), 1.0f);
    const int64_t m = layout.find("l/moving_mean").offset;
    double slow = 1.0, fast = 1.0;
    for (int t = 1; t <= 7; ++t) {
      if (shared)
        opt.apply_shared(p.data(), g.data(), 0.125f, false);
      else
        opt.apply(p.data(), g.data(), 0.125f);
      fast -= 0.125;
      if (t % 3 == 0) fast = slow = slow + 0.5 * (fast - slow);
      EXPECT_NEAR(p[0], fast, 1e-6) << shared << " update " << t;
      EXPECT_NEAR(opt.slot("lookahead")[1], slow, 1e-6) << shared << " update " << t;
      EXPECT_EQ(p[m], 1.0f + static_cast<float>(t)) << "state is not pulled back";
    }
  }
}

TEST(Optimizer, MomentumAndNesterovTwoSteps) {
  for (bool nesterov : {false, true}) {
    OptFixture f;
    OptimizerConfig c{"momentum"};
    c.momentum = 0.9f, c.nesterov = nesterov;
    Optimizer opt(f.layout, c);
    double w = 1.0, a = 0.0;
    for (int step = 0; step < 2; ++step) {
      opt.apply(f.w.data(), f.g.data(), 0.1f);
      double g = 0.1 + 0.5 * w;
      a = 0.9 * a + g;
      w -= nesterov ? 0.1 * (g + 0.9 * a) : 0.1 * a;
      EXPECT_NEAR(f.w[0], w, 1e-6) << "nesterov " << nesterov << " step " << step;
    }
  }
}

TEST(Optimizer, AdamMatchesTfFormula) {
  OptFixture f;
  Optimizer opt(f.layout, {"adam"});
  double w = 1.0, m = 0, v = 0;
  for (int t = 1; t <= 3; ++t) {
    opt.apply(f.w.data(), f.g.data(), 0.01f);
    double g = 0.1 + 0.5 * w;
    m = 0.9 * m + 0.1 * g;
    v = 0.999 * v + 0.001 * g * g;
    double lr_t = 0.01 * std::sqrt(1 - std::pow(0.999, t)) / (1 - std::pow(0.9, t));
    w -= lr_t * m / (std::sqrt(v) + 1e-8);
    EXPECT_NEAR(f.w[0], w, 1e-6);
  }
  EXPECT_EQ(opt.state()["updates"], 3);
}

TEST(Optimizer, AdagradAndRmspropMatchTfFormulas) {
  OptFixture f;
  Optimizer ada(f.layout, {"adagrad"});
  ada.apply(f.w.data(), f.g.data(), 0.1f);
  double g = 0.1 + 0.5;
  EXPECT_NEAR(f.w[0], 1.0 - 0.1 * g / std::sqrt(0.1 + g * g), 1e-6);

  OptFixture r;
  OptimizerConfig c{"rmsprop"};
  c.momentum = 0.5f;
  Optimizer rms(r.layout, c);
  rms.apply(r.w.data(), r.g.data(), 0.1f);
  double ms = 0.9 * 1.0 + 0.1 * g * g;
  double mom = 0.1 * g / std::sqrt(ms + 1e-10);
  EXPECT_NEAR(r.w[0], 1.0 - mom, 1e-6);
}

// The registry is the one list of optimizers: every name resolves, an unknown one does not
// (the CLI's error naming --optimizer is CliBadInput's), and each optimizer's slots get their
// initial values.
TEST(Optimizer, TheRegistryNamesEveryOptimizerAndItsSlots) {
  EXPECT_EQ(optimizer_names(),
            (std::vector<std::string>{"sgd", "momentum", "adagrad", "adam", "rmsprop"}));
  EXPECT_EQ(find_optimizer("adamw2"), nullptr);
  ParameterLayout layout{{ParamSpec{"v", {3}, Init::constant(0), 0}}};
  for (const OptimizerDef& d : optimizers()) {
    SCOPED_TRACE(d.name);
    ASSERT_EQ(find_optimizer(d.name), &d);
    Optimizer opt(layout, {d.name});
    ASSERT_EQ(opt.slot_names().size(), d.slots.size());
    for (const auto& [name, init] : d.slots)
      for (int64_t i = 0; i < layout.total(); ++i) EXPECT_EQ(opt.slot(name)[i], init);
  }
}

TEST(Schedule, CountsEpochsNotSteps) {
  ScheduleConfig s;
  s.kind = "exponential", s.lr = 0.1f, s.decay_epochs = 2.0, s.decay_factor = 0.5f;
  EXPECT_FLOAT_EQ(learning_rate(s, 1.99), 0.1f);
  EXPECT_FLOAT_EQ(learning_rate(s, 2.0), 0.05f);
  EXPECT_FLOAT_EQ(learning_rate(s, 4.5), 0.025f);
  ScheduleConfig c;
  c.kind = "cosine", c.lr = 1.0f, c.total_epochs = 10.0;
  EXPECT_FLOAT_EQ(learning_rate(c, 0.0), 1.0f);
  EXPECT_NEAR(learning_rate(c, 5.0), 0.5f, 1e-6);
  EXPECT_NEAR(learning_rate(c, 10.0), 0.0f, 1e-6);
  c.warmup_epochs = 1.0;
  EXPECT_NEAR(learning_rate(c, 0.5), 0.5f * learning_rate(ScheduleConfig{"cosine", 1.0f, 350, 0.1f, 10.0, 0.0}, 0.5), 1e-6);
}

TEST(Schedule, RejectsNonsense) {
  ScheduleConfig s;
  s.lr = -1.0f;
  EXPECT_THROW(validate(s), Error);
  s.lr = 0.1f, s.kind = "triangle";
  EXPECT_THROW(validate(s), Error);
}

}  // namespace
}  // namespace towers
