// --params mirrored (towers/mirrored_store.h) against the host store, in process with real GPU
// towers and end to end through the CLI. The two homes run the same rule on the same gradient:
// the CPU loop and the CUDA kernel are both built without FMA contraction (optimizer_rules.h),
// and towers sharing a GPU are summed by the host's tree, so the parameters, the optimizer's
// slots and the losses are bitwise equal, step after step, with the update inside the captured
// step (one tower) or after it (several).
#include <cmath>
#include <algorithm>
#include <cstring>
#include <fstream>
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
  Mode mode = Mode::Sync;
  int64_t staleness = 0;   // ssp
  int64_t sync_every = 0;  // mirrored, async and ssp
  double ema = 0.0;        // the optimizer's wrappers
  int lookahead_k = 0;
  double clip = 0.0;       // --clip-grad-norm
  bool check = false;      // --on-divergence skip-step
};

// A run of s.steps updates on synthetic data, with a learning rate that changes every step
// (so a captured update that kept its first scalars would be caught).
Trained train(const Recipe& s) {
  auto g = build_model(s.model);
  const Shape& in = g->input_shape();
  const data::DataSplit d = data::make_synthetic(in[0], in[1], in[2], 10, 512, 64, 5);
  const data::AugmentConfig aug = data::tutorial_eval_config(in[1]);
  std::vector<float> params(g->layout().total());
  g->layout().initialize(params.data(), 1);
  OptimizerConfig oc{s.optimizer};
  oc.ema = s.ema;
  oc.lookahead_k = s.lookahead_k;
  oc.lookahead_alpha = 0.6f;
  Optimizer opt(g->layout(), oc);
  EngineConfig ec;
  ec.mode = s.mode;
  ec.staleness = s.staleness;
  ec.towers = s.towers;
  ec.device = DeviceKind::Cuda;
  ec.gpus = s.gpus;
  ec.reduce = s.reduce;
  ec.clip_grad_norm = s.clip;
  ec.check_grad_norm = s.check;
  auto lr_at = [lr = s.lr](int64_t v) { return lr / static_cast<float>(1 + v); };
  std::unique_ptr<ParameterStore> store;
  if (s.mirrored)
    store = std::make_unique<MirroredParameterStore>(params.data(), opt, s.reduce, lr_at,
                                                     s.sync_every, s.clip, s.check);
  else
    store = std::make_unique<LocalParameterStore>(params.data(), opt, store_access(ec), false,
                                                  true);
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
    // The host copy as evaluations and checkpoints get it (it throws where detach would only
    // warn, e.g. for a step whose update was applied and never pushed).
    store->host_params();
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
    EXPECT_EQ(host.updates[u].lr, mirrored.updates[u].lr) << "update " << u;
    EXPECT_EQ(host.updates[u].staleness, mirrored.updates[u].staleness) << "update " << u;
    const double na = host.updates[u].grad_norm, nb = mirrored.updates[u].grad_norm;
    EXPECT_TRUE(std::memcmp(&na, &nb, sizeof(double)) == 0 || (std::isnan(na) && std::isnan(nb)))
        << "update " << u << ": gradient norm " << na << " vs " << nb;
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

// A net with batch normalization, whose running statistics (state variables) the replicas
// update on the device from the steps' deltas.
std::string bn_model() {
  const std::string file = test_path("bn.json");
  std::ofstream(file) << R"({"name": "bn", "input": [3, 24, 24], "classes": 10, "layers": [
  {"name": "conv", "type": "conv2d", "filters": 8, "kernel": 3, "stride": 2, "relu": false,
   "weight_init": {"stddev": 0.2}},
  {"name": "bn", "type": "batchnorm", "momentum": 0.8},
  {"name": "act", "type": "relu"},
  {"name": "out", "type": "dense", "units": 10, "relu": false, "weight_init": {"stddev": 0.05}}]})";
  return file;
}

// The state variables' running averages, the exponential moving average of the weights and
// Lookahead run on the device beside the rule, in the host optimizer's order and rounding:
// inside the captured step with one tower, after the sum with several. Lookahead every 2
// updates, so that both of its branches run.
TEST(MirroredStore, StateAverageAndLookaheadAreBitwiseTheHostStore) {
  TOWERS_SKIP_WITHOUT_GPU();
  for (int towers : {1, 2}) {
    SCOPED_TRACE(testing::Message() << towers << " tower(s)");
    Recipe s;
    s.model = bn_model();
    s.optimizer = "adam";
    s.towers = towers;
    s.batch = 16;
    s.steps = 5;
    s.ema = 0.9;
    s.lookahead_k = 2;
    s.mirrored = false;
    const Trained host = train(s);
    ASSERT_EQ(host.slots.size(), 4u);  // m, v, ema, lookahead
    s.mirrored = true;
    const Trained mirrored = train(s);
    expect_bitwise_equal(host, mirrored);
    // The checks can fail: the running statistics, the average and the slow weights moved.
    auto g = build_model(s.model);
    std::vector<float> init(host.params.size());
    g->layout().initialize(init.data(), 1);
    for (const Variable& v : g->layout().variables()) {
      if (v.spec.trainable) continue;
      EXPECT_FALSE(std::equal(init.begin() + v.offset, init.begin() + v.offset + v.size,
                              mirrored.params.begin() + v.offset))
          << v.spec.name << " did not move";
    }
    EXPECT_FALSE(same_bits(mirrored.slots[2], mirrored.params));
    EXPECT_FALSE(same_bits(mirrored.slots[3], init));
  }
}

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
  if (have < 2) TOWERS_SKIP_FOR_GPU_COUNT(2, have);  // an NCCL all-reduce between towers
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

// Also with the gradient's norm measured and clipped on the GPU (by a bound no gradient
// reaches): the GPU skips exactly the steps the host skips. (These steps diverge in their loss;
// that the norm's own check sets the skip flag is NormGuardGpu's test.)
TEST(MirroredStore, AStepWhoseLossIsNotFiniteIsNotApplied) {
  TOWERS_SKIP_WITHOUT_GPU();
  for (bool guard : {false, true}) {
    SCOPED_TRACE(guard ? "with the norm checked and clipped" : "the loss checked");
    Recipe s;
    s.lr = 1e7f;  // diverges within a few steps
    s.steps = 8;
    s.ema = 0.9;  // the wrappers' kernels skip a skipped update too
    s.lookahead_k = 2;
    s.check = guard;
    s.clip = guard ? 1e30 : 0.0;
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
}

// --clip-grad-norm and --on-divergence skip-step with mirrored parameters: the GPU takes each
// update's norm in the host's order and clips there, inside the step (one tower; an async
// tower) or on the sum (towers sharing a GPU), so the norms and the parameters are the host
// store's bits. The bound is the median norm of the unclipped run, so that some updates are
// clipped and some are not.
TEST(MirroredStore, GuardedUpdatesAreBitwiseTheHostStore) {
  TOWERS_SKIP_WITHOUT_GPU();
  struct Case {
    const char* name;
    int towers;
    Mode mode;
    int64_t sync_every;
  };
  for (const Case& c : {Case{"one tower", 1, Mode::Sync, 0}, Case{"3 towers", 3, Mode::Sync, 0},
                        Case{"async", 1, Mode::Async, 2}}) {
    SCOPED_TRACE(c.name);
    Recipe s;
    s.towers = c.towers;
    s.mode = c.mode;
    s.sync_every = c.sync_every;
    s.batch = 16;
    s.steps = 8;
    s.check = true;
    const Trained measured = train(s);
    std::vector<double> norms;
    for (const UpdateRecord& u : measured.updates) {
      ASSERT_GT(u.grad_norm, 0.0) << "the host store measures every update's norm";
      norms.push_back(u.grad_norm);
    }
    s.mirrored = true;
    expect_bitwise_equal(measured, train(s));
    std::nth_element(norms.begin(), norms.begin() + norms.size() / 2, norms.end());
    s.clip = norms[norms.size() / 2];
    s.check = false;
    s.mirrored = false;
    const Trained host = train(s);
    int clipped = 0;
    for (const UpdateRecord& u : host.updates) clipped += u.grad_norm > s.clip;
    EXPECT_GT(clipped, 0);
    EXPECT_LT(clipped, s.steps);
    EXPECT_FALSE(same_bits(host.params, measured.params)) << "the clip changed nothing";
    s.mirrored = true;
    expect_bitwise_equal(host, train(s));
  }
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
  EXPECT_EQ(store.push(nullptr, rec, tower), 1);
  EXPECT_EQ(opt.updates(), 1);
  store.detach();
  // The one update that was pushed came back to the host copy.
  std::vector<float> init(params.size());
  g->layout().initialize(init.data(), 1);
  EXPECT_FALSE(same_bits(init, params));
}

// ---- async and SSP: every tower steps its own replica, folding into the host copy every K ----

// One tower has no one to be stale against: whatever K, its replica is the host store's
// async run, bit for bit, and the folds (K = 3 leaves one step pending at the end, folded in
// when the group detaches) change nothing.
class MirroredLocalOneTower : public ::testing::TestWithParam<std::pair<const char*, int>> {};

TEST_P(MirroredLocalOneTower, IsBitwiseTheHostStoresAsyncRun) {
  TOWERS_SKIP_WITHOUT_GPU();
  Recipe s;
  s.optimizer = GetParam().first;
  s.mode = Mode::Async;
  s.sync_every = GetParam().second;
  s.steps = 7;
  expect_mirrored_is_host(s);
}

// With state: the replica's running statistics fold in with its parameters.
TEST(MirroredLocal, OneTowerWithBatchNormIsBitwiseTheHostStoresAsyncRun) {
  TOWERS_SKIP_WITHOUT_GPU();
  Recipe s;
  s.model = bn_model();
  s.optimizer = "momentum";
  s.mode = Mode::Async;
  s.sync_every = 3;
  s.batch = 16;
  s.steps = 7;
  expect_mirrored_is_host(s);
}

INSTANTIATE_TEST_SUITE_P(
    Optimizers, MirroredLocalOneTower,
    ::testing::Values(std::make_pair("momentum", 1), std::make_pair("momentum", 3),
                      std::make_pair("adam", 3)),
    [](const auto& info) {
      return std::string(info.param.first) + "_every" + std::to_string(info.param.second);
    });

// Two towers on one GPU, driven by hand in a fixed order with K = 2, against the rule
// (mirrored_store.h): host <- w + (host - base), exactly w where host == base. Each replica's
// own steps are those of a one-tower store on the same batches (Adam counts its own steps).
TEST(MirroredLocal, TowersFoldTheirStepsIntoTheHostCopyByTheRule) {
  TOWERS_SKIP_WITHOUT_GPU();
  auto g = build_model("mlp");
  const int64_t b = 16, total = g->layout().total();
  TowerPlacement p;
  p.kind = DeviceKind::Cuda;
  std::vector<float> init(total);
  g->layout().initialize(init.data(), 1);
  // Four batches: tower 0 steps on 0 and 2, tower 1 on 1 and 3.
  std::vector<std::vector<float>> x(4, std::vector<float>(b * 28 * 28));
  std::vector<std::vector<int32_t>> y(4, std::vector<int32_t>(b));
  for (int k = 0; k < 4; ++k) {
    for (size_t j = 0; j < x[k].size(); ++j) x[k][j] = std::sin(0.37f * j + k);
    for (int64_t j = 0; j < b; ++j) y[k][j] = static_cast<int32_t>((j * 7 + k) % 10);
  }
  auto lr = [](int64_t) { return 0.05f; };
  auto read = [total](CudaTower& t) {
    std::vector<float> w(total);
    t.device().copy_out(w.data(), t.device_params(), total);
    return w;
  };
  // Each tower's replica on its own: a one-tower sync store, two steps.
  auto alone = [&](int first) {
    std::vector<float> params = init;
    Optimizer opt(g->layout(), {"adam"});
    CudaTower t(*g, b, p);
    MirroredParameterStore store(params.data(), opt, Reduce::Host, lr);
    store.attach({&t});
    for (int k = first; k < 4; k += 2) {
      store.pull(t);
      t.compute_gradients(x[k].data(), y[k].data(), b, 1.0f / b);
      UpdateRecord rec;
      rec.lr = lr(0);
      store.push(nullptr, rec, t);
    }
    store.detach();
    return params;
  };
  const std::vector<float> w0 = alone(0), w1 = alone(1);

  std::vector<float> params = init;
  Optimizer opt(g->layout(), {"adam"});
  CudaTower t0(*g, b, p), t1(*g, b, p);
  MirroredParameterStore store(params.data(), opt, Reduce::Host, lr, 2);
  ASSERT_EQ(store.access(), UpdateAccess::Concurrent);
  store.attach({&t0, &t1});
  store.restore_version(0);
  CudaTower* towers[2] = {&t0, &t1};
  std::vector<int64_t> read_at;
  auto step = [&](int i, int k) {
    read_at.push_back(store.pull(*towers[i]));
    towers[i]->compute_gradients(x[k].data(), y[k].data(), b, 1.0f / b);
    UpdateRecord rec;
    rec.tower = i;
    rec.lr = 99.0f;  // the store reports the lr the step applied
    const int64_t v = store.push(nullptr, rec, *towers[i]);
    EXPECT_EQ(rec.lr, 0.05f);
    return v;
  };
  EXPECT_EQ(step(0, 0), 1);
  EXPECT_EQ(step(1, 1), 2);
  EXPECT_TRUE(same_bits(params, init)) << "the host copy changed before any tower's K-th step";
  EXPECT_EQ(step(0, 2), 3);
  // Nothing else was folded in: the host copy is tower 0's replica, exactly.
  EXPECT_TRUE(same_bits(params, w0));
  EXPECT_EQ(step(1, 3), 4);
  std::vector<float> want(total);
  for (int64_t j = 0; j < total; ++j)
    want[j] = w0[j] == init[j] ? w1[j] : w1[j] + (w0[j] - init[j]);
  EXPECT_TRUE(same_bits(params, want));
  EXPECT_TRUE(same_bits(read(t1), want)) << "tower 1 took the host copy";
  EXPECT_TRUE(same_bits(read(t0), w0)) << "tower 0 keeps its replica until its next fold";
  // What each step's replica held: tower 1's first step saw none of tower 0's, and tower 1's
  // second read 1 (its own); tower 0 has since folded in tower 1's two steps.
  EXPECT_EQ(read_at, (std::vector<int64_t>{0, 0, 1, 1}));
  EXPECT_EQ(store.pull(t0), 2);
  EXPECT_EQ(store.pull(t1), 4);
  EXPECT_EQ(opt.updates(), 4);
  // Nothing is pending, so refreshing the host copy changes nothing.
  EXPECT_TRUE(same_bits(std::vector<float>(store.host_params(), store.host_params() + total), want));
  store.detach();
}

// No fold before the end (K above the steps): the host copy then folds every replica in, in
// tower order, by the rule, so it holds each tower's steps; none is lost.
TEST(MirroredLocal, TheEndFoldsEveryReplicaIn) {
  TOWERS_SKIP_WITHOUT_GPU();
  Recipe s;
  s.mirrored = true;
  s.optimizer = "sgd";
  s.mode = Mode::Async;
  s.towers = 3;
  s.sync_every = 100;
  s.batch = 16;
  s.steps = 12;
  const Trained r = train(s);
  ASSERT_EQ(r.replicas.size(), 3u);
  auto g = build_model(s.model);
  std::vector<float> host(r.params.size());
  g->layout().initialize(host.data(), 1);
  const std::vector<float> init = host;
  int moved = 0;
  for (const std::vector<float>& w : r.replicas) {
    moved += !same_bits(w, init);
    for (size_t j = 0; j < host.size(); ++j)
      host[j] = host[j] == init[j] ? w[j] : w[j] + (host[j] - init[j]);
  }
  EXPECT_EQ(moved, 3) << "every tower should have stepped";
  EXPECT_TRUE(same_bits(r.params, host));
}

// Free-running towers under the engine: every ticket pushed once, no step thrown away, and the
// host copy holds them all at the end.
TEST(MirroredLocal, AsyncAndSspTowersTrainUnderTheEngine) {
  TOWERS_SKIP_WITHOUT_GPU();
  for (Mode mode : {Mode::Async, Mode::Ssp}) {
    SCOPED_TRACE(mode_name(mode));
    Recipe s;
    s.mirrored = true;
    s.mode = mode;
    s.staleness = 1;
    s.towers = 3;
    s.sync_every = 2;
    s.batch = 16;
    s.steps = 30;
    s.lr = 0.5f;
    const Trained r = train(s);
    ASSERT_EQ(r.updates.size(), static_cast<size_t>(s.steps));
    EXPECT_EQ(r.optimizer_updates, s.steps);
    int64_t stale = 0;
    for (const UpdateRecord& u : r.updates) {
      EXPECT_GE(u.staleness, 0);
      EXPECT_FALSE(u.skipped);
      stale = std::max(stale, u.staleness);
    }
    // Any tower's first step after another tower's push misses it.
    EXPECT_GT(stale, 0);
    for (float p : r.params) ASSERT_TRUE(std::isfinite(p));
    auto mean_loss = [&](size_t from) {
      double sum = 0;
      for (size_t u = from; u < from + 6; ++u) sum += r.updates[u].loss;
      return sum / 6;
    };
    EXPECT_LT(mean_loss(r.updates.size() - 6), mean_loss(0));
  }
}

// End to end: the flag, checkpoints (the slots come back from the GPU) and resume.
const std::string kRun =
    "train --device cuda --model mlp --dataset synthetic --synthetic-size 2000 --batch 32 "
    "--optimizer adam --lr 0.01 --lr-schedule cosine --steps 12 --quiet --seed 5 ";

io::Checkpoint load(const std::string& dir,
                    const std::vector<std::string>& slots = {"m", "v"}) {
  const auto path = io::latest_checkpoint(dir);
  EXPECT_TRUE(path.has_value()) << dir;
  auto g = build_model("mlp");
  return io::load_checkpoint(path.value_or(""), g->layout(), slots);
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

// The recipe's wrappers with mirrored parameters: the averaged weights come back from the GPU
// into the checkpoint (and the evaluation), as the host run's.
TEST(MirroredCli, EmaAndLookaheadCheckpointLikeTheHostRun) {
  TOWERS_SKIP_WITHOUT_GPU();
  const std::string host = test_path("whost"), mirrored = test_path("wmirrored");
  const std::string run = kRun + "--ema 0.99 --lookahead 3 ";
  std::string out;
  ASSERT_EQ(run_towers(run + "--params host --metrics " + host + "/m.jsonl --checkpoint-dir " +
                           host, &out), 0) << out;
  ASSERT_EQ(run_towers(run + "--params mirrored --metrics " + mirrored +
                           "/m.jsonl --checkpoint-dir " + mirrored, &out), 0) << out;
  const std::vector<std::string> slots = {"m", "v", "ema", "lookahead"};
  EXPECT_TRUE(same_tensors(load(host, slots), load(mirrored, slots)));
  // The final evaluation reads the average: the same loss.
  const auto a = metrics_events(host + "/m.jsonl", "summary");
  const auto b = metrics_events(mirrored + "/m.jsonl", "summary");
  ASSERT_EQ(a.size(), 1u);
  ASSERT_EQ(b.size(), 1u);
  EXPECT_EQ(a[0]["test_loss"], b[0]["test_loss"]);
}

// --clip-grad-norm and --on-divergence skip-step through the CLI: the GPU measures and clips
// each update as the host does, for one tower and for two on one GPU, with the same checkpoint
// and the same norms in the step records.
TEST(MirroredCli, ClipGradNormIsBitwiseTheHostRun) {
  TOWERS_SKIP_WITHOUT_GPU();
  for (const char* towers : {"1", "2"}) {
    SCOPED_TRACE(testing::Message() << towers << " tower(s)");
    const std::string host = test_path(std::string("chost") + towers),
                      mirrored = test_path(std::string("cmirrored") + towers);
    const std::string run = kRun + "--clip-grad-norm 0.5 --on-divergence skip-step --towers " +
                            towers + " --gpus 1 ";
    std::string out;
    ASSERT_EQ(run_towers(run + "--params host --metrics " + host + ".jsonl --checkpoint-dir " +
                             host, &out), 0) << out;
    ASSERT_EQ(run_towers(run + "--params mirrored --metrics " + mirrored +
                             ".jsonl --checkpoint-dir " + mirrored, &out), 0) << out;
    EXPECT_TRUE(same_tensors(load(host), load(mirrored)));
    const auto a = metrics_events(host + ".jsonl", "step"), b = metrics_events(mirrored + ".jsonl", "step");
    ASSERT_EQ(a.size(), b.size());
    int clipped = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      ASSERT_TRUE(a[i].contains("grad_norm") && a[i]["grad_norm"].is_number()) << a[i].dump();
      EXPECT_EQ(a[i]["grad_norm"], b[i]["grad_norm"]) << "step " << i;
      clipped += a[i]["grad_norm"].get<double>() > 0.5;
    }
    EXPECT_GT(clipped, 0) << "no update was clipped";
  }
}

// One async tower with --sync-every: the host run's checkpoints, and a stopped and resumed run
// restarts its replica from the checkpoint (the folds at the checkpoints change nothing).
TEST(MirroredCli, AsyncWithSyncEveryCheckpointsAndResumesLikeTheHostRun) {
  TOWERS_SKIP_WITHOUT_GPU();
  const std::string host = test_path("ahost"), mirrored = test_path("amirrored"),
                    resumed = test_path("aresumed"), m = test_path("am.jsonl");
  const std::string run = kRun + "--mode async --checkpoint-every 0.1 ";
  std::string out;
  ASSERT_EQ(run_towers(run + "--params host --checkpoint-dir " + host, &out), 0) << out;
  ASSERT_EQ(run_towers(run + "--params mirrored --sync-every 4 --metrics " + m +
                           " --checkpoint-dir " + mirrored, &out), 0) << out;
  EXPECT_TRUE(same_tensors(load(host), load(mirrored)));
  auto config = metrics_events(m, "config");
  ASSERT_EQ(config.size(), 1u);
  EXPECT_EQ(config[0]["config"]["sync_every"], 4);
  ASSERT_EQ(run_towers(run + "--params mirrored --sync-every 4 --stop-at-step 5 --checkpoint-dir " +
                           resumed, &out), 0) << out;
  ASSERT_EQ(run_towers(run + "--params mirrored --sync-every 4 --resume --checkpoint-dir " +
                           resumed, &out), 0) << out;
  EXPECT_TRUE(same_tensors(load(mirrored), load(resumed)));
  // Two towers train to the end.
  ASSERT_EQ(run_towers(run + "--params mirrored --towers 2 --sync-every 3", &out), 0) << out;
}

// --backward-branches through the CLI, the engine and the mirrored store (the update inside the
// step's graph after the joined branches): a sync run of two towers on one GPU ends with the
// checkpoint of the same run on one stream, bit for bit, and its config records the flag.
TEST(MirroredCli, BackwardBranchesTrainBitwiseLikeOneStream) {
  TOWERS_SKIP_WITHOUT_GPU();
  const std::string one = test_path("one"), two = test_path("two"), m = test_path("m.jsonl");
  const std::string run = kRun + "--params mirrored --towers 2 --gpus 1 ";
  std::string out;
  ASSERT_EQ(run_towers(run + "--checkpoint-dir " + one, &out), 0) << out;
  ASSERT_EQ(run_towers(run + "--backward-branches --metrics " + m + " --checkpoint-dir " + two,
                       &out), 0) << out;
  EXPECT_TRUE(same_tensors(load(one), load(two)));
  auto config = metrics_events(m, "config");
  ASSERT_EQ(config.size(), 1u);
  EXPECT_EQ(config[0]["config"]["backward_branches"], true);
}

TEST(MirroredCli, TowersOnSeveralGpusWithoutNcclAreAClearError) {
  TOWERS_SKIP_WITHOUT_GPU();
  const size_t have = list_gpus().gpus.size();
  if (have < 2) TOWERS_SKIP_FOR_GPU_COUNT(2, have);  // towers on several GPUs
  const std::string m = test_path("m.jsonl");
  std::string out;
  EXPECT_EQ(run_towers(kRun + "--params mirrored --towers 2 --gpus 2 --metrics " + m, &out), 1);
  EXPECT_NE(out.find("add --reduce nccl"), std::string::npos) << out;
  EXPECT_FALSE(std::filesystem::exists(m));
}

}  // namespace
}  // namespace towers
