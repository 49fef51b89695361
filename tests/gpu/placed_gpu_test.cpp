// Placed towers with GPU parts (towers/placed_tower.h): a part on cuda:0 runs its layers' GPU
// twins on the GPU's stream, and activations and errors cross to and from CPU parts by copies.
// Against the CPU tower of the whole model on the same batch: float-close gradients and losses
// (the GPU part sums in other orders), for either side of the cut on the GPU, with and without
// micro-batches; and a run through the CLI.
#include <algorithm>
#include <cmath>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "cli_util.h"
#include "core/gpu.h"
#include "core/rng.h"
#include "gpu_test_util.h"
#include "models/model_file.h"
#include "models/models.h"
#include "towers/cuda_tower.h"
#include "towers/placed_tower.h"
#include "towers/placement.h"
#include "towers/tower.h"

namespace towers {
namespace {

using testutil::metrics_events;
using testutil::run_towers;
using testutil::test_path;

// ||a - b|| / ||b||.
double relative_distance(const float* a, const float* b, int64_t n) {
  double d = 0, r = 0;
  for (int64_t i = 0; i < n; ++i) {
    d += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    r += double(b[i]) * b[i];
  }
  return std::sqrt(d / r);
}

struct Cut {
  const char* model;
  const char* placement;
  int micro_batches;
  bool cudnn = false;  // the placed tower's convolutions by cuDNN (its CPU parts hold none)
};

void PrintTo(const Cut& c, std::ostream* os) {
  *os << c.model << " '" << c.placement << "' M=" << c.micro_batches;
}

class PlacedGpu : public ::testing::TestWithParam<Cut> {};

TEST_P(PlacedGpu, MatchesTheWholeTowerOnTheCpu) {
  TOWERS_SKIP_WITHOUT_GPU();
  const Cut& cut = GetParam();
  // The CPU tower by im2col: its Winograd path rounds more than the comparison allows.
  ModelSpec spec = read_model(cut.model);
  set_conv_algorithm(spec, ConvAlgorithm::Im2col);
  auto g = build_graph(spec);
  set_conv_algorithm(spec, cut.cudnn ? ConvAlgorithm::Auto : ConvAlgorithm::Im2col);
  auto placed_graph = build_graph(spec);
  const int64_t n = 32, total = g->layout().total();
  std::vector<float> params(total);
  g->layout().initialize(params.data(), 5);
  // Each step its own batch: a hand-off that reads what the step before left there (a missing
  // wait) reads the wrong numbers.
  std::vector<float> images;
  std::vector<int32_t> labels;
  auto make_batch = [&](uint64_t seed) {
    Rng rng(seed);
    images.assign(n * numel(g->input_shape()), 0.0f);
    for (float& v : images) v = rng.uniform(-1.5f, 1.5f);
    labels.clear();
    for (int64_t i = 0; i < n; ++i) labels.push_back(static_cast<int32_t>(rng.next_u64() % 10));
  };

  CpuTower cpu(*g, n, 2);
  cpu.load_params(params.data());

  const Placement placement = parse_placement(cut.placement, *placed_graph);
  int gpus_named = 0;
  for (const PlacedPart& part : placement.parts)
    if (part.kind == DeviceKind::Cuda) gpus_named = std::max(gpus_named, part.index + 1);
  if (const int have = static_cast<int>(list_gpus().gpus.size()); have < gpus_named)
    TOWERS_SKIP_FOR_GPU_COUNT(gpus_named, have);
  PlacedTower placed(*placed_graph, n, placement, cut.micro_batches, 2);
  // A GPU part's parameters are in GPU memory (the emulator tracks its allocations).
  for (size_t q = 0; q < placement.parts.size(); ++q) {
    if (placement.parts[q].kind != DeviceKind::Cuda) continue;
    cudaPointerAttributes attr{};
    ASSERT_EQ(cudaPointerGetAttributes(&attr, placed.part_params(static_cast<int>(q))), cudaSuccess);
    EXPECT_EQ(attr.type, cudaMemoryTypeDevice) << "part " << q;
  }
  placed.load_params(params.data());
  std::vector<float> poison(total, NAN);
  std::copy(poison.begin(), poison.end(), placed.mutable_grads());
  // The whole tower on the GPU with the same convolutions: how far the GPU's own arithmetic
  // takes this batch's gradients from the CPU tower's. With random images and labels a near-tie
  // in a ReLU or a max-pool window, which the GPU and the CPU round to different sides, moves
  // one position's contribution, and the gradient is a small residue of large terms (seen on an
  // H100: 2e-3 for conv1 of the cut conv1..pool2@cuda:0). The placement must add nothing to
  // that: each variable within 1e-4 of the CPU's, or within 4 times the whole GPU tower's
  // largest distance where that is larger. A hand-off that reads the wrong buffer or too early
  // is off by far more (the poison below makes an unwritten gradient NaN).
  TowerPlacement on_gpu;
  on_gpu.kind = DeviceKind::Cuda;
  on_gpu.cuda_graphs = false;
  CudaTower whole(*placed_graph, n, on_gpu);
  whole.load_params(params.data());
  // Twice: the second step reuses every buffer the first wrote.
  for (int step = 0; step < 2; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    make_batch(17 + step);
    const StepStats want = cpu.compute_gradients(images.data(), labels.data(), n, 1.0f / n);
    const std::vector<float> want_grads(cpu.grads(), cpu.grads() + total);
    whole.compute_gradients(images.data(), labels.data(), n, 1.0f / n);
    const StepStats got = placed.compute_gradients(images.data(), labels.data(), n, 1.0f / n);
    EXPECT_EQ(got.examples, n);
    EXPECT_NEAR(got.loss_sum, want.loss_sum, 1e-5 * std::fabs(want.loss_sum));
    double gpu_spread = 0.0, worst = 0.0;
    for (const Variable& v : g->layout().variables())
      gpu_spread = std::max(gpu_spread, relative_distance(whole.grads() + v.offset,
                                                          want_grads.data() + v.offset, v.size));
    const double bound = std::max(1e-4, 4 * gpu_spread);
    for (const Variable& v : g->layout().variables()) {
      const double d =
          relative_distance(placed.grads() + v.offset, want_grads.data() + v.offset, v.size);
      worst = std::max(worst, d);
      EXPECT_LT(d, bound) << v.spec.name << " (the whole GPU tower's largest distance "
                          << gpu_spread << ")";
    }
    std::printf("  step %d: largest per-variable distance from the CPU tower: placed %.3g, "
                "whole tower on the GPU %.3g\n", step, worst, gpu_spread);
  }
  make_batch(99);
  const StepStats want_eval = cpu.evaluate(images.data(), labels.data(), n);
  const StepStats got_eval = placed.evaluate(images.data(), labels.data(), n);
  EXPECT_NEAR(got_eval.loss_sum, want_eval.loss_sum, 1e-5 * std::fabs(want_eval.loss_sum));
  std::vector<float> logits(n * 10), cpu_logits(cpu.logits(), cpu.logits() + n * 10);
  placed.copy_logits(logits.data(), n);
  EXPECT_LT(relative_distance(logits.data(), cpu_logits.data(), n * 10), 1e-5);
  // Every part was busy, the GPU one included.
  for (const auto& part : placed.pipeline_stats().parts) EXPECT_GT(part.busy_seconds, 0.0) << part.device;
}

INSTANTIATE_TEST_SUITE_P(
    Cuts, PlacedGpu,
    ::testing::Values(Cut{"mlp", "hidden@cuda:0;softmax_linear@cpu:0", 1},
                      Cut{"mlp", "hidden@cpu:0;softmax_linear@cuda:0", 2},
                      Cut{"cifar10", "conv1..pool2@cuda:0;local3..softmax_linear@cpu:0", 2},
                      Cut{"cifar10", "conv1..norm1@cpu:0;conv2..local4@cuda:0;softmax_linear@cpu:1", 1},
                      Cut{"cifar10", "conv1..softmax_linear@cuda:0", 4},
                      Cut{"cifar10", "conv1..pool2@cuda:0;local3..softmax_linear@cpu:0", 2, true},
                      // Two GPUs: a GPU part's hand-off to another GPU part is an event wait
                      // on the consumer's stream.
                      Cut{"cifar10", "conv1..norm2@cuda:0;pool2..softmax_linear@cuda:1", 2}),
    [](const auto& info) {
      return std::string(info.param.model) + "_" + std::to_string(info.index) + "_m" +
             std::to_string(info.param.micro_batches) + (info.param.cudnn ? "_cudnn" : "");
    });

// Through the CLI: a GPU part is named in the placement, with --device left at cpu, and the
// run's pipeline record names it.
TEST(PlacedGpuCli, TrainsWithAGpuPart) {
  TOWERS_SKIP_WITHOUT_GPU();
  const std::string m = test_path("placed_gpu.jsonl");
  std::string out;
  ASSERT_EQ(run_towers("train --model mlp --dataset synthetic --synthetic-size 1000 --batch 128 "
                       "--steps 6 --quiet --placement 'hidden@cuda:0;softmax_linear@cpu:0' "
                       "--micro-batches 2 --metrics " + m,
                       &out),
            0)
      << out;
  const auto summary = metrics_events(m, "summary");
  ASSERT_EQ(summary.size(), 1u);
  const auto& parts = summary[0]["pipeline"]["towers"][0]["parts"];
  ASSERT_EQ(parts.size(), 2u) << summary[0].dump();
  EXPECT_EQ(parts[0]["device"], "cuda:0");
  EXPECT_EQ(parts[1]["device"], "cpu:0");
  EXPECT_TRUE(std::isfinite(summary[0]["final_loss"].get<double>())) << summary[0].dump();
}

// The cuDNN rules reach a placed tower's GPU part: with --cudnn-gemm-only its plans (conv1 and
// conv2 on cuda:0) say so in the summary, as a whole GPU tower's do, and the run's first line
// and config record the rule.
TEST(PlacedGpuCli, GpuPartTakesTheCudnnRules) {
  TOWERS_SKIP_WITHOUT_GPU();
  const std::string m = test_path("placed_gpu_rules.jsonl");
  std::string out;
  ASSERT_EQ(run_towers("train --model cifar10 --dataset synthetic --synthetic-size 256 --batch 16 "
                       "--steps 2 --placement 'conv1..pool2@cuda:0;local3..softmax_linear@cpu:0' "
                       "--cudnn-gemm-only --metrics " + m,
                       &out),
            0)
      << out;
  EXPECT_NE(out.find("cuDNN's GEMM family only"), std::string::npos) << out;
  const auto config = metrics_events(m, "config");
  ASSERT_EQ(config.size(), 1u);
  EXPECT_EQ(config[0]["config"]["cudnn_gemm_only"], true);
  const auto summary = metrics_events(m, "summary");
  ASSERT_EQ(summary.size(), 1u);
  const auto& plans = summary[0]["cudnn_plans"];
  ASSERT_EQ(plans.size(), 2u) << summary[0].dump();  // conv1 and conv2, at batch 16
  for (const auto& plan : plans) {
    const std::string p = plan.get<std::string>();
    EXPECT_EQ(p.rfind("cuda:0: conv", 0), 0u) << p;
    EXPECT_NE(p.find(", batch 16, GEMM family: "), std::string::npos) << p;
  }
}

}  // namespace
}  // namespace towers
