// Model tests: the tutorial net's shapes and parameter count, and a gradient check of the
// whole cifar10 net (cross-entropy through every layer) on a tiny batch.
#include <vector>

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
  const int64_t n = 2;
  CpuTower tower(*g, n, 2);
  std::vector<float> params(g->layout().total());
  g->layout().initialize(params.data(), 3);
  // Larger last-layer weights so the loss is not flat in the early layers.
  const Variable& sl = g->layout().find("softmax_linear/weight");
  Rng rng(5);
  for (int64_t i = 0; i < sl.size; ++i) params[sl.offset + i] = rng.uniform(-0.5f, 0.5f);
  std::vector<float> x(n * 3 * 24 * 24);
  for (float& v : x) v = rng.uniform(-1.5f, 1.5f);
  std::vector<int32_t> y = {3, 8};
  tower.load_params(params.data());
  tower.compute_gradients(x.data(), y.data(), n, 1.0f / n);
  std::vector<float> grads(tower.grads(), tower.grads() + g->layout().total());
  auto loss = [&] {
    tower.load_params(params.data());
    return tower.evaluate(x.data(), y.data(), n).loss_sum / n;
  };
  for (const Variable& v : g->layout().variables()) {
    std::vector<int64_t> idx;
    for (int64_t i : testing::sample_indices(v.size, 12, v.offset)) idx.push_back(v.offset + i);
    auto r = testing::check_gradient(loss, params.data(), grads.data(), idx, v.spec.name,
                                     /*eps=*/2e-3f, /*atol=*/2e-4, /*rtol=*/5e-2);
    EXPECT_TRUE(r.ok()) << v.spec.name << ": " << r.worst;
    EXPECT_GE(r.checked, 6) << v.spec.name;
  }
}

}  // namespace
}  // namespace towers
