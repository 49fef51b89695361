// --input device: the training set on the GPU and each batch made there from the host's plans
// (kernels/augment.h), against the host pipeline that makes the same batch in pixels. The
// plans are the host's own draws, so crop, flip and brightness give the same floats bit for
// bit; the contrast's channel mean and the standardization's statistics are sums in double in
// another order (a block tree), so those batches agree to float rounding.
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "cli_util.h"
#include "data/augment.h"
#include "data/pipeline.h"
#include "data/synthetic.h"
#include "gpu_test_util.h"
#include "kernels/augment.h"
#include "models/models.h"
#include "optim/optimizer.h"
#include "towers/cuda_tower.h"
#include "towers/parameter_store.h"
#include "towers/tower_group.h"

namespace towers {
namespace {

using gputest::DeviceArray;
using testutil::metrics_events;
using testutil::run_towers;
using testutil::test_path;

struct Case {
  const char* name;
  int64_t c, h, w;
  data::AugmentConfig config;
  bool bitwise;  // no contrast, no standardization: the same floats exactly
};

std::vector<Case> cases() {
  std::vector<Case> v;
  data::AugmentConfig tutorial = data::tutorial_train_config(24);  // all five distortions
  v.push_back({"tutorial 32->24", 3, 32, 32, tutorial, false});
  data::AugmentConfig airbench = data::tutorial_eval_config(32);  // pad 2, crop, flip
  airbench.random_crop = airbench.flip = true;
  airbench.pad = 2;
  v.push_back({"airbench", 3, 32, 32, airbench, false});
  airbench.standardize = false;
  v.push_back({"airbench, raw", 3, 32, 32, airbench, true});
  data::AugmentConfig bright = data::tutorial_train_config(26);  // crop, flip, brightness
  bright.contrast = bright.standardize = false;
  v.push_back({"crop 28->26, flip, brightness", 1, 28, 28, bright, true});
  data::AugmentConfig pad = data::tutorial_eval_config(30);  // a center window past the edges
  pad.flip = true;
  v.push_back({"center pad 28->30, flip", 1, 28, 28, pad, false});
  // Channels of 64 floats: fewer than a block's threads in the contrast's reduction.
  v.push_back({"tutorial 12->8", 3, 12, 12, data::tutorial_train_config(8), false});
  return v;
}

TEST(DeviceInputGpu, BatchesAreTheHostPipelines) {
  TOWERS_SKIP_WITHOUT_GPU();
  for (const Case& k : cases()) {
    SCOPED_TRACE(k.name);
    const data::DataSplit d = data::make_synthetic(k.c, k.h, k.w, 10, 300, 10, 11);
    const int64_t batch = 48, step = 7;  // step 7 of 48: the batch straddles epochs 1 and 2
    data::BatchPipeline pixels(d.train, k.config, batch, 5, step, 0);
    data::BatchPipeline plans(d.train, k.config, batch, 5, step, 0, 1, /*planned=*/true);
    const data::Batch want = pixels.next(), got = plans.next();
    ASSERT_EQ(got.plans.size(), static_cast<size_t>(batch));
    EXPECT_EQ(got.images.size(), 0);
    EXPECT_EQ(got.labels, want.labels);

    DeviceArray<uint8_t> images(d.train.images);
    std::vector<kernels::ExamplePlan> plan_list(got.plans.begin(), got.plans.end());
    DeviceArray<kernels::ExamplePlan> plans_d(plan_list);
    const int64_t m = data::example_floats(k.config, d.train);
    DeviceArray<float> out(batch * m);  // NaN until written
    gputest::Stream s;
    kernels::cuda::augment(s.s, images.get(), data::augment_shape(k.config, d.train),
                           plans_d.get(), batch, out.get());
    const std::vector<float> y = out.download();
    ASSERT_EQ(static_cast<int64_t>(want.images.size()), batch * m);
    int64_t differ = 0;
    double worst = 0.0;
    for (int64_t i = 0; i < batch * m; ++i) {
      const float a = want.images.data()[i], b = y[i];
      ASSERT_TRUE(std::isfinite(b)) << "float " << i << " of the device batch was not written";
      if (a != b) ++differ;
      worst = std::max(worst, std::fabs(static_cast<double>(a) - b) / std::max(1.0, std::fabs(static_cast<double>(a))));
    }
    if (k.bitwise)
      EXPECT_EQ(differ, 0) << "of " << batch * m << " floats";
    else
      EXPECT_LE(worst, 1e-5) << differ << " of " << batch * m << " floats differ";
  }
}

// Towers on one GPU share one copy of a set; another set (other bytes, even at the same size)
// gets its own, and the copy outlives the tower that made it.
TEST(DeviceInputGpu, TowersOnAGpuShareOneCopyOfTheSet) {
  TOWERS_SKIP_WITHOUT_GPU();
  auto g = build_model("mlp");
  const data::DataSplit a = data::make_synthetic(1, 28, 28, 10, 200, 10, 3);
  const data::DataSplit b = data::make_synthetic(1, 28, 28, 10, 200, 10, 4);
  ASSERT_EQ(a.train.images.size(), b.train.images.size());
  const data::AugmentConfig config = data::tutorial_eval_config(28);
  TowerPlacement p;
  p.kind = DeviceKind::Cuda;
  auto t0 = std::make_unique<CudaTower>(*g, 16, p);
  CudaTower t1(*g, 16, p), t2(*g, 16, p);
  t0->hold_train_data(a.train, config);
  t1.hold_train_data(a.train, config);
  t2.hold_train_data(b.train, config);
  ASSERT_NE(t0->held_train_data(), nullptr);
  EXPECT_EQ(t0->held_train_data(), t1.held_train_data());
  EXPECT_NE(t1.held_train_data(), t2.held_train_data());
  const void* shared = t1.held_train_data();
  t0.reset();
  CudaTower t3(*g, 16, p);
  t3.hold_train_data(a.train, config);
  EXPECT_EQ(t3.held_train_data(), shared) << "the copy went with the tower that made it";
}

// A run of GPU towers on the host store (sync: two towers, lockstep batches; async: one tower,
// its own stream of batches), its batches made on the host or on the device, its layers'
// backward on one stream or branched (--backward-branches). The parameters after `steps`
// updates, how many steps the towers made from plans, and how many branches they forked.
struct Trained {
  std::vector<float> params;
  int64_t planned_steps = 0;
  int64_t lane_forks = 0;
};
Trained train(const data::AugmentConfig& config, bool device_input, int64_t steps,
              Mode mode = Mode::Sync, bool branches = false) {
  auto g = build_model("mlp");
  const Shape& in = g->input_shape();
  const data::DataSplit d = data::make_synthetic(in[0], in[1] + 4, in[2] + 4, 10, 400, 10, 3);
  std::vector<float> params(g->layout().total());
  g->layout().initialize(params.data(), 1);
  Optimizer opt(g->layout(), {"momentum"});
  EngineConfig ec;
  ec.mode = mode;
  ec.towers = mode == Mode::Sync ? 2 : 1;
  ec.device = DeviceKind::Cuda;
  ec.device_input = device_input;
  ec.backward_branches = branches;
  LocalParameterStore store(params.data(), opt, store_access(ec), false, true);
  Trained r;
  {
    TowerGroup group(*g, ec, 32, store);
    RunHooks hooks;
    hooks.lr_at = [](int64_t) { return 0.05f; };
    hooks.on_update = [](const UpdateRecord&) { return false; };
    hooks.side_work = [](int64_t) {};
    hooks.stop_requested = [] { return false; };
    group.run(d.train, config, 9, 0, steps, 0, hooks);
    for (int i = 0; i < ec.towers; ++i) {
      r.planned_steps += dynamic_cast<CudaTower&>(group.tower(i)).planned_steps();
      r.lane_forks += dynamic_cast<CudaTower&>(group.tower(i)).lane_forks();
    }
  }
  r.params = params;
  return r;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), sizeof(float) * a.size()) == 0;
}

// The engine hands --backward-branches to its towers (each forks its dense layers' gradients),
// and two sync towers on the host store end where one stream per tower ends, bit for bit.
TEST(DeviceInputGpu, TowersOfTheEngineBranchLikeOneStream) {
  TOWERS_SKIP_WITHOUT_GPU();
  const data::AugmentConfig config = data::tutorial_train_config(28);
  const Trained one = train(config, false, 6), branched = train(config, false, 6, Mode::Sync, true);
  EXPECT_EQ(one.lane_forks, 0);
  EXPECT_GT(branched.lane_forks, 0);
  EXPECT_TRUE(same_bits(one.params, branched.params));
}

TEST(DeviceInputGpu, TrainingMatchesHostInput) {
  TOWERS_SKIP_WITHOUT_GPU();
  // 32x32 images cropped to the mlp's 28x28 at random, flipped: the same pixels, so the same
  // parameters bit for bit.
  data::AugmentConfig raw = data::tutorial_train_config(28);
  raw.contrast = raw.standardize = false;
  raw.max_brightness_delta = 8;
  const Trained host = train(raw, false, 6), device = train(raw, true, 6);
  EXPECT_EQ(host.planned_steps, 0);
  EXPECT_EQ(device.planned_steps, 2 * 6);  // every step of both towers made its own batch
  EXPECT_TRUE(same_bits(host.params, device.params));
  // One async tower reads its own stream of batches (the free-running path).
  const Trained host1 = train(raw, false, 5, Mode::Async), device1 = train(raw, true, 5, Mode::Async);
  EXPECT_EQ(device1.planned_steps, 5);
  EXPECT_TRUE(same_bits(host1.params, device1.params));
  // The whole tutorial transform: parameters agree to float rounding.
  const data::AugmentConfig full = data::tutorial_train_config(28);
  const Trained a = train(full, false, 6), b = train(full, true, 6);
  double worst = 0.0, scale = 0.0;
  for (size_t i = 0; i < a.params.size(); ++i) {
    worst = std::max(worst, std::fabs(static_cast<double>(a.params[i]) - b.params[i]));
    scale = std::max(scale, std::fabs(static_cast<double>(a.params[i])));
  }
  EXPECT_LE(worst, 1e-4 * scale);
  EXPECT_FALSE(same_bits(a.params, host.params));  // it trained on other pixels
}

TEST(DeviceInputGpu, APlanOutsideTheTrainingSetIsRefused) {
  TOWERS_SKIP_WITHOUT_GPU();
  auto g = build_model("mlp");
  const Shape& in = g->input_shape();
  const data::DataSplit d = data::make_synthetic(in[0], in[1], in[2], 10, 50, 10, 3);
  TowerPlacement p;
  p.kind = DeviceKind::Cuda;
  CudaTower t(*g, 8, p);
  std::vector<float> params(g->layout().total());
  g->layout().initialize(params.data(), 1);
  t.load_params(params.data());
  t.hold_train_data(d.train, data::tutorial_eval_config(in[1]));
  std::vector<kernels::ExamplePlan> plans(8);
  std::vector<int32_t> labels(8, 1);
  for (int i = 0; i < 8; ++i) plans[i].index = i;
  EXPECT_NO_THROW(t.compute_gradients_planned(plans.data(), labels.data(), 8, 1.0f / 8));
  plans[5].index = 50;
  EXPECT_THROW(t.compute_gradients_planned(plans.data(), labels.data(), 8, 1.0f / 8), InternalError);
  // A transform whose examples are not the model's input.
  EXPECT_THROW(t.hold_train_data(d.train, data::tutorial_eval_config(in[1] - 2)), Error);
}

TEST(DeviceInputCli, TrainsLikeHostInput) {
  TOWERS_SKIP_WITHOUT_GPU();
  const std::string run =
      "train --device cuda --model fashion --dataset synthetic --synthetic-size 600 --batch 32 "
      "--steps 8 --augment tutorial --log-every 1 --eval-every 0 --quiet --seed 3 ";
  const std::string host = test_path("host.jsonl"), device = test_path("device.jsonl");
  std::string out;
  ASSERT_EQ(run_towers(run + "--metrics " + host, &out), 0) << out;
  ASSERT_EQ(run_towers(run + "--input device --metrics " + device, &out), 0) << out;
  const auto config = metrics_events(device, "config");
  ASSERT_EQ(config.size(), 1u);
  EXPECT_EQ(config[0]["config"]["input"], "device");
  const auto a = metrics_events(host, "step"), b = metrics_events(device, "step");
  ASSERT_EQ(a.size(), 8u);
  ASSERT_EQ(b.size(), a.size());
  for (size_t i = 0; i < a.size(); ++i) {
    const double la = a[i]["loss"].get<double>(), lb = b[i]["loss"].get<double>();
    EXPECT_NEAR(la, lb, 1e-4 * std::fabs(la)) << "step " << i;
  }
}

}  // namespace
}  // namespace towers
