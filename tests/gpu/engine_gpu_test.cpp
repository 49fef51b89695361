// The engine's invariants on GPU towers, end to end through `towers train --device cuda`:
// N sync towers match one tower of N times the batch, sync runs are reproducible, the SSP
// bound holds with several towers sharing one GPU, backup towers drop a straggler, NCCL
// averaging matches host averaging (or is refused with one GPU), and Fashion-MNIST trains to
// at least 90% test accuracy on a GPU.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "cli_util.h"
#include "core/gpu.h"
#include "gpu_test_util.h"

namespace towers {
namespace {

using nlohmann::json;
using testutil::max_lead;
using testutil::metrics_events;
using testutil::run_towers;
using testutil::test_path;

const std::string kMlp =
    "train --device cuda --model mlp --dataset synthetic --synthetic-size 3000 --optimizer "
    "momentum --lr 0.02 --quiet --seed 3 ";


// The engine's invariants with the quick `mlp` and with the `cifar10` net, whose GPU paths
// (convolutions, pooling, LRN, several streams of copies) are the ones that matter.
class EngineGpuModels : public ::testing::TestWithParam<const char*> {
 protected:
  bool mlp() const { return std::string(GetParam()) == "mlp"; }
  std::string base() const {
    return mlp() ? kMlp
                 : "train --device cuda --model cifar10 --dataset synthetic --synthetic-size 1024 "
                   "--optimizer momentum --lr 0.01 --quiet --seed 3 ";
  }
};

TEST_P(EngineGpuModels, TwoSyncTowersOfHalfTheBatchMatchOneTower) {
  TOWERS_SKIP_WITHOUT_GPU();
  const std::string one = test_path("one.jsonl"), two = test_path("two.jsonl");
  // cifar10: fewer steps, since rounding differences grow as training goes on.
  const size_t steps = mlp() ? 40 : 10;
  const std::string base = this->base() + "--steps " + std::to_string(steps) + " ";
  std::string out;
  ASSERT_EQ(run_towers(base + "--towers 1 --batch 64 --metrics " + one, &out), 0) << out;
  ASSERT_EQ(run_towers(base + "--towers 2 --batch 32 --mode sync --metrics " + two, &out), 0) << out;
  auto a = metrics_events(one, "step"), b = metrics_events(two, "step");
  ASSERT_EQ(a.size(), steps);
  ASSERT_EQ(b.size(), steps);
  // Not bitwise, unlike the CPU: cuBLAS sums a batch of 64 and two of 32 in different orders.
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i)
    worst = std::max(worst, std::fabs(a[i]["loss"].get<double>() - b[i]["loss"].get<double>()) /
                                std::fabs(a[i]["loss"].get<double>()));
  EXPECT_LT(worst, 1e-4);
  if (mlp()) EXPECT_LT(a.back()["loss"].get<double>(), 0.8 * a.front()["loss"].get<double>());
}

TEST_P(EngineGpuModels, SyncRunsWithOneSeedAreIdentical) {
  TOWERS_SKIP_WITHOUT_GPU();
  const std::string a = test_path("a.jsonl"), b = test_path("b.jsonl");
  const std::string args = base() + "--steps 30 --towers 3 --batch 16 --mode sync --metrics ";
  ASSERT_EQ(run_towers(args + a), 0);
  ASSERT_EQ(run_towers(args + b), 0);
  auto x = metrics_events(a, "step"), y = metrics_events(b, "step");
  ASSERT_EQ(x.size(), 30u);
  ASSERT_EQ(y.size(), x.size());
  for (size_t i = 0; i < x.size(); ++i) EXPECT_EQ(x[i]["loss"], y[i]["loss"]) << "step " << i + 1;
}

TEST_P(EngineGpuModels, SspBoundHoldsWithTowersSharingAGpu) {
  TOWERS_SKIP_WITHOUT_GPU();
  const std::string m = test_path("ssp.jsonl");
  std::string out;
  ASSERT_EQ(run_towers(base() +
                           "--steps 60 --towers 3 --gpus 1 --batch 16 --mode ssp "
                           "--staleness 1 --slow-tower 0:late --metrics " +
                           m,
                       &out),
            0)
      << out;
  auto steps = metrics_events(m, "step");
  ASSERT_EQ(steps.size(), 60u);
  // Tower 0 holds each gradient until the other two wait for it at the bound (whatever the
  // machine's load or the model's step time), so the bound binds.
  EXPECT_EQ(max_lead(steps, 3), 2) << "the bound must hold and must bind";
  auto config = metrics_events(m, "config");
  ASSERT_EQ(config.size(), 1u);
  EXPECT_EQ(config[0]["towers_per_gpu"], 3);
}

TEST_P(EngineGpuModels, AsyncTowersAllApply) {
  TOWERS_SKIP_WITHOUT_GPU();
  const std::string m = test_path("async.jsonl");
  ASSERT_EQ(run_towers(base() + "--steps 60 --towers 2 --batch 16 --mode async --metrics " + m), 0);
  auto steps = metrics_events(m, "step");
  ASSERT_EQ(steps.size(), 60u);
  int per[2] = {0, 0};
  for (const auto& s : steps) ++per[s["tower"].get<int>()];
  EXPECT_GT(per[0], 10);
  EXPECT_GT(per[1], 10);
  auto sum = metrics_events(m, "summary");
  ASSERT_EQ(sum.size(), 1u);
  EXPECT_TRUE(std::isfinite(sum[0]["test_accuracy"].get<double>()));
  if (mlp()) EXPECT_GT(sum[0]["test_accuracy"].get<double>(), 0.5);
  // The summary names the cuDNN algorithms of each convolution plan (none for the mlp).
  ASSERT_TRUE(sum[0].contains("cudnn_plans")) << sum[0].dump();
  const json& plans = sum[0]["cudnn_plans"];
  if (mlp()) {
    EXPECT_TRUE(plans.empty()) << plans.dump();
  } else {
    ASSERT_EQ(plans.size(), 2u) << plans.dump();  // conv1 and conv2 at batch 16
    EXPECT_EQ(plans[0].get<std::string>().rfind("conv1, batch 16: forward ", 0), 0u) << plans.dump();
  }
}

TEST_P(EngineGpuModels, BackupTowersDropAStraggler) {
  TOWERS_SKIP_WITHOUT_GPU();
  const std::string m = test_path("backup.jsonl");
  // The straggler is always late (it holds each gradient until its version has been applied
  // without it), whatever the machine's load: a straggler that only sleeps can be overtaken
  // by towers that a loaded machine slows down more (on 2026-11-27, with 24 test and
  // sanitizer processes on the GPU machine, a 150 ms straggler made 7 of 30 updates).
  ASSERT_EQ(run_towers(base() +
                       "--steps 30 --towers 3 --batch 16 --replicas-to-aggregate 2 "
                       "--slow-tower 2:late --metrics " +
                       m),
            0);
  auto sum = metrics_events(m, "summary");
  ASSERT_EQ(sum.size(), 1u);
  for (const auto& s : metrics_events(m, "step")) EXPECT_EQ(s["contributors"], 2);
  const json& t = sum[0]["towers"];
  for (int i : {0, 1}) {  // in every update, and no step after the last one
    EXPECT_EQ(t[i]["applied"], 30) << sum[0].dump();
    EXPECT_EQ(t[i]["steps"], 30) << sum[0].dump();
  }
  EXPECT_EQ(t[2]["applied"], 0) << sum[0].dump();
  EXPECT_GE(t[2]["dropped"].get<int64_t>(), 1) << sum[0].dump();
  EXPECT_EQ(t[2]["dropped"], t[2]["steps"]) << sum[0].dump();
  EXPECT_EQ(sum[0]["dropped_gradients"], t[2]["dropped"]) << sum[0].dump();
}

INSTANTIATE_TEST_SUITE_P(Models, EngineGpuModels, ::testing::Values("mlp", "cifar10"));

TEST(EngineGpu, NcclAveragingMatchesHostAveraging) {
  TOWERS_SKIP_WITHOUT_GPU();
  const GpuList g = list_gpus();
  const std::string host = test_path("host.jsonl"), nccl = test_path("nccl.jsonl");
  std::string out;
  if (g.gpus.size() < 2) {
    // One GPU: two towers cannot form an NCCL communicator; the run says so and writes nothing.
    EXPECT_EQ(run_towers(kMlp + "--steps 5 --towers 2 --reduce nccl --metrics " + nccl, &out), 1);
    EXPECT_NE(out.find("NCCL needs one tower per GPU"), std::string::npos) << out;
    EXPECT_FALSE(std::filesystem::exists(nccl));
    // Not a GPU-setup failure: the machine has one GPU. A 1-rank all-reduce runs in
    // NcclReducer.OneRankAverageMatchesTheHostAverage.
    TOWERS_SKIP_FOR_GPU_COUNT(2, g.gpus.size());
  }
  const std::string args = kMlp + "--steps 30 --towers 2 --batch 32 --metrics ";
  ASSERT_EQ(run_towers(args + host + " --reduce host", &out), 0) << out;
  ASSERT_EQ(run_towers(args + nccl + " --reduce nccl", &out), 0) << out;
  auto a = metrics_events(host, "step"), b = metrics_events(nccl, "step");
  ASSERT_EQ(a.size(), 30u);
  ASSERT_EQ(b.size(), 30u);
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_NEAR(a[i]["loss"].get<double>(), b[i]["loss"].get<double>(),
                1e-4 * std::fabs(a[i]["loss"].get<double>())) << "step " << i + 1;
}

// --cudnn-benchmark and --cudnn-gemm-only through the CLI: the run says so, records both in its
// config, and both cuDNN plans of the summary (tower 0's conv1 and conv2) were timed among the
// GEMM family's algorithms and name no FFT or Winograd one.
TEST(EngineGpu, TimedGemmOnlyCudnnPlansThroughTheCli) {
  TOWERS_SKIP_WITHOUT_GPU();
  const std::string m = test_path("timed.jsonl");
  std::string out;
  ASSERT_EQ(run_towers("train --device cuda --model cifar10 --dataset synthetic --synthetic-size "
                       "256 --optimizer momentum --lr 0.01 --seed 3 --steps 3 --batch 16 "
                       "--params mirrored --cudnn-benchmark --cudnn-gemm-only --metrics " + m,
                       &out),
            0)
      << out;
  EXPECT_NE(out.find("cuDNN algorithms timed, cuDNN's GEMM family only"), std::string::npos)
      << out;
  auto config = metrics_events(m, "config");
  ASSERT_EQ(config.size(), 1u);
  EXPECT_EQ(config[0]["config"]["cudnn_benchmark"], true);
  EXPECT_EQ(config[0]["config"]["cudnn_gemm_only"], true);
  auto sum = metrics_events(m, "summary");
  ASSERT_EQ(sum.size(), 1u);
  const json& plans = sum[0]["cudnn_plans"];
  ASSERT_EQ(plans.size(), 2u) << plans.dump();  // conv1 and conv2 at batch 16
  for (const json& plan : plans) {
    const std::string p = plan.get<std::string>();
    EXPECT_NE(p.find(", batch 16, GEMM family: timed: forward "), std::string::npos) << p;
    EXPECT_EQ(p.find("FFT"), std::string::npos) << p;
    EXPECT_EQ(p.find("WINOGRAD"), std::string::npos) << p;
  }
}

TEST(EngineGpu, EvalOnTheGpuMatchesEvalOnTheCpu) {
  TOWERS_SKIP_WITHOUT_GPU();
  const std::string ck = test_path("ck");
  std::string out;
  ASSERT_EQ(run_towers(kMlp + "--steps 20 --batch 32 --checkpoint-dir " + ck, &out), 0) << out;
  const std::string file = ck + "/ckpt-000000020.safetensors";
  const std::string cpu = test_path("cpu.json"), gpu = test_path("gpu.json");
  ASSERT_EQ(run_towers("eval --checkpoint " + file + " --metrics " + cpu, &out), 0) << out;
  ASSERT_EQ(run_towers("eval --device cuda --checkpoint " + file + " --metrics " + gpu, &out), 0)
      << out;
  auto a = metrics_events(cpu, "eval"), b = metrics_events(gpu, "eval");
  ASSERT_EQ(a.size(), 1u);
  ASSERT_EQ(b.size(), 1u);
  EXPECT_EQ(a[0]["examples"], b[0]["examples"]);
  EXPECT_NEAR(a[0]["test_accuracy"].get<double>(), b[0]["test_accuracy"].get<double>(), 1e-3);
  EXPECT_NEAR(a[0]["test_loss"].get<double>(), b[0]["test_loss"].get<double>(),
              1e-4 * a[0]["test_loss"].get<double>());
}

TEST(EngineGpu, BadGpuFlagsAreClearErrorsAndWriteNothing) {
  TOWERS_SKIP_WITHOUT_GPU();
  const int have = static_cast<int>(list_gpus().gpus.size());
  struct Case {
    std::string flags, says;
  };
  for (const Case& c : std::vector<Case>{
           {"--gpus " + std::to_string(have + 1),
            "--gpus " + std::to_string(have + 1) + ": this machine has " + std::to_string(have)},
           {"--towers 2 --gpus 1 --reduce nccl", "NCCL needs one tower per GPU"},
       }) {
    const std::string m = test_path("m.jsonl");
    std::string out;
    EXPECT_EQ(run_towers(kMlp + "--steps 2 " + c.flags + " --metrics " + m, &out), 1) << c.flags;
    EXPECT_NE(out.find(c.says), std::string::npos) << c.flags << ": " << out;
    EXPECT_FALSE(std::filesystem::exists(m)) << c.flags;
  }
}

TEST(EngineGpu, FashionMnistReaches90PercentOnAGpu) {
  TOWERS_SKIP_WITHOUT_GPU();
  if (testutil::emulated_gpu())
    GTEST_SKIP() << "the CUDA emulator computes on the CPU: five epochs are a real-GPU test";
  // $TOWERS_FASHION_MNIST names the folder on a machine without Debian's dataset package.
  const char* env = std::getenv("TOWERS_FASHION_MNIST");
  const std::string fashion = env ? env : "/usr/share/datasets/fashion-mnist";
  if (!std::filesystem::exists(fashion)) TOWERS_GPU_SKIP("no Fashion-MNIST at " << fashion);
  const std::string m = test_path("fashion.jsonl");
  std::string out;
  // The main job's recipe (scripts/train-fashion.sh), on one GPU tower.
  ASSERT_EQ(run_towers("train --device cuda --model fashion --dataset fashion-mnist --data " +
                       fashion + " --epochs 5 "
                       "--batch 128 --optimizer momentum --lr 0.01 --lr-schedule cosine --quiet "
                       "--metrics " + m, &out), 0) << out;
  auto sum = metrics_events(m, "summary");
  ASSERT_EQ(sum.size(), 1u);
  EXPECT_GE(sum[0]["test_accuracy"].get<double>(), 0.90) << sum[0].dump();
}

}  // namespace
}  // namespace towers
