// Model tests: the tutorial net's shapes and parameter count, and a gradient check of the
// whole cifar10 net (cross-entropy through every layer) on a tiny batch.
#include <string>
#include <vector>

#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include "core/check.h"
#include "core/rng.h"
#include "gradcheck.h"
#include "models/models.h"
#include "towers/tower.h"

namespace towers {
namespace {

TEST(Models, Cifar10HasTheTutorialsParameterCount) {
  auto g = build_model("cifar10");
  EXPECT_EQ(g->layout().count(), 1068298);
  std::vector<std::string> names;
  for (const auto& l : g->layers()) names.push_back(l->name());
  EXPECT_EQ(names, (std::vector<std::string>{"conv1", "pool1", "norm1", "conv2", "norm2", "pool2",
                                             "local3", "local4", "softmax_linear"}));
  EXPECT_EQ(g->layers()[5]->out_shape(), (Shape{64, 6, 6}));
  EXPECT_EQ(g->layout().find("conv1/weight").spec.shape, (Shape{64, 3, 5, 5}));
  EXPECT_EQ(g->layout().find("local3/weight").spec.shape, (Shape{384, 2304}));
  EXPECT_FLOAT_EQ(g->layout().find("local3/weight").spec.weight_decay, 0.004f);
  EXPECT_FLOAT_EQ(g->layout().find("conv1/weight").spec.weight_decay, 0.0f);
}

TEST(Models, FashionIsTheSameNetOn28x28x1) {
  auto g = build_model("fashion");
  EXPECT_EQ(g->input_shape(), (Shape{1, 28, 28}));
  EXPECT_EQ(g->layout().find("local3/weight").spec.shape, (Shape{384, 3136}));
}

TEST(Models, UnknownNameListsTheKnownOnes) {
  try {
    build_model("resnet9000");
    FAIL();
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("resnet9000"), std::string::npos);
    EXPECT_NE(m.find("cifar10"), std::string::npos);
  }
}

TEST(Models, InitialisationIsDeterministicAndFollowsTheTutorial) {
  auto g = build_model("cifar10");
  std::vector<float> a(g->layout().total()), b(g->layout().total());
  g->layout().initialize(a.data(), 7);
  g->layout().initialize(b.data(), 7);
  EXPECT_EQ(a, b);
  const Variable& c2b = g->layout().find("conv2/bias");
  EXPECT_FLOAT_EQ(a[c2b.offset], 0.1f);
  const Variable& w = g->layout().find("conv1/weight");
  double s2 = 0, mx = 0;
  for (int64_t i = 0; i < w.size; ++i) s2 += a[w.offset + i] * a[w.offset + i], mx = std::max(mx, (double)std::fabs(a[w.offset + i]));
  EXPECT_LE(mx, 2 * 5e-2 + 1e-6);  // truncated at 2 stddev
  EXPECT_NEAR(std::sqrt(s2 / w.size), 5e-2 * 0.88, 5e-3);  // truncated normal's std ~0.88 sigma
}

TEST(Models, WholeCifar10NetGradientMatchesNumerical) {
  auto g = build_model("cifar10");
  CpuTower tower(*g, 2, 2);
  testing::expect_cifar10_gradients_match_numerical(tower);
}

// The check above can fail: with every gradient 10% off (twice its relative tolerance), every
// variable is reported.
TEST(Models, WholeNetCheckRejectsAGradientTenPercentOff) {
  auto g = build_model("cifar10");
  CpuTower tower(*g, 2, 2);
  ::testing::TestPartResultArray failures;
  {
    ::testing::ScopedFakeTestPartResultReporter intercept(
        ::testing::ScopedFakeTestPartResultReporter::INTERCEPT_ONLY_CURRENT_THREAD, &failures);
    testing::expect_cifar10_gradients_match_numerical(tower, 1.1f);
  }
  size_t mismatched = 0;
  for (int i = 0; i < failures.size(); ++i)
    mismatched += std::string(failures.GetTestPartResult(i).message()).find("analytic") !=
                  std::string::npos;
  EXPECT_EQ(mismatched, g->layout().variables().size());
}

}  // namespace
}  // namespace towers
