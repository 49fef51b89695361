// The tower engine's invariants, run end to end through `towers train` and its metrics:
// N sync towers equal one tower with N times the batch; sync runs are bitwise reproducible;
// the SSP bound holds (and the check can fail: async breaks it); backup towers drop a
// straggler's late gradients instead of waiting; async towers all apply their updates.
#include <sys/wait.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include "cli_util.h"
#include "io/checkpoint.h"
#include "models/models.h"

namespace towers {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

using testutil::max_lead;
using testutil::metrics_events;
using testutil::run_towers;
using testutil::test_path;

// MLP on synthetic data: fast enough to run many steps in a test.
const std::string kMlp =
    "train --model mlp --dataset synthetic --synthetic-size 3000 --optimizer momentum --lr 0.02 "
    "--quiet --seed 3 ";

TEST(Engine, TwoSyncTowersOfHalfTheBatchEqualOneTower) {
  // The bar: fashion net on Fashion-MNIST, 2 x 64 versus 1 x 128, 50 steps.
  const std::string fashion = "/usr/share/datasets/fashion-mnist";
  if (!fs::exists(fashion)) GTEST_SKIP() << "no Fashion-MNIST at " << fashion;
  const std::string one = test_path("one.jsonl"), two = test_path("two.jsonl");
  const std::string base = "train --model fashion --dataset fashion-mnist --steps 50 --quiet --lr 0.01 ";
  const std::string ck1 = test_path("ck1"), ck2 = test_path("ck2");
  ASSERT_EQ(run_towers(base + "--towers 1 --batch 128 --checkpoint-dir " + ck1 + " --metrics " + one), 0);
  ASSERT_EQ(run_towers(base + "--towers 2 --batch 64 --mode sync --checkpoint-dir " + ck2 + " --metrics " + two), 0);
  auto a = metrics_events(one, "step"), b = metrics_events(two, "step");
  ASSERT_EQ(a.size(), 50u);
  ASSERT_EQ(b.size(), 50u);
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double la = a[i]["loss"], lb = b[i]["loss"];
    worst = std::max(worst, std::fabs(la - lb) / std::fabs(la));
  }
  EXPECT_LT(worst, 1e-4) << "largest relative loss difference over 50 steps";
  // Stronger than the bar: the chunk and tower reductions form one tree (kernels/reduce.h), so
  // the parameters after 50 updates are bitwise equal; only the reported loss, a double sum
  // over towers, may differ in its last bits.
  EXPECT_LT(worst, 1e-12);
  auto g = build_model("fashion");
  auto p1 = io::load_checkpoint(ck1 + "/ckpt-000000050.safetensors", g->layout(), {"momentum"});
  auto p2 = io::load_checkpoint(ck2 + "/ckpt-000000050.safetensors", g->layout(), {"momentum"});
  EXPECT_EQ(std::memcmp(p1.params.data(), p2.params.data(), sizeof(float) * g->layout().total()), 0);
  // The loss moved: the comparison is not of 50 copies of the initial loss.
  EXPECT_LT(a.back()["loss"].get<double>(), 0.8 * a.front()["loss"].get<double>());
}

TEST(Engine, SyncRunsWithOneSeedAreIdentical) {
  const std::string a = test_path("a.jsonl"), b = test_path("b.jsonl");
  const std::string args = kMlp + "--steps 40 --towers 3 --batch 16 --mode sync --metrics ";
  ASSERT_EQ(run_towers(args + a), 0);
  ASSERT_EQ(run_towers(args + b), 0);
  auto x = metrics_events(a, "step"), y = metrics_events(b, "step");
  ASSERT_EQ(x.size(), 40u);
  ASSERT_EQ(y.size(), 40u);
  for (size_t i = 0; i < x.size(); ++i) EXPECT_EQ(x[i]["loss"], y[i]["loss"]) << "step " << i + 1;
  EXPECT_EQ(metrics_events(a, "summary")[0]["test_loss"], metrics_events(b, "summary")[0]["test_loss"]);
}

TEST(Engine, SspBoundIsNeverExceeded) {
  // Tower 0 is always late (--slow-tower 0:late: it holds each gradient until the others
  // wait for it at the bound, whatever the machine's load), so the bound binds every time.
  for (int s : {0, 2}) {
    const std::string m = test_path("ssp" + std::to_string(s) + ".jsonl");
    ASSERT_EQ(
        run_towers(kMlp +
                   "--steps 60 --towers 3 --batch 16 --mode ssp --slow-tower 0:late --staleness " +
                   std::to_string(s) + " --metrics " + m),
        0);
    auto steps = metrics_events(m, "step");
    ASSERT_EQ(steps.size(), 60u);
    // A tower starts a step only while at most s steps ahead, so completed steps differ by at
    // most s + 1; and the slow tower makes the bound bind.
    EXPECT_LE(max_lead(steps, 3), s + 1) << "staleness " << s;
    EXPECT_EQ(max_lead(steps, 3), s + 1) << "the bound never bound: the test proves nothing";
    // Staleness (version at apply - version read): while a tower computes one step, each of
    // the other N - 1 towers can apply at most 2S + 1 updates (its lead of S + 1 over the
    // slowest, from either side of the reader's step), so (N - 1)(2S + 1) is the bound a
    // scheduler cannot break, however it stalls a thread.
    EXPECT_LE(metrics_events(m, "summary")[0]["max_staleness"].get<int64_t>(), 2 * (2 * s + 1));
  }
  // The same run without a bound leaves the slow tower far behind: the check above can fail.
  const std::string m = test_path("async.jsonl");
  ASSERT_EQ(run_towers(kMlp + "--steps 60 --towers 3 --batch 16 --mode async --slow-tower 0:15 --metrics " + m), 0);
  EXPECT_GT(max_lead(metrics_events(m, "step"), 3), 5);
}

TEST(Engine, BackupTowersDropAStragglerInsteadOfWaiting) {
  const std::string k2 = test_path("k2.jsonl"), k3 = test_path("k3.jsonl");
  const std::string args = kMlp + "--steps 40 --towers 3 --batch 16 --mode sync ";
  // With 2 of 3, a straggler that is always late (--slow-tower 2:late: it holds each gradient
  // until its version has been applied without it, whatever the machine's load) is in no
  // update: its gradients are dropped and counted, and nothing waits for it.
  ASSERT_EQ(run_towers(args + "--slow-tower 2:late --replicas-to-aggregate 2 --metrics " + k2), 0);
  auto backup = metrics_events(k2, "summary")[0];
  EXPECT_EQ(backup["steps"], 40);
  for (const auto& s : metrics_events(k2, "step")) EXPECT_EQ(s["contributors"], 2);
  const json& t = backup["towers"];
  for (int i : {0, 1}) {  // in every update, and no step after the last one
    EXPECT_EQ(t[i]["applied"], 40) << backup.dump();
    EXPECT_EQ(t[i]["steps"], 40) << backup.dump();
  }
  EXPECT_EQ(t[2]["applied"], 0) << backup.dump();
  EXPECT_GE(t[2]["dropped"].get<int64_t>(), 1) << backup.dump();
  EXPECT_EQ(t[2]["dropped"], t[2]["steps"]) << backup.dump();
  EXPECT_EQ(backup["dropped_gradients"], t[2]["dropped"]) << backup.dump();
  // With 3 of 3 a straggler (150 ms a step) is in every update: every update waited for it.
  ASSERT_EQ(run_towers(args + "--slow-tower 2:150 --replicas-to-aggregate 3 --metrics " + k3), 0);
  auto all = metrics_events(k3, "summary")[0];
  EXPECT_EQ(all["towers"][2]["applied"], 40);
  EXPECT_EQ(all["dropped_gradients"], 0);
}

TEST(Engine, AsyncTowersEachApplyAndLearn) {
  for (const std::string locking : {"", "--use-locking "}) {
    const std::string m = test_path("async.jsonl");
    ASSERT_EQ(run_towers(kMlp + "--epochs 2 --towers 3 --batch 16 --mode async " + locking + "--metrics " + m), 0);
    auto sum = metrics_events(m, "summary")[0];
    const int64_t steps = sum["steps"];
    EXPECT_EQ(steps, 375);  // ceil(2 * 3000 / 16): one update per tower step
    int64_t hist = 0, applied = 0;
    for (auto& [k, v] : sum["staleness_histogram"].items()) hist += v.get<int64_t>();
    for (const auto& t : sum["towers"]) {
      applied += t["applied"].get<int64_t>();
      EXPECT_GT(t["applied"].get<int64_t>(), 0);
    }
    EXPECT_EQ(hist, steps);
    EXPECT_EQ(applied, steps);
    EXPECT_GT(sum["test_accuracy"].get<double>(), 0.9) << locking;
  }
}

TEST(Engine, StalenessAwareLrDividesByTheStaleness) {
  const std::string m = test_path("aware.jsonl");
  // A slow tower makes its gradients several versions stale, so the division shows. Every
  // tower sleeps, the slow one 6 times longer, so that the ratio of their step times (not the
  // speed of the machine or the build) decides: the others make several updates during each of
  // its steps, and the run lasts long enough for it to apply some.
  ASSERT_EQ(run_towers(kMlp + "--steps 60 --towers 3 --batch 16 --mode async --staleness-aware-lr "
                "--slow-tower 0:60 --slow-tower 1:10 --slow-tower 2:10 --metrics " + m), 0);
  int64_t most = 0;
  for (const auto& s : metrics_events(m, "step")) {
    const double k = std::max<int64_t>(1, s["staleness"].get<int64_t>());
    EXPECT_NEAR(s["lr"].get<double>() * k, 0.02, 1e-7);
    most = std::max(most, s["staleness"].get<int64_t>());
  }
  EXPECT_GE(most, 2) << "no update was stale enough to test the rule";
}

TEST(Engine, TheScheduleFollowsEpochsForAnyNumberOfTowers) {
  // Exponential decay every epoch: at a given epoch, 1 and 4 sync towers use the same lr,
  // though 4 towers take a quarter of the steps.
  std::map<int, std::vector<std::pair<double, double>>> seen;
  for (int n : {1, 4}) {
    const std::string m = test_path("sched" + std::to_string(n) + ".jsonl");
    ASSERT_EQ(run_towers(kMlp + "--epochs 3 --batch 25 --lr-schedule exponential --decay-epochs 1 "
                  "--decay-factor 0.5 --mode sync --towers " + std::to_string(n) + " --metrics " + m), 0);
    for (const auto& s : metrics_events(m, "step")) {
      // lr of the update that ended at `epoch` was chosen at its start
      const double start_epoch = s["epoch"].get<double>() - 25.0 * n / 3000.0;
      EXPECT_NEAR(s["lr"].get<double>(), 0.02 * std::pow(0.5, std::floor(start_epoch + 1e-9)), 1e-7);
      seen[n].emplace_back(start_epoch, s["lr"].get<double>());
    }
  }
  EXPECT_EQ(seen[1].size(), 4 * seen[4].size());
  // --lr-scaling linear is the opt-in that changes it.
  const std::string m = test_path("linear.jsonl");
  ASSERT_EQ(run_towers(kMlp + "--steps 2 --batch 25 --towers 4 --lr-scaling linear --metrics " + m), 0);
  EXPECT_NEAR(metrics_events(m, "step")[0]["lr"].get<double>(), 0.08, 1e-7);
}

TEST(Engine, UnevenDatasetsNeverHang) {
  // 1001 examples, 3 towers of 7: no batch boundary meets an epoch boundary.
  for (const std::string mode : {"sync", "async", "ssp --staleness 1"}) {
    std::string out;
    EXPECT_EQ(run_towers("train --model mlp --dataset synthetic --synthetic-size 1001 --quiet --batch 7 "
                  "--towers 3 --epochs 2 --mode " + mode, &out), 0)
        << mode << ": " << out;
  }
}

}  // namespace
}  // namespace towers
