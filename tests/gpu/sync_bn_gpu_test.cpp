// --sync-bn with GPU towers, end to end: 2 sync GPU towers of 64 normalize over the global
// batch of 128, as 1 GPU tower of 128 does: with host parameters and with mirrored ones, the
// towers sharing one GPU, and (where there are two GPUs) mirrored on two GPUs with NCCL. Their
// parameters after 20 updates are one tower's up to the order of the additions (the
// statistics' lanes per tower, and the GEMMs' sums over 64 examples against 128): float-close.
// Without the flag each tower normalizes over its own 64 and the parameters move orders of
// magnitude further. Skips without a CUDA device.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "cli_util.h"
#include "core/gpu.h"
#include "gpu_test_util.h"
#include "io/checkpoint.h"
#include "models/model_file.h"

namespace towers {
namespace {

using testutil::metrics_events;
using testutil::run_towers;
using testutil::test_path;

TEST(SyncBnGpu, TwoTowersOfHalfTheBatchFollowOneTower) {
  TOWERS_SKIP_WITHOUT_GPU();
  const std::string file = test_path("bn.json");
  std::ofstream(file) << testutil::kBatchNormNet;
  const std::string base = "train --device cuda --model " + file +
                           " --dataset synthetic --synthetic-size 1280 --optimizer momentum "
                           "--lr 0.05 --steps 20 --quiet --seed 3 ";
  const auto graph = build_graph(read_model_file(file));
  // Runs with `flags` into folder `name`, its metrics in `metrics`: the final parameters.
  auto run = [&](const std::string& name, const std::string& flags,
                 const std::string& metrics = "") {
    const std::string out = test_path(name);
    std::string output;
    EXPECT_EQ(run_towers(base + flags + (metrics.empty() ? "" : " --metrics " + metrics) +
                             " --checkpoint-dir " + out, &output), 0)
        << name << ": " << output;
    const auto c = io::load_checkpoint(out + "/ckpt-000000020.safetensors", graph->layout(),
                                       {"momentum"});
    return std::vector<float>(c.params.data(), c.params.data() + graph->layout().total());
  };
  const std::vector<float> one = run("one", "--gpus 1 --towers 1 --batch 128");
  const std::vector<float> own = run("own", "--gpus 1 --towers 2 --batch 64");
  double scale = 0;
  for (float p : one) scale = std::max(scale, std::fabs(static_cast<double>(p)));
  auto distance = [&](const std::vector<float>& p) {
    double d = 0;
    for (size_t i = 0; i < one.size(); ++i)
      d = std::max(d, std::fabs(static_cast<double>(p[i]) - one[i]));
    return d;
  };
  const double d_own = distance(own);
  EXPECT_GT(d_own, 1e-3 * scale);
  std::vector<std::pair<std::string, std::string>> variants = {
      {"host", "--gpus 1 --params host"}, {"mirrored", "--gpus 1 --params mirrored"}};
  if (list_gpus().gpus.size() >= 2)
    variants.push_back({"mirrored-nccl", "--gpus 2 --params mirrored --reduce nccl"});
  for (const auto& [name, flags] : variants) {
    SCOPED_TRACE(name);
    const std::string metrics = test_path("synced-" + name + ".jsonl");
    const double d =
        distance(run("synced-" + name, "--towers 2 --batch 64 --sync-bn " + flags, metrics));
    std::printf("  largest parameter difference from 1 GPU tower of 128 (largest |p| %.3g): "
                "--sync-bn %s %.3g, per-tower statistics %.3g\n",
                scale, flags.c_str(), d, d_own);
    EXPECT_LT(d, 1e-4 * scale);
    const auto config = metrics_events(metrics, "config");
    ASSERT_EQ(config.size(), 1u);
    EXPECT_EQ(config[0]["config"]["sync_bn"], true);
  }
}

}  // namespace
}  // namespace towers
