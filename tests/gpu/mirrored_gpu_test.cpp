// --params mirrored (towers/mirrored_store.h) against the host store, in process with real GPU
// towers and end to end through the CLI. The two homes run the same rule on the same gradient:
// the CPU loop and the CUDA kernel are both built without FMA contraction (optimizer_rules.h),
// and towers sharing a GPU are summed by the host's tree, so the parameters, the optimizer's
// slots and the losses are bitwise equal, step after step, with the update inside the captured
// step (one tower) or after it (several).
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "cli_util.h"
#include "core/check.h"
#include "core/gpu.h"
#include "data/augment.h"
#include "data/synthetic.h"
#include "gpu_test_util.h"
#include "io/checkpoint.h"
#include "models/models.h"
#include "optim/optimizer.h"
#include "towers/cuda_tower.h"
#include "towers/mirrored_store.h"
#include "towers/parameter_store.h"
#include "towers/tower_group.h"

namespace towers {
namespace {

using testutil::metrics_events;
using testutil::run_towers;
using testutil::test_path;

struct Trained {
  std::vector<float> params;
  std::vector<std::vector<float>> slots;
  std::vector<UpdateRecord> updates;
  std::vector<std::vector<float>> replicas;  // every tower's device parameters at the end
  int64_t replays = 0;                       // graph replays of tower 0
  int64_t optimizer_updates = 0;
};

struct Recipe {
  std::string model = "mlp";
  std::string optimizer = "momentum";
  bool mirrored = false;
  int towers = 1, gpus = 1;
  Reduce reduce = Reduce::Host;
  int64_t batch = 32, steps = 6;
  float lr = 0.05f;
};

// A sync run of s.steps updates on synthetic data, with a learning rate that changes every
// step (so a captured update that kept its first scalars would be caught).
Trained train(const Recipe& s) {
  auto g = build_model(s.model);
  const Shape& in = g->input_shape();
  const data::DataSplit d = data::make_synthetic(in[0], in[1], in[2], 10, 512, 64, 5);
  const data::AugmentConfig aug = data::tutorial_eval_config(in[1]);
  std::vector<float> params(g->layout().total());
  g->layout().initialize(params.data(), 1);
  Optimizer opt(g->layout(), {s.optimizer});
  EngineConfig ec;
  ec.mode = Mode::Sync;
  ec.towers = s.towers;
  ec.device = DeviceKind::Cuda;
  ec.gpus = s.gpus;
  ec.reduce = s.reduce;
  auto lr_at = [lr = s.lr](int64_t v) { return lr / static_cast<float>(1 + v); };
  std::unique_ptr<ParameterStore> store;
  if (s.mirrored)
    store = std::make_unique<MirroredParameterStore>(params.data(), opt, s.reduce, lr_at);
  else
    store = std::make_unique<LocalParameterStore>(params.data(), opt, UpdateAccess::Exclusive,
                                                  false, true);
  Trained r;
  {
    TowerGroup group(*g, ec, s.batch, *store);
    RunHooks hooks;
    hooks.lr_at = lr_at;
    hooks.on_update = [&](const UpdateRecord& u) {
      r.updates.push_back(u);
      return false;
    };
    hooks.side_work = [](int64_t) {};
    hooks.stop_requested = [] { return false; };
    group.run(d.train, aug, 7, 0, s.steps, 0, hooks);
    for (int i = 0; i < s.towers; ++i) {
      auto& t = dynamic_cast<CudaTower&>(group.tower(i));
      std::vector<float> rep(params.size());
      t.device().copy_out(rep.data(), t.device_params(), static_cast<int64_t>(rep.size()));
      r.replicas.push_back(std::move(rep));
    }
    r.replays = dynamic_cast<CudaTower&>(group.tower(0)).graph_replays();
  }  // the group detaches: a mirrored store refreshes the host copies
  r.params = params;
  for (const auto& [name, p] : opt.slots()) r.slots.emplace_back(p, p + params.size());
  r.optimizer_updates = opt.updates();
  return r;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), sizeof(float) * a.size()) == 0;
}

void expect_bitwise_equal(const Trained& host, const Trained& mirrored) {
  EXPECT_TRUE(same_bits(host.params, mirrored.params)) << "parameters differ";
  ASSERT_EQ(host.slots.size(), mirrored.slots.size());
  for (size_t k = 0; k < host.slots.size(); ++k)
    EXPECT_TRUE(same_bits(host.slots[k], mirrored.slots[k])) << "slot " << k << " differs";
  ASSERT_EQ(host.updates.size(), mirrored.updates.size());
  for (size_t u = 0; u < host.updates.size(); ++u) {
    const double a = host.updates[u].loss, b = mirrored.updates[u].loss;
    EXPECT_TRUE(a == b || (std::isnan(a) && std::isnan(b))) << "update " << u << ": " << a << " vs " << b;
    EXPECT_EQ(host.updates[u].skipped, mirrored.updates[u].skipped) << "update " << u;
  }
  EXPECT_EQ(host.optimizer_updates, mirrored.optimizer_updates);
  // Every replica, read from its GPU before the store copied anything back, holds the host
  // store's parameters.
  for (size_t i = 0; i < mirrored.replicas.size(); ++i)
    EXPECT_TRUE(same_bits(mirrored.replicas[i], host.params)) << "replica " << i;
}

// The recipe with host parameters, then mirrored: the same bits, on every replica.
void expect_mirrored_is_host(Recipe s) {
  s.mirrored = false;
  const Trained host = train(s);
  s.mirrored = true;
  const Trained mirrored = train(s);
  ASSERT_EQ(mirrored.replicas.size(), static_cast<size_t>(s.towers));
  expect_bitwise_equal(host, mirrored);
}

class MirroredOneTower
    : public ::testing::TestWithParam<std::pair<const char*, const char*>> {};

TEST_P(MirroredOneTower, IsBitwiseTheHostStoreWithTheUpdateInsideTheStep) {
  TOWERS_SKIP_WITHOUT_GPU();
  Recipe s;
  s.model = GetParam().first;
  s.optimizer = GetParam().second;
  if (s.model == "cifar10") s.steps = 4;  // the emulator runs cifar10 at about 0.3 s a step
  const Trained host = train(s);
  s.mirrored = true;
  const Trained mirrored = train(s);
  ASSERT_EQ(mirrored.updates.size(), static_cast<size_t>(s.steps));
  expect_bitwise_equal(host, mirrored);
  // The first step runs eagerly, every later one replays the captured step, update included.
  EXPECT_EQ(mirrored.replays, s.steps - 1);
  EXPECT_EQ(mirrored.optimizer_updates, s.steps);
  // The check can fail: training moved the parameters.
  std::vector<float> init(host.params.size());
  build_model(s.model)->layout().initialize(init.data(), 1);
  EXPECT_FALSE(same_bits(init, mirrored.params));
}

INSTANTIATE_TEST_SUITE_P(
    Nets, MirroredOneTower,
    ::testing::Values(std::make_pair("mlp", "sgd"), std::make_pair("mlp", "momentum"),
                      std::make_pair("mlp", "adam"), std::make_pair("mlp", "rmsprop"),
                      std::make_pair("cifar10", "momentum")),
    [](const auto& info) {
      return std::string(info.param.first) + "_" + info.param.second;
    });

TEST(MirroredStore, TowersSharingAGpuAreBitwiseTheHostStore) {
  TOWERS_SKIP_WITHOUT_GPU();
  Recipe s;
  s.towers = 3;
  s.batch = 16;
  s.optimizer = "adam";
  expect_mirrored_is_host(s);
}

TEST(MirroredStore, TowersOnTwoGpusAverageWithNcclLikeTheHostStore) {
  TOWERS_SKIP_WITHOUT_GPU();
  const size_t have = list_gpus().gpus.size();
  if (have < 2) TOWERS_GPU_SKIP("an NCCL all-reduce between towers needs 2 GPUs; this machine has " << have);
  Recipe s;
  s.towers = 2;
  s.gpus = 2;
  s.reduce = Reduce::Nccl;
  s.batch = 16;
  // Both sum with the same all-reduce, then apply the same rule.
  expect_mirrored_is_host(s);
}

TEST(MirroredStore, TowersOfHalfTheBatchMatchOneTowerOfTheBatch) {
  TOWERS_SKIP_WITHOUT_GPU();
  Recipe s;
  s.mirrored = true;
  s.steps = 10;
  s.batch = 32;
  const Trained one = train(s);
  s.towers = 2;
  s.batch = 16;
  const Trained two = train(s);
  ASSERT_EQ(one.updates.size(), two.updates.size());
  // Float-close, not bitwise: cuBLAS may sum a batch of 32 and two of 16 in different orders.
  for (size_t u = 0; u < one.updates.size(); ++u)
    EXPECT_NEAR(one.updates[u].loss, two.updates[u].loss, 1e-4 * std::fabs(one.updates[u].loss))
        << "update " << u;
  double worst = 0;
  for (size_t j = 0; j < one.params.size(); ++j)
    worst = std::max(worst, static_cast<double>(std::fabs(one.params[j] - two.params[j])));
  EXPECT_LT(worst, 1e-4);
}

TEST(MirroredStore, AStepWhoseLossIsNotFiniteIsNotApplied) {
  TOWERS_SKIP_WITHOUT_GPU();
  Recipe s;
  s.lr = 1e7f;  // diverges within a few steps
  s.steps = 8;
  const Trained host = train(s);
  s.mirrored = true;
  const Trained mirrored = train(s);
  int skipped = 0;
  for (const UpdateRecord& u : mirrored.updates) skipped += u.skipped;
  ASSERT_GT(skipped, 0) << "the run should diverge at lr 1e7";
  for (float p : mirrored.params) ASSERT_TRUE(std::isfinite(p));
  // The GPU skipped exactly the updates the host store skipped, and so holds the same bits.
  expect_bitwise_equal(host, mirrored);
  EXPECT_EQ(mirrored.optimizer_updates, s.steps - skipped);
}

// With one tower the update is part of compute_gradients, so the store holds the caller to
// pull, step, push: a step outside that order would apply an update the host never counts.
TEST(MirroredStore, AStepOutsidePullAndPushIsRefused) {
  TOWERS_SKIP_WITHOUT_GPU();
  auto g = build_model("mlp");
  TowerPlacement p;
  p.kind = DeviceKind::Cuda;
  CudaTower tower(*g, 16, p);
  std::vector<float> params(g->layout().total());
  g->layout().initialize(params.data(), 1);
  Optimizer opt(g->layout(), {"momentum"});
  MirroredParameterStore store(params.data(), opt, Reduce::Host, [](int64_t) { return 0.01f; });
  store.attach({&tower});
  std::vector<float> x(16 * 28 * 28, 0.5f);
  std::vector<int32_t> y(16, 3);
  EXPECT_THROW(tower.compute_gradients(x.data(), y.data(), 16, 1.0f / 16), InternalError);
  store.pull(tower);
  tower.compute_gradients(x.data(), y.data(), 16, 1.0f / 16);
  EXPECT_THROW(store.pull(tower), InternalError);
  EXPECT_THROW(tower.compute_gradients(x.data(), y.data(), 16, 1.0f / 16), InternalError);
  UpdateRecord rec;
  rec.lr = 0.01f;
  EXPECT_EQ(store.push(nullptr, rec, tower.host()), 1);
  EXPECT_EQ(opt.updates(), 1);
  store.detach();
  // The one update that was pushed came back to the host copy.
  std::vector<float> init(params.size());
  g->layout().initialize(init.data(), 1);
  EXPECT_FALSE(same_bits(init, params));
}

// End to end: the flag, checkpoints (the slots come back from the GPU) and resume.
const std::string kRun =
    "train --device cuda --model mlp --dataset synthetic --synthetic-size 2000 --batch 32 "
    "--optimizer adam --lr 0.01 --lr-schedule cosine --steps 12 --quiet --seed 5 ";

io::Checkpoint load(const std::string& dir) {
  const auto path = io::latest_checkpoint(dir);
  EXPECT_TRUE(path.has_value()) << dir;
  auto g = build_model("mlp");
  return io::load_checkpoint(path.value_or(""), g->layout(), {"m", "v"});
}

bool same_tensors(const io::Checkpoint& a, const io::Checkpoint& b) {
  if (a.meta.step != b.meta.step || a.params.size() != b.params.size() ||
      a.slots.size() != b.slots.size())
    return false;
  if (std::memcmp(a.params.data(), b.params.data(), sizeof(float) * a.params.size()) != 0)
    return false;
  for (size_t k = 0; k < a.slots.size(); ++k)
    if (std::memcmp(a.slots[k].second.data(), b.slots[k].second.data(),
                    sizeof(float) * a.params.size()) != 0)
      return false;
  return a.meta.optimizer_state == b.meta.optimizer_state;
}

TEST(MirroredCli, CheckpointsAndResumeAreBitwiseTheHostRun) {
  TOWERS_SKIP_WITHOUT_GPU();
  const std::string host = test_path("host"), mirrored = test_path("mirrored"),
                    resumed = test_path("resumed"), m = test_path("m.jsonl");
  std::string out;
  ASSERT_EQ(run_towers(kRun + "--params host --checkpoint-dir " + host, &out), 0) << out;
  ASSERT_EQ(run_towers(kRun + "--params mirrored --metrics " + m + " --checkpoint-dir " + mirrored,
                       &out), 0) << out;
  EXPECT_TRUE(same_tensors(load(host), load(mirrored)));
  auto config = metrics_events(m, "config");
  ASSERT_EQ(config.size(), 1u);
  EXPECT_EQ(config[0]["config"]["params"], "mirrored");
  // Stopped at step 5 and resumed: the replicas restart from the checkpoint's parameters and
  // slots, and Adam's step count.
  ASSERT_EQ(run_towers(kRun + "--params mirrored --stop-at-step 5 --checkpoint-dir " + resumed,
                       &out), 0) << out;
  ASSERT_EQ(run_towers(kRun + "--params mirrored --resume --checkpoint-dir " + resumed, &out), 0)
      << out;
  EXPECT_TRUE(same_tensors(load(mirrored), load(resumed)));
}

TEST(MirroredCli, TowersOnSeveralGpusWithoutNcclAreAClearError) {
  TOWERS_SKIP_WITHOUT_GPU();
  const size_t have = list_gpus().gpus.size();
  if (have < 2) TOWERS_GPU_SKIP("towers on several GPUs need 2 GPUs; this machine has " << have);
  const std::string m = test_path("m.jsonl");
  std::string out;
  EXPECT_EQ(run_towers(kRun + "--params mirrored --towers 2 --gpus 2 --metrics " + m, &out), 1);
  EXPECT_NE(out.find("add --reduce nccl"), std::string::npos) << out;
  EXPECT_FALSE(std::filesystem::exists(m));
}

}  // namespace
}  // namespace towers
