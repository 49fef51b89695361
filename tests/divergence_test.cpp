// divergence_test.cpp — the gradient guard: --on-divergence stop|skip-step and
// --clip-grad-norm, end to end through the CLI, in sync and async mode.
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli_util.h"
#include "io/checkpoint.h"
#include "models/models.h"

namespace towers {
namespace {

using testutil::metrics_events;
using testutil::run_towers;
using testutil::test_path;

// 40 steps an epoch.
const std::string kMlp =
    "train --model mlp --dataset synthetic --synthetic-size 2000 --batch 50 --quiet --seed 5 ";

std::vector<float> params_at(const std::string& dir, int64_t step) {
  auto g = build_model("mlp");
  const auto ck =
      io::load_checkpoint(fmt::format("{}/ckpt-{:09d}.safetensors", dir, step), g->layout(), {});
  return {ck.params.data(), ck.params.data() + ck.params.size()};
}

// The update with the non-finite loss is never applied: every checkpoint, the last one
// included, holds finite parameters.
TEST(Divergence, StopEndsTheRunAtTheFirstNonFiniteLossAndKeepsTheParametersFinite) {
  const std::string dir = test_path("ck");
  std::string out;
  const int rc = run_towers(kMlp + "--steps 40 --lr 1e6 --checkpoint-every 0.025 "
                            "--keep-checkpoints 100 --checkpoint-dir " + dir, &out);
  EXPECT_EQ(rc, 1) << out;
  EXPECT_NE(out.find("training diverged at step"), std::string::npos) << out;
  EXPECT_NE(out.find("--on-divergence skip-step"), std::string::npos) << out;
  const auto last = io::latest_checkpoint(dir);
  ASSERT_TRUE(last.has_value()) << out;
  auto g = build_model("mlp");
  const auto ck = io::load_checkpoint(*last, g->layout(), {});
  for (int64_t i = 0; i < ck.params.size(); ++i)
    ASSERT_TRUE(std::isfinite(ck.params.data()[i])) << *last << " at " << i;
}

TEST(Divergence, SkipStepGoesOnAndRecordsEverySkippedUpdate) {
  for (const std::string mode : {"--mode sync --towers 2", "--mode async --towers 2"}) {
    SCOPED_TRACE(mode);
    const std::string m = test_path("m.jsonl");
    std::string out;
    const int rc =
        run_towers(kMlp + mode + " --steps 40 --lr 1e6 --on-divergence skip-step --metrics " + m,
                   &out);
    ASSERT_EQ(rc, 0) << out;
    const auto steps = metrics_events(m, "step");
    const auto summary = metrics_events(m, "summary").at(0);
    ASSERT_EQ(steps.size(), 40u);  // every version once: a skipped update still makes one
    std::vector<bool> seen(41, false);
    int64_t skipped = 0;
    for (const auto& s : steps) {
      const int64_t v = s["step"].get<int64_t>();
      ASSERT_TRUE(v >= 1 && v <= 40 && !seen[v]) << s.dump();
      seen[v] = true;
      if (s.value("skipped", false)) {
        ++skipped;
        // Only a non-finite loss or gradient is skipped.
        EXPECT_TRUE(s["loss"].is_null() || s["grad_norm"].is_null()) << s.dump();
      } else {
        EXPECT_TRUE(s["loss"].is_number()) << s.dump();
      }
    }
    EXPECT_GT(skipped, 0);
    EXPECT_EQ(summary["skipped_steps"].get<int64_t>(), skipped);
    EXPECT_EQ(summary["steps"].get<int64_t>(), 40);
  }
}

TEST(Divergence, AHugeClipBoundChangesNothing) {
  const std::string a = test_path("a"), b = test_path("b");
  const std::string run = kMlp + "--steps 20 --optimizer momentum --lr 0.05 --checkpoint-dir ";
  ASSERT_EQ(run_towers(run + a), 0);
  ASSERT_EQ(run_towers(run + b + " --clip-grad-norm 1e30"), 0);
  const auto pa = params_at(a, 20), pb = params_at(b, 20);
  ASSERT_EQ(pa.size(), pb.size());
  EXPECT_EQ(std::memcmp(pa.data(), pb.data(), sizeof(float) * pa.size()), 0);
}

// With plain SGD, no weight decay (the mlp has none) and lr 1, an update moves the parameters by
// exactly the clipped gradient: its norm is the bound whenever the gradient's norm is above it.
// Four threads: the clipped copy is written by every thread of the tower.
TEST(Divergence, ClippedUpdatesHaveTheBoundAsTheirNorm) {
  const std::string dir = test_path("ck"), m = test_path("m.jsonl");
  const double bound = 0.01;
  ASSERT_EQ(run_towers(kMlp + "--steps 3 --threads-per-tower 4 --optimizer sgd --lr 1 "
                       "--clip-grad-norm 0.01 "
                       "--checkpoint-every 0.025 --keep-checkpoints 5 --checkpoint-dir " + dir +
                       " --metrics " + m),
            0);
  const auto steps = metrics_events(m, "step");
  ASSERT_EQ(steps.size(), 3u);
  for (int64_t v = 2; v <= 3; ++v) {
    const double norm = steps[v - 1]["grad_norm"].get<double>();
    ASSERT_GT(norm, bound) << "the test needs gradients above the bound";
    const auto w0 = params_at(dir, v - 1), w1 = params_at(dir, v);
    double d = 0.0;
    for (size_t i = 0; i < w0.size(); ++i) {
      const double e = static_cast<double>(w1[i]) - w0[i];
      d += e * e;
    }
    EXPECT_NEAR(std::sqrt(d), bound, 1e-3 * bound) << "step " << v;
  }
}

// Clipping every update keeps sync runs bitwise reproducible, whatever the threads.
TEST(Divergence, ClippedSyncRunsAreBitwiseReproducible) {
  const std::string a = test_path("a"), b = test_path("b");
  const std::string run =
      kMlp + "--steps 20 --towers 2 --optimizer momentum --lr 0.05 --clip-grad-norm 0.001 "
             "--checkpoint-dir ";
  ASSERT_EQ(run_towers(run + a + " --threads-per-tower 3"), 0);
  ASSERT_EQ(run_towers(run + b + " --threads-per-tower 1"), 0);
  const auto pa = params_at(a, 20), pb = params_at(b, 20);
  ASSERT_EQ(pa.size(), pb.size());
  EXPECT_EQ(std::memcmp(pa.data(), pb.data(), sizeof(float) * pa.size()), 0);
}

TEST(Divergence, BadGuardFlagsAreClearErrors) {
  std::string out;
  EXPECT_EQ(run_towers(kMlp + "--steps 5 --on-divergence ignore", &out), 1);
  EXPECT_NE(out.find("--on-divergence"), std::string::npos) << out;
  EXPECT_EQ(run_towers(kMlp + "--steps 5 --clip-grad-norm -1", &out), 1);
  EXPECT_NE(out.find("--clip-grad-norm"), std::string::npos) << out;
}

}  // namespace
}  // namespace towers
