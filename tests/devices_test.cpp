// `towers devices` and the --device flags, in every build: a machine without a GPU (CI) gets a
// plain statement and clear errors, never a crash or a half-written run.
#include <filesystem>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "cli_util.h"
#include "core/gpu.h"

namespace towers {
namespace {

using testutil::run_towers;
using testutil::test_path;

const std::string kTiny =
    "train --model mlp --dataset synthetic --synthetic-size 200 --steps 2 --batch 8 --quiet ";

TEST(Devices, ListsTheCpuAndSaysWhetherThereIsAGpu) {
  std::string out;
  ASSERT_EQ(run_towers("devices", &out), 0) << out;
  EXPECT_NE(out.find("cpu "), std::string::npos) << out;
  const GpuList g = list_gpus();
  if (g.gpus.empty()) {
    EXPECT_NE(out.find("no GPU: " + g.why_none), std::string::npos) << out;
  } else {
    EXPECT_NE(out.find(g.gpus[0].name), std::string::npos) << out;
    EXPECT_NE(out.find("compute capability"), std::string::npos) << out;
  }
  ASSERT_EQ(run_towers("devices --json", &out), 0) << out;
  auto j = nlohmann::json::parse(out);
  EXPECT_GE(j["cpu_cores"].get<int>(), 1);
  EXPECT_EQ(j["gpus"].size(), g.gpus.size());
  EXPECT_EQ(j.contains("no_gpu_reason"), g.gpus.empty());
}

TEST(Devices, CudaWithoutAGpuIsAClearErrorAndWritesNothing) {
  if (!list_gpus().gpus.empty()) GTEST_SKIP() << "this machine has a GPU";
  const std::string m = test_path("m.jsonl"), ck = test_path("ck");
  std::string out;
  EXPECT_EQ(run_towers(kTiny + "--device cuda --metrics " + m + " --checkpoint-dir " + ck, &out), 1);
  EXPECT_NE(out.find("--device cuda"), std::string::npos) << out;
  EXPECT_NE(out.find(list_gpus().why_none), std::string::npos) << out;
  EXPECT_FALSE(std::filesystem::exists(m));
  EXPECT_TRUE(!std::filesystem::exists(ck) || std::filesystem::is_empty(ck));
  EXPECT_EQ(run_towers("eval --device cuda --checkpoint nowhere.safetensors", &out), 1);
  EXPECT_NE(out.find("--device cuda: no GPU available"), std::string::npos) << out;
}

TEST(Devices, BadDeviceFlags) {
  struct Case {
    std::string flags, says;
  };
  for (const Case& c : std::vector<Case>{
           {"--device tpu", "--device: unknown device 'tpu'"},
           {"--reduce ring", "--reduce: unknown reduction 'ring'"},
           {"--reduce nccl", "--reduce nccl is for GPU towers: it needs --device cuda"},
           {"--no-cuda-graphs", "--no-cuda-graphs is for GPU towers: it needs --device cuda"},
           {"--gpus 2", "--gpus 2 is for GPU towers"},
           {"--tf32", "--tf32 is for GPU towers"},
           {"--backward-branches", "--backward-branches is for GPU towers"},
           {"--tf32 --gpus 2", "--gpus 2, --tf32 are for GPU towers: they need --device cuda"},
           {"--cudnn-nondeterministic",
            "--cudnn-nondeterministic rules cuDNN's convolutions on a GPU: it needs --device cuda"},
           {"--cudnn-benchmark", "--cudnn-benchmark rules cuDNN's"},
           {"--cudnn-gemm-only", "--cudnn-gemm-only rules cuDNN's"},
           {"--cudnn-gemm-only --cudnn-benchmark", "--cudnn-benchmark, --cudnn-gemm-only rule"},
           // A placement whose parts are all on the CPU has no cuDNN plans to rule.
           {"--cudnn-gemm-only --placement 'hidden@cpu:0;softmax_linear@cpu:1'",
            "--cudnn-gemm-only rules cuDNN's convolutions on a GPU: it needs --device cuda, or a "
            "placement with a cuda:N part"},
           {"--device cuda --gpus -1", "--gpus must be >= 0"},
           {"--device cuda --mode async --reduce nccl", "--reduce nccl is for --mode sync"},
       }) {
    const std::string m = test_path("m.jsonl");
    std::string out;
    EXPECT_EQ(run_towers(kTiny + c.flags + " --metrics " + m, &out), 1) << c.flags;
    EXPECT_NE(out.find(c.says), std::string::npos) << c.flags << ": " << out;
    EXPECT_FALSE(std::filesystem::exists(m)) << c.flags;
  }
}

}  // namespace
}  // namespace towers
