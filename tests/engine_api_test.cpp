// The engine's invariants in process, against TowerGroup and LocalParameterStore, with towers
// whose gradients are small integers scaled by a power of two: every sum and average is then
// exact in float, in any order, so the checks are exact equalities about the engine (slicing,
// averaging, applying, gating, dropping), independent of BLAS or summation order. The CLI
// tests (engine_test.cpp) check the same invariants end to end with real towers.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "cli_util.h"
#include "core/device.h"
#include "core/relaxed.h"
#include "data/augment.h"
#include "data/synthetic.h"
#include "models/models.h"
#include "optim/optimizer.h"
#include "towers/parameter_store.h"
#include "towers/tower_group.h"

namespace towers {
namespace {

// A tower whose gradient for a batch is, per element j, grad_scale * sum over its examples of
// (label + 1 + p) * ((j % 5) - 2), where p (0..3) is read off parameter 0 as pulled: integers times
// 1 / (a power of two), exact in float, and a pull of another version than the engine's
// changes it. The loss sum is the sum of the labels; correct counts the even labels. Towers in
// `slow` sleep `slow_ms` after each step, to make stragglers.
std::atomic<int64_t> steps_computed{0};  // compute_gradients calls of every IntegerTower

class IntegerTower final : public Tower {
 public:
  IntegerTower(const Graph& g, int64_t max_batch, int index, std::vector<int> slow, int slow_ms)
      : Tower(g, max_batch), cpu_(1), grads_(g.layout().total()), index_(index),
        slow_(std::move(slow)), slow_ms_(slow_ms) {}
  Device& device() override { return cpu_; }
  CpuDevice& host() override { return cpu_; }
  const float* grads() const override { return grads_.data(); }
  float* mutable_grads() override { return grads_.data(); }
  void load_params(const float* host) override { p_ = small(host[0]); }
  void load_params_shared(const float* host) override {
    float p0 = 0;
    load_relaxed(host, &p0, 1);
    p_ = small(p0);
  }
  StepStats compute_gradients(const float*, const int32_t* labels, int64_t n,
                              float grad_scale) override {
    ++steps_computed;
    int64_t weight = 0, correct = 0;
    double loss = 0;
    for (int64_t e = 0; e < n; ++e) {
      weight += labels[e] + 1 + p_;
      loss += labels[e];
      correct += labels[e] % 2 == 0;
    }
    for (size_t j = 0; j < grads_.size(); ++j)
      grads_[j] = grad_scale * static_cast<float>(weight * (static_cast<int64_t>(j % 5) - 2));
    if (std::find(slow_.begin(), slow_.end(), index_) != slow_.end())
      std::this_thread::sleep_for(std::chrono::milliseconds(slow_ms_));
    return StepStats{loss, correct, n};
  }
  StepStats evaluate(const float*, const int32_t*, int64_t n) override { return {0, 0, n}; }
  void copy_logits(float* out, int64_t n) override { std::fill(out, out + n * 10, 0.0f); }

 private:
  CpuDevice cpu_;
  std::vector<float> grads_;
  // 0..3 from parameter 0, which the updates move by multiples of 1/64: bounded, so the
  // gradients cannot feed back into growth.
  static int64_t small(float p0) {
    return static_cast<int64_t>(std::fmod(std::fabs(static_cast<double>(p0)) * 64.0, 4.0));
  }
  int64_t p_ = 0;
  int index_;
  std::vector<int> slow_;
  int slow_ms_;
};

struct GroupRun {
  std::vector<float> params;
  std::vector<UpdateRecord> updates;
  std::vector<int64_t> contributed, dropped, steps;
};

// Runs `updates` updates of plain SGD (lr 1/8) on the mlp layout with integer towers.
GroupRun run_group(EngineConfig ec, int64_t batch, int64_t updates, std::vector<int> slow = {},
              int slow_ms = 0) {
  auto g = build_model("mlp");
  const data::DataSplit d = data::make_synthetic(1, 28, 28, 10, 2048, 64, 5);
  const data::AugmentConfig aug = data::tutorial_eval_config(28);
  GroupRun r;
  r.params.resize(g->layout().total());
  g->layout().initialize(r.params.data(), 1);
  Optimizer opt(g->layout(), {"sgd"});
  LocalParameterStore store(r.params.data(), opt, store_access(ec), store_locking(ec), false);
  int made = 0;
  TowerGroup group(*g, ec, batch, store,
                   [&](const Graph& graph, int64_t max_batch, const TowerPlacement&) {
                     return std::make_unique<IntegerTower>(graph, max_batch, made++, slow, slow_ms);
                   });
  RunHooks hooks;
  hooks.lr_at = [](int64_t) { return 0.125f; };
  hooks.on_update = [&](const UpdateRecord& u) {
    r.updates.push_back(u);  // called under the group's record lock
    return false;
  };
  hooks.side_work = [](int64_t) {};
  hooks.stop_requested = [] { return false; };
  group.run(d.train, aug, 7, 0, updates, 0, hooks);
  const nlohmann::json towers = group.stats().to_json(1.0)["towers"];
  for (const auto& t : towers) {
    r.contributed.push_back(t["applied"].get<int64_t>());
    r.dropped.push_back(t["dropped"].get<int64_t>());
    r.steps.push_back(t["steps"].get<int64_t>());
  }
  return r;
}

EngineConfig config(Mode mode, int towers) {
  EngineConfig ec;
  ec.mode = mode;
  ec.towers = towers;
  ec.threads_per_tower = 1;
  return ec;
}

TEST(EngineApi, SyncTowersOfASliceEqualOneTowerOfTheWholeBatchBitwise) {
  const GroupRun one = run_group(config(Mode::Sync, 1), 32, 12);
  for (int n : {2, 4}) {
    const GroupRun many = run_group(config(Mode::Sync, n), 32 / n, 12);
    ASSERT_EQ(many.updates.size(), 12u);
    EXPECT_EQ(std::memcmp(one.params.data(), many.params.data(), sizeof(float) * one.params.size()),
              0)
        << n << " towers";
    for (size_t u = 0; u < 12; ++u) {
      EXPECT_EQ(many.updates[u].loss, one.updates[u].loss) << n << " towers, update " << u;
      EXPECT_EQ(many.updates[u].correct, one.updates[u].correct);
      EXPECT_EQ(many.updates[u].contributors, n);
    }
  }
  // The check can fail: a different global batch gives different parameters.
  const GroupRun other = run_group(config(Mode::Sync, 1), 16, 12);
  EXPECT_NE(std::memcmp(one.params.data(), other.params.data(), sizeof(float) * one.params.size()),
            0);
}

// The largest lead of any tower over the slowest, replayed from the run's updates.
int64_t max_lead(const std::vector<UpdateRecord>& updates, int towers) {
  std::vector<int> tower_of_update;
  for (const UpdateRecord& u : updates) tower_of_update.push_back(u.tower);
  return testutil::max_lead(tower_of_update, towers);
}

// Async and SSP hand out an update's ticket when its step starts, so every step that starts is
// pushed: no gradient is computed and dropped at the end (a store that applies inside the
// step, mirrored parameters, could not take such a step back).
TEST(EngineApi, FreeRunningTowersComputeExactlyTheStepsTheyPush) {
  for (Mode mode : {Mode::Async, Mode::Ssp}) {
    EngineConfig ec = config(mode, 3);
    ec.staleness = 2;
    steps_computed = 0;
    const GroupRun r = run_group(ec, 8, 20, {1}, 5);  // tower 1 straggles
    ASSERT_EQ(r.updates.size(), 20u) << mode_name(mode);
    EXPECT_EQ(steps_computed.load(), 20) << mode_name(mode);
  }
}

TEST(EngineApi, SspLeadNeverExceedsItsBoundAndTheBoundBinds) {
  for (int64_t s : {0, 1, 3}) {
    EngineConfig ec = config(Mode::Ssp, 3);
    ec.staleness = s;
    // Tower 0 sleeps 20 ms a step, the others none: without the gate their lead would grow
    // by about every step they take.
    const GroupRun r = run_group(ec, 8, 60, {0}, 20);
    ASSERT_EQ(r.updates.size(), 60u);
    EXPECT_EQ(max_lead(r.updates, 3), s + 1) << "staleness " << s;
    for (const UpdateRecord& u : r.updates) EXPECT_LE(u.staleness, 2 * (2 * s + 1));
  }
  // The check can fail: async with a slower straggler (100 ms, so that starved threads on a
  // loaded machine still race ahead) has no gate, and its lead passes the largest bound above.
  const GroupRun a = run_group(config(Mode::Async, 3), 8, 60, {0}, 100);
  EXPECT_GT(max_lead(a.updates, 3), 4);
}

TEST(EngineApi, BackupTowersDropExactlyTheLateGradients) {
  EngineConfig ec = config(Mode::Sync, 3);
  ec.replicas_to_aggregate = 2;
  ec.late_towers = {2};  // always late, whatever the machine's load
  const GroupRun r = run_group(ec, 8, 20);
  ASSERT_EQ(r.updates.size(), 20u);
  int64_t contributed = 0;
  for (const UpdateRecord& u : r.updates) EXPECT_EQ(u.contributors, 2);
  for (int t = 0; t < 3; ++t) {
    contributed += r.contributed[t];
    EXPECT_EQ(r.contributed[t] + r.dropped[t], r.steps[t])
        << "tower " << t << ": every gradient is either averaged or dropped";
  }
  EXPECT_EQ(contributed, 2 * 20) << "every update averages exactly K gradients";
  // The straggler is late for the version it read: its gradients are dropped, never waited
  // for, and the other two make every update.
  EXPECT_EQ(r.contributed[2], 0);
  EXPECT_GE(r.dropped[2], 1);
  for (int t : {0, 1}) {  // in every update, and no step after the last one
    EXPECT_EQ(r.contributed[t], 20);
    EXPECT_EQ(r.steps[t], 20);
  }
}

}  // namespace
}  // namespace towers
