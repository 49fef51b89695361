// Model parallelism (towers/placement.h, towers/placed_tower.h): a placement is parsed and
// checked with errors that name the problem; a tower placed over CPU parts computes bitwise the
// gradients, loss and hits of the same tower on one device; M micro-batches give bitwise the
// update of one batch; N placed towers in sync mode give bitwise the parameters of N whole
// towers and of one tower of N times the batch, in process and through `towers train`; a model
// file's "placement" trains like the same --placement, which overrides it.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <oneapi/tbb/global_control.h>
#include <oneapi/tbb/task_arena.h>

#include "cli_util.h"
#include "core/check.h"
#include "core/gpu.h"
#include "core/rng.h"
#include "data/augment.h"
#include "data/synthetic.h"
#include "io/checkpoint.h"
#include "models/builtin_models.h"
#include "models/model_file.h"
#include "models/models.h"
#include "optim/optimizer.h"
#include "towers/parameter_store.h"
#include "towers/placed_tower.h"
#include "towers/placement.h"
#include "towers/tower_group.h"

namespace towers {
namespace {

using testutil::metrics_events;
using testutil::run_towers;
using testutil::test_path;

// The issue's placement of the tutorial net (its convolutional half, then its dense half); the
// order of the layers inside a part is free.
const std::string kTwoParts =
    "conv1,norm1,pool1,conv2,norm2,pool2@cpu:0;local3,local4,softmax_linear@cpu:1";

// The message of the towers::Error that fn throws ("" if it throws none).
template <class F>
std::string error_of(F&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

void expect_placement_error(const Graph& g, const std::string& text,
                            const std::vector<std::string>& needles) {
  const std::string msg = error_of([&] { parse_placement(text, g); });
  ASSERT_FALSE(msg.empty()) << "no error for placement '" << text << "'";
  EXPECT_NE(msg.find("--placement"), std::string::npos) << msg;
  for (const std::string& n : needles)
    EXPECT_NE(msg.find(n), std::string::npos) << "'" << n << "' not in: " << msg;
}

TEST(PlacementParse, ReadsPartsDevicesThreadsAndRanges) {
  auto g = build_model("cifar10");
  const Placement p = parse_placement(kTwoParts, *g);
  ASSERT_EQ(p.parts.size(), 2u);
  EXPECT_EQ(p.parts[0].first, 0u);
  EXPECT_EQ(p.parts[0].last, 6u);
  EXPECT_EQ(p.parts[1].first, 6u);
  EXPECT_EQ(p.parts[1].last, 9u);
  EXPECT_EQ(p.parts[0].device_name(), "cpu:0");
  EXPECT_EQ(p.parts[1].device_name(), "cpu:1");
  EXPECT_EQ(p.parts[0].threads, 0);
  EXPECT_EQ(p.parts[0].layer_names(*g), "conv1..pool2");

  const Placement r = parse_placement(
      " conv1..norm1 @ cpu ; conv2 , norm2..local3@cpu:3x2;"
      "local4..softmax_linear@cpu:1",
      *g);
  ASSERT_EQ(r.parts.size(), 3u);
  EXPECT_EQ(r.parts[0].last, 3u);
  EXPECT_EQ(r.parts[0].device_name(), "cpu:0");
  EXPECT_EQ(r.parts[1].first, 3u);
  EXPECT_EQ(r.parts[1].last, 7u);
  EXPECT_EQ(r.parts[1].index, 3);
  EXPECT_EQ(r.parts[1].threads, 2);
  EXPECT_EQ(r.parts[2].layer_names(*g), "local4..softmax_linear");
  // The threads of parts without a count: the tower's, shared out, at least one each.
  EXPECT_EQ(PlacedTower::part_threads(r, 4), (std::vector<int>{1, 2, 1}));
  EXPECT_EQ(PlacedTower::part_threads(r, 9), (std::vector<int>{3, 2, 3}));
  // A GPU part (parsed here; whether the GPU exists is checked where a tower is made) gets one
  // thread, for its launches; the CPU parts share the tower's.
  const Placement gpu = parse_placement("hidden@cuda:0;softmax_linear@cpu:1", *build_model("mlp"));
  ASSERT_EQ(gpu.parts.size(), 2u);
  EXPECT_EQ(gpu.parts[0].kind, DeviceKind::Cuda);
  EXPECT_EQ(gpu.parts[0].device_name(), "cuda:0");
  EXPECT_EQ(PlacedTower::part_threads(gpu, 4), (std::vector<int>{1, 4}));

  const Placement one = parse_placement("hidden,softmax_linear@cpu", *build_model("mlp"));
  ASSERT_EQ(one.parts.size(), 1u);
  EXPECT_EQ(one.parts[0].last, 2u);
}

TEST(PlacementParse, ErrorsNameTheLayerDeviceOrPart) {
  auto g = build_model("cifar10");
  const std::string convs = "conv1..pool2@cpu:0;";
  expect_placement_error(*g, convs + "local3,local5,softmax_linear@cpu:1",
                         {"unknown layer 'local5'", "part 2", "local4"});
  expect_placement_error(*g, convs + "local3..softmax_linear@gpu:1",
                         {"unknown device 'gpu:1'", "cpu:N"});
  expect_placement_error(*g, convs + "local3..softmax_linear@cpu:one",
                         {"unknown device 'cpu:one'"});
  expect_placement_error(*g, convs + "local3..softmax_linear@cpu:1x0", {"cpu:1x0", "thread count"});
  expect_placement_error(*g, convs + "local3..softmax_linear@cuda:x", {"unknown device 'cuda:x'"});
  expect_placement_error(*g, convs + "local3..softmax_linear@cpu:0",
                         {"device cpu:0 holds part 1 and part 2"});
  expect_placement_error(*g, convs + "local3..softmax_linear", {"part 2", "names no device"});
  expect_placement_error(*g, convs + "@cpu:1", {"part 2", "names no layers"});
  expect_placement_error(*g, "  ", {"empty placement"});
  // Not covering the graph, or covering a layer twice.
  expect_placement_error(*g, convs + "local3,local4@cpu:1", {"softmax_linear is in no part"});
  expect_placement_error(*g, "conv1..conv2@cpu:0",
                         {"norm2, pool2, local3, local4, softmax_linear are in no part"});
  expect_placement_error(*g, convs + "pool2..softmax_linear@cpu:1",
                         {"layer 'pool2' is placed twice (part 1 and part 2)"});
  // Out of order: parts that do not follow the model, a part that is not a run, a range that
  // runs backwards.
  expect_placement_error(
      *g, "local3..softmax_linear@cpu:1;conv1..pool2@cpu:0",
      {"parts out of order", "part 2 (conv1..pool2)", "softmax_linear ends model cifar10"});
  expect_placement_error(*g, "conv1..norm1@cpu:0;local3..softmax_linear@cpu:1;conv2..pool2@cpu:2",
                         {"parts out of order", "norm1 is followed by conv2"});
  expect_placement_error(*g, "conv1,conv2@cpu:0;pool1,norm1,norm2..softmax_linear@cpu:1",
                         {"part 1 holds conv1 and conv2 but not pool1, norm1 between them"});
  expect_placement_error(*g, "pool2..conv1@cpu:0;local3..softmax_linear@cpu:1",
                         {"range 'pool2..conv1'", "runs backwards"});
}

TEST(PlacementParse, MicroBatchesMustReproduceTheWholeBatch) {
  auto g = build_model("cifar10");
  // Accepted: one micro-batch whatever the batch; otherwise micro-batches of a power-of-two
  // number of every layer's blocks (conv: 4 images, dense: 64 rows).
  EXPECT_NO_THROW(check_micro_batches(*g, 100, 1));
  EXPECT_NO_THROW(check_micro_batches(*g, 128, 2));
  EXPECT_NO_THROW(check_micro_batches(*g, 256, 4));
  EXPECT_NO_THROW(check_micro_batches(*g, 512, 8));
  EXPECT_NO_THROW(check_micro_batches(*g, 192, 3));  // 3 x 64: the tree over 3 continues
  auto expect_error = [&](int64_t batch, int m, const std::vector<std::string>& needles) {
    const std::string msg = error_of([&] { check_micro_batches(*g, batch, m); });
    ASSERT_FALSE(msg.empty()) << "no error for batch " << batch << ", " << m << " micro-batches";
    EXPECT_NE(msg.find("--micro-batches"), std::string::npos) << msg;
    for (const std::string& n : needles)
      EXPECT_NE(msg.find(n), std::string::npos) << "'" << n << "' not in: " << msg;
  };
  expect_error(128, 0, {"at least 1"});
  expect_error(128, -2, {"at least 1"});
  expect_error(128, 3, {"does not split into 3"});
  expect_error(128, 4, {"micro-batches of 32 examples", "local3", "blocks of 64"});
  expect_error(384, 2, {"micro-batches of 192", "conv1", "blocks of 4"});  // 48 blocks
}

// Random parameters (seed 3) and a batch of random images and labels of the model's shape.
struct Inputs {
  std::vector<float> params, images;
  std::vector<int32_t> labels;
};

Inputs make_inputs(const Graph& g, int64_t n, uint64_t seed) {
  Inputs in;
  in.params.resize(g.layout().total());
  g.layout().initialize(in.params.data(), seed);
  const int64_t per = numel(g.input_shape());
  in.images.resize(n * per);
  in.labels.resize(n);
  Rng rng(seed, 11);
  for (float& x : in.images) x = rng.uniform(-1.0f, 1.0f);
  for (int32_t& l : in.labels) l = static_cast<int32_t>(rng.below(g.num_classes()));
  return in;
}

struct Gradients {
  std::vector<float> grads;
  StepStats stats;
};

Gradients step(Tower& t, const Inputs& in, int64_t n) {
  t.load_params(in.params.data());
  Gradients r;
  r.stats =
      t.compute_gradients(in.images.data(), in.labels.data(), n, 1.0f / static_cast<float>(n));
  r.grads.assign(t.grads(), t.grads() + t.graph().layout().total());
  return r;
}

void expect_bitwise(const Gradients& a, const Gradients& b, const std::string& what) {
  ASSERT_EQ(a.grads.size(), b.grads.size());
  size_t differ = 0, first = a.grads.size();
  for (size_t i = 0; i < a.grads.size(); ++i)
    if (std::memcmp(&a.grads[i], &b.grads[i], sizeof(float)) != 0) {
      ++differ;
      first = std::min(first, i);
    }
  EXPECT_EQ(differ, 0u) << what << ": " << differ << " gradient elements differ, the first at "
                        << first;
  EXPECT_EQ(a.stats.loss_sum, b.stats.loss_sum) << what;
  EXPECT_EQ(a.stats.correct, b.stats.correct) << what;
  EXPECT_EQ(a.stats.examples, b.stats.examples) << what;
}

// Every variable's gradient is non-zero somewhere: the comparison is not of zeros.
void expect_every_variable_has_a_gradient(const Graph& g, const Gradients& r) {
  for (const Variable& v : g.layout().variables()) {
    bool any = false;
    for (int64_t i = 0; i < v.size && !any; ++i) any = r.grads[v.offset + i] != 0.0f;
    EXPECT_TRUE(any) << v.spec.name << " has an all-zero gradient";
  }
}

TEST(PlacedTower, TwoCpuPartsGiveBitwiseTheGradientsOfOneDevice) {
  auto g = build_model("cifar10");
  const int64_t n = 64;
  const Inputs in = make_inputs(*g, n, 3);
  CpuTower one(*g, n, 2);
  PlacedTower placed(*g, n, parse_placement(kTwoParts, *g), 1, 2);
  EXPECT_EQ(placed.parts(), 2);
  EXPECT_EQ(placed.threads(), 2);
  const Gradients a = step(one, in, n);
  expect_every_variable_has_a_gradient(*g, a);
  expect_bitwise(a, step(placed, in, n), "2 CPU parts, 1 micro-batch");
  // A second step on the same tower (its buffers reused) gives the same bits again.
  expect_bitwise(a, step(placed, in, n), "2 CPU parts, second step");
  // A short batch, and evaluation.
  expect_bitwise(step(one, in, 24), step(placed, in, 24), "2 CPU parts, batch of 24");
  const StepStats ea = one.evaluate(in.images.data(), in.labels.data(), n);
  const StepStats eb = placed.evaluate(in.images.data(), in.labels.data(), n);
  EXPECT_EQ(ea.loss_sum, eb.loss_sum);
  EXPECT_EQ(ea.correct, eb.correct);
}

TEST(PlacedTower, FourMicroBatchesGiveBitwiseTheUpdateOfOne) {
  auto g = build_model("cifar10");
  const int64_t n = 256;  // 4 micro-batches of 64: one dense block, 16 conv blocks each
  const Inputs in = make_inputs(*g, n, 5);
  const Placement two = parse_placement(kTwoParts, *g);
  PlacedTower m1(*g, n, two, 1, 2);
  PlacedTower m4(*g, n, two, 4, 2);
  const Gradients a = step(m1, in, n);
  expect_every_variable_has_a_gradient(*g, a);
  expect_bitwise(a, step(m4, in, n), "M = 4 against M = 1");
  // And against one device, with three parts of 1, 2 and 1 threads (4 threads: in a run the
  // step driver sizes oneTBB's pool so).
  oneapi::tbb::global_control threads(oneapi::tbb::global_control::max_allowed_parallelism, 4);
  CpuTower one(*g, n, 2);
  expect_bitwise(a, step(one, in, n), "M = 1 against one device");
  PlacedTower three(*g, n,
                    parse_placement("conv1..norm1@cpu:0;conv2..pool2@cpu:1x2;"
                                    "local3..softmax_linear@cpu:2",
                                    *g),
                    4, 2);
  expect_bitwise(a, step(three, in, n), "3 parts, M = 4");
  // Evaluation through the micro-batched pipeline: the same loss sum and hits.
  const StepStats ea = one.evaluate(in.images.data(), in.labels.data(), n);
  const StepStats eb = m4.evaluate(in.images.data(), in.labels.data(), n);
  EXPECT_EQ(ea.loss_sum, eb.loss_sum);
  EXPECT_EQ(ea.correct, eb.correct);
}

TEST(PlacedTower, MicroBatchesOfAnySizeGiveTheSameSumToRounding) {
  // Outside check_micro_batches' rule (here 5 micro-batches of 51 or 52 rows on a dense net)
  // the GEMM blocks and the tree differ from one batch's, so the logits and the gradient are
  // equal only to float rounding.
  auto g = build_model("mlp");
  const int64_t n = 256;
  const Inputs in = make_inputs(*g, n, 7);
  const Placement p = parse_placement("hidden@cpu:0;softmax_linear@cpu:1", *g);
  PlacedTower m1(*g, n, p, 1, 2);
  PlacedTower m5(*g, n, p, 5, 2);
  const Gradients a = step(m1, in, n), b = step(m5, in, n);
  expect_every_variable_has_a_gradient(*g, a);
  for (size_t i = 0; i < a.grads.size(); ++i)
    ASSERT_NEAR(a.grads[i], b.grads[i], 1e-6 + 1e-4 * std::fabs(a.grads[i])) << "element " << i;
  EXPECT_NEAR(a.stats.loss_sum, b.stats.loss_sum, 1e-6 * a.stats.loss_sum);
  EXPECT_NEAR(a.stats.correct, b.stats.correct, 1);  // a near-tie of two logits may flip
}

// A residual block keeps its inner layers' outputs (and per-call floats) in its saved buffer,
// which each micro-batch gets a slice of: with 3 uneven micro-batches (16, 17 and 17
// examples), each micro-batch's backward must find what its own forward saved, or the gradient
// would be far off; the sums differ from one batch's only by float rounding.
TEST(PlacedTower, ResidualBlocksKeepEachMicroBatchsSavedBuffer) {
  auto g = build_graph(parse_model(R"({"name": "res", "input": [1, 9, 9], "classes": 10,
  "layers": [
  {"name": "stem", "type": "conv2d", "filters": 5, "kernel": 3, "weight_init": {"stddev": 0.3}},
  {"name": "block", "type": "residual", "layers": [
    {"name": "c1", "type": "conv2d", "filters": 5, "kernel": 3, "relu": false,
     "weight_init": {"stddev": 0.3}},
    {"name": "r1", "type": "relu"},
    {"name": "c2", "type": "conv2d", "filters": 5, "kernel": 3, "relu": false,
     "weight_init": {"stddev": 0.3}}]},
  {"name": "act", "type": "relu"},
  {"name": "gap", "type": "global_avg_pool"},
  {"name": "out", "type": "dense", "units": 10, "relu": false, "weight_init": {"stddev": 0.3}}]})",
                                   "res.json"));
  ASSERT_GT(g->layers()[1]->saved_per_call(), 0);
  const int64_t n = 50;
  const Inputs in = make_inputs(*g, n, 9);
  const Placement p = parse_placement("stem..block@cpu:0;act..out@cpu:1", *g);
  CpuTower one(*g, n, 2);
  PlacedTower m1(*g, n, p, 1, 2), m3(*g, n, p, 3, 2);
  const Gradients a = step(one, in, n), b = step(m3, in, n);
  expect_every_variable_has_a_gradient(*g, a);
  expect_bitwise(a, step(m1, in, n), "M = 1 against one device");
  for (size_t i = 0; i < a.grads.size(); ++i)
    ASSERT_NEAR(a.grads[i], b.grads[i], 1e-6 + 1e-4 * std::fabs(a.grads[i])) << "element " << i;
  EXPECT_NEAR(a.stats.loss_sum, b.stats.loss_sum, 1e-6 * a.stats.loss_sum);
}

TEST(PlacedTower, RecordsEveryPartsBusyAndIdleTime) {
  auto g = build_model("mlp");
  const int64_t n = 128;
  const Inputs in = make_inputs(*g, n, 9);
  PlacedTower t(*g, n, parse_placement("hidden@cpu:0;softmax_linear@cpu:1", *g), 2, 2);
  for (int s = 0; s < 3; ++s) step(t, in, n);
  const PipelineStats& ps = t.pipeline_stats();
  EXPECT_EQ(ps.steps, 3);
  EXPECT_EQ(ps.micro_batches, 2);
  ASSERT_EQ(ps.parts.size(), 2u);
  EXPECT_EQ(ps.parts[0].device, "cpu:0");
  EXPECT_EQ(ps.parts[1].layers, "softmax_linear");
  const nlohmann::json j = ps.to_json();
  for (int p = 0; p < 2; ++p) {
    // A part's jobs run within the steps: busy is positive and at most the steps' wall time.
    EXPECT_GT(ps.parts[p].busy_seconds, 0.0);
    EXPECT_LE(ps.parts[p].busy_seconds, ps.step_seconds);
    EXPECT_GE(j["parts"][p]["idle_seconds"].get<double>(), 0.0);
    EXPECT_DOUBLE_EQ(j["parts"][p]["idle_seconds"].get<double>() + ps.parts[p].busy_seconds,
                     ps.step_seconds);
  }
}

TEST(PlacedTower, EachPartAppliesItsOwnSpanOnItsThreadsAtOnce) {
  auto g = build_model("cifar10");
  oneapi::tbb::global_control threads(oneapi::tbb::global_control::max_allowed_parallelism, 6);
  const Placement p = parse_placement(
      "conv1..norm1@cpu:0x1;conv2..pool2@cpu:1x2;local3..softmax_linear@cpu:2x3", *g);
  PlacedTower t(*g, 64, p, 1, 6);
  const int64_t total = g->layout().total();
  struct Span {
    int64_t lo, hi;
    int concurrency;
  };
  std::mutex mu;
  std::condition_variable cv;
  std::vector<Span> seen;
  bool all_started = true;
  t.run_update(total, [&](int64_t lo, int64_t hi) {
    std::unique_lock<std::mutex> l(mu);
    seen.push_back({lo, hi, oneapi::tbb::this_task_arena::max_concurrency()});
    cv.notify_all();
    // The parts apply at the same time: each span waits here until all three have started
    // (a bound of a minute, so that a serial run fails rather than hangs).
    if (!cv.wait_for(l, std::chrono::seconds(60), [&] { return seen.size() == 3; }))
      all_started = false;
  });
  EXPECT_TRUE(all_started) << "the parts' spans did not run at the same time";
  ASSERT_EQ(seen.size(), 3u);
  std::sort(seen.begin(), seen.end(), [](const Span& a, const Span& b) { return a.lo < b.lo; });
  // The spans cover the layout in order, each on its part's threads, each holding exactly its
  // part's variables.
  EXPECT_EQ(seen.front().lo, 0);
  EXPECT_EQ(seen.back().hi, total);
  for (int q = 0; q < 3; ++q) {
    const Span& s = seen[q];
    EXPECT_EQ(std::make_pair(s.lo, s.hi), t.update_span(q)) << "part " << q;
    if (q > 0) EXPECT_EQ(s.lo, seen[q - 1].hi);
    EXPECT_EQ(s.concurrency, q + 1) << "part " << q << "'s span ran on other threads";
    for (size_t i = p.parts[q].first; i < p.parts[q].last; ++i)
      for (const ParamSpec& spec : g->layers()[i]->params()) {
        const Variable& v = g->layout().find(spec.name);
        EXPECT_TRUE(s.lo <= v.offset && v.offset + v.size <= s.hi)
            << v.spec.name << " is outside part " << q << "'s span";
      }
  }
  // A store's update through the parts is bitwise the update of one pass, exclusive and
  // concurrent (async), with the optimizer's wrappers on (their first update copies).
  const std::vector<float> grads = make_inputs(*g, 1, 11).params;
  for (UpdateAccess access : {UpdateAccess::Exclusive, UpdateAccess::Concurrent}) {
    OptimizerConfig oc;
    oc.name = "adam";
    oc.ema = 0.99;
    oc.lookahead_k = 2;
    std::vector<float> a(total), b(total);
    g->layout().initialize(a.data(), 1);
    b = a;
    Optimizer oa(g->layout(), oc), ob(g->layout(), oc);
    LocalParameterStore sa(a.data(), oa, access, true, false), sb(b.data(), ob, access, true, false);
    CpuDevice one(1);
    HostUpdate whole(one);
    for (int u = 0; u < 3; ++u) {
      UpdateRecord ra, rb;
      ra.lr = rb.lr = 0.01f;
      EXPECT_EQ(sa.push(grads.data(), ra, whole), u + 1);
      EXPECT_EQ(sb.push(grads.data(), rb, t), u + 1);
    }
    std::vector<float> init(total);
    g->layout().initialize(init.data(), 1);
    EXPECT_NE(std::memcmp(a.data(), init.data(), sizeof(float) * a.size()), 0)
        << "the parameters did not move";
    EXPECT_EQ(std::memcmp(a.data(), b.data(), sizeof(float) * a.size()), 0)
        << (access == UpdateAccess::Exclusive ? "exclusive" : "concurrent");
    for (const auto& [name, slot] : oa.slots())
      EXPECT_EQ(std::memcmp(slot, ob.slot(name), sizeof(float) * a.size()), 0) << name;
    EXPECT_EQ(oa.updates(), 3);
    EXPECT_EQ(ob.updates(), 3);
  }
}

// Sync runs through the engine: `updates` momentum updates of the mlp on synthetic data, with
// the towers `make` gives; returns the parameters.
std::vector<float> run_sync(int towers, int64_t batch, int64_t updates,
                            const TowerGroup::TowerFactory& make) {
  auto g = build_model("mlp");
  const data::DataSplit d = data::make_synthetic(1, 28, 28, 10, 2048, 64, 5);
  const data::AugmentConfig aug = data::tutorial_eval_config(28);
  std::vector<float> params(g->layout().total());
  g->layout().initialize(params.data(), 1);
  OptimizerConfig oc;
  oc.name = "momentum";
  Optimizer opt(g->layout(), oc);
  EngineConfig ec;
  ec.mode = Mode::Sync;
  ec.towers = towers;
  ec.threads_per_tower = 2;
  LocalParameterStore store(params.data(), opt, store_access(ec), store_locking(ec), false);
  TowerGroup group(*g, ec, batch, store, make);
  RunHooks hooks;
  hooks.lr_at = [](int64_t) { return 0.05f; };
  hooks.on_update = [](const UpdateRecord&) { return false; };
  hooks.side_work = [](int64_t) {};
  hooks.stop_requested = [] { return false; };
  group.run(d.train, aug, 7, 0, updates, 0, hooks);
  EXPECT_EQ(group.version(), updates);
  return params;
}

TEST(PlacedTower, TwoPlacedSyncTowersEqualWholeTowersBitwise) {
  auto g = build_model("mlp");
  const Placement p = parse_placement("hidden@cpu:0;softmax_linear@cpu:1", *g);
  auto placed = [&](int m) -> TowerGroup::TowerFactory {
    return [&p, m](const Graph& graph, int64_t b, const TowerPlacement&) -> std::unique_ptr<Tower> {
      return std::make_unique<PlacedTower>(graph, b, p, m, 2);
    };
  };
  const std::vector<float> whole = run_sync(2, 128, 6, make_tower);
  const std::vector<float> one = run_sync(1, 256, 6, make_tower);
  const std::vector<float> two_placed = run_sync(2, 128, 6, placed(2));
  const std::vector<float> one_placed = run_sync(1, 256, 6, placed(4));
  std::vector<float> init(g->layout().total());
  g->layout().initialize(init.data(), 1);
  EXPECT_NE(std::memcmp(whole.data(), init.data(), sizeof(float) * init.size()), 0)
      << "the parameters did not move";
  const size_t bytes = sizeof(float) * whole.size();
  EXPECT_EQ(std::memcmp(whole.data(), one.data(), bytes), 0) << "2 x 128 against 1 x 256";
  EXPECT_EQ(std::memcmp(whole.data(), two_placed.data(), bytes), 0)
      << "2 placed towers (2 micro-batches) against 2 whole towers";
  EXPECT_EQ(std::memcmp(whole.data(), one_placed.data(), bytes), 0)
      << "1 placed tower of 256 (4 micro-batches) against 2 whole towers";
}

// Through `towers train`: the flags, the pipeline record, and a placed sync run's checkpoint
// equal to the unplaced run's.
const std::string kMlpRun =
    "train --model mlp --dataset synthetic --synthetic-size 2000 --optimizer momentum --lr 0.05 "
    "--quiet --seed 3 --steps 8 --towers 2 --batch 128 --mode sync --threads-per-tower 2 ";

TEST(PlacementCli, PlacedSyncRunEqualsTheUnplacedRunAndReportsItsBubble) {
  const std::string ck1 = test_path("ck1"), ck2 = test_path("ck2"), m2 = test_path("m2.jsonl");
  ASSERT_EQ(run_towers(kMlpRun + "--checkpoint-dir " + ck1), 0);
  std::string out;
  ASSERT_EQ(run_towers(kMlpRun + "--checkpoint-dir " + ck2 + " --metrics " + m2 +
                           " --placement 'hidden@cpu:0;softmax_linear@cpu:1' --micro-batches 2",
                       &out),
            0)
      << out;
  auto g = build_model("mlp");
  auto a = io::load_checkpoint(ck1 + "/ckpt-000000008.safetensors", g->layout(), {"momentum"});
  auto b = io::load_checkpoint(ck2 + "/ckpt-000000008.safetensors", g->layout(), {"momentum"});
  EXPECT_EQ(std::memcmp(a.params.data(), b.params.data(), sizeof(float) * g->layout().total()), 0);
  const auto config = metrics_events(m2, "config");
  ASSERT_EQ(config.size(), 1u);
  EXPECT_EQ(config[0]["config"]["micro_batches"], 2);
  const auto summary = metrics_events(m2, "summary");
  ASSERT_EQ(summary.size(), 1u);
  const auto& pipe = summary[0]["pipeline"];
  EXPECT_EQ(pipe["micro_batches"], 2);
  ASSERT_EQ(pipe["towers"].size(), 2u);
  for (const auto& t : pipe["towers"]) {
    EXPECT_EQ(t["steps"], 8);
    ASSERT_EQ(t["parts"].size(), 2u);
    EXPECT_EQ(t["parts"][0]["device"], "cpu:0");
    EXPECT_EQ(t["parts"][1]["layers"], "softmax_linear");
    EXPECT_EQ(t["parts"][0]["threads"], 1);  // --threads-per-tower 2, shared by 2 parts
    for (const auto& p : t["parts"]) {
      EXPECT_GT(p["busy_seconds"].get<double>(), 0.0);
      EXPECT_GE(p["idle_seconds"].get<double>(), 0.0);
    }
  }
}

TEST(PlacementCli, BadPlacementFlagsAreClearErrors) {
  const std::string m = " --metrics " + test_path("never.jsonl");
  auto expect_error = [&](const std::string& flags, const std::vector<std::string>& needles) {
    std::string out;
    EXPECT_EQ(run_towers(kMlpRun + flags + m, &out), 1) << flags << "\n" << out;
    for (const std::string& n : needles)
      EXPECT_NE(out.find(n), std::string::npos) << "'" << n << "' not in: " << out;
    EXPECT_EQ(out.find("internal error"), std::string::npos) << out;
  };
  expect_error("--placement 'hidden@cpu:0;logits@cpu:1'",
               {"--placement", "unknown layer 'logits'"});
  expect_error("--placement 'hidden@cpu:0;softmax_linear@tpu:1'",
               {"--placement", "unknown device 'tpu:1'"});
  if (list_gpus().gpus.empty())
    expect_error("--placement 'hidden@cpu:0;softmax_linear@cuda:0'",
                 {"--placement: part 2 is placed on cuda:0, but this machine has 0 GPU(s)"});
  expect_error("--placement 'hidden@cpu:0;softmax_linear@cuda:1023'",
               {"--placement: part 2 is placed on cuda:1023, but this machine has"});
  expect_error("--placement 'softmax_linear@cpu:0;hidden@cpu:1'", {"--placement", "out of order"});
  expect_error("--placement 'hidden@cpu:0'", {"--placement", "softmax_linear is in no part"});
  expect_error("--micro-batches 2", {"--micro-batches needs --placement"});
  expect_error("--placement 'hidden@cpu:0;softmax_linear@cpu:1' --micro-batches 4",
               {"--micro-batches 4", "32 examples", "blocks of 64"});
  expect_error("--placement 'hidden@cpu:0;softmax_linear@cpu:1' --micro-batches 0",
               {"--micro-batches must be at least 1"});
  expect_error("--placement 'hidden@cpu:0;softmax_linear@cpu:1' --device cuda",
               {"--placement with --device cuda", "cuda:N parts"});
  EXPECT_FALSE(std::filesystem::exists(test_path("never.jsonl")));
}

// ---- a placement in a model file ---------------------------------------------------------

const std::string kTwoMlpParts = "hidden@cpu:0;softmax_linear@cpu:1";

// The built-in mlp's model file with "placement": placement_json on its second line, written to
// <test dir>/name; returns its path. *text gets the file's text.
std::string mlp_file(const std::string& placement_json, const std::string& name,
                     std::string* text = nullptr) {
  std::string t;
  for (const BuiltinModel& m : builtin_models())
    if (m.name == "mlp") t = m.text;
  EXPECT_EQ(t.rfind("{\n", 0), 0u) << t;
  t.insert(2, "  \"placement\": " + placement_json + ",\n");
  const std::string path = test_path(name);
  std::ofstream(path) << t;
  if (text != nullptr) *text = t;
  return path;
}

// kMlpRun with --model FILE.
std::string mlp_run_of(const std::string& model) {
  std::string run = kMlpRun;
  run.replace(run.find("--model mlp"), 11, "--model " + model);
  return run;
}

// A file's placement is the run's when --placement is not given: the same parts and
// micro-batches, the same checkpoint bit for bit as the flag's run, and the config records it.
TEST(PlacementCli, ModelFilePlacementTrainsLikeTheSameFlag) {
  const std::string file = mlp_file("\"" + kTwoMlpParts + "\"", "placed.json");
  const std::string ck1 = test_path("ck1"), ck2 = test_path("ck2");
  const std::string m1 = test_path("m1.jsonl"), m2 = test_path("m2.jsonl");
  std::string out;
  ASSERT_EQ(run_towers(kMlpRun + "--checkpoint-dir " + ck1 + " --metrics " + m1 + " --placement '" +
                           kTwoMlpParts + "' --micro-batches 2",
                       &out),
            0)
      << out;
  // --micro-batches needs a placement: the file's.
  ASSERT_EQ(run_towers(mlp_run_of(file) + "--checkpoint-dir " + ck2 + " --metrics " + m2 +
                           " --micro-batches 2",
                       &out),
            0)
      << out;
  auto g = build_model("mlp");
  const size_t n = g->layout().total();
  auto a = io::load_checkpoint(ck1 + "/ckpt-000000008.safetensors", g->layout(), {"momentum"});
  auto b = io::load_checkpoint(ck2 + "/ckpt-000000008.safetensors", g->layout(), {"momentum"});
  EXPECT_EQ(std::memcmp(a.params.data(), b.params.data(), sizeof(float) * n), 0) << "parameters";
  ASSERT_EQ(a.slots.size(), 1u);
  ASSERT_EQ(b.slots.size(), 1u);
  EXPECT_EQ(std::memcmp(a.slots[0].second.data(), b.slots[0].second.data(), sizeof(float) * n), 0)
      << "momentum";
  std::vector<float> init(n);
  g->layout().initialize(init.data(), 3);
  EXPECT_NE(std::memcmp(init.data(), b.params.data(), sizeof(float) * n), 0)
      << "the parameters did not move";
  for (const std::string& m : {m1, m2}) {
    SCOPED_TRACE(m);
    const auto config = metrics_events(m, "config");
    ASSERT_EQ(config.size(), 1u);
    EXPECT_EQ(config[0]["config"]["placement"], kTwoMlpParts);
    const auto summary = metrics_events(m, "summary");
    ASSERT_EQ(summary.size(), 1u);
    const auto& pipe = summary[0]["pipeline"];
    EXPECT_EQ(pipe["placement"], kTwoMlpParts);
    EXPECT_EQ(pipe["micro_batches"], 2);
    ASSERT_EQ(pipe["towers"].size(), 2u);
    for (const auto& t : pipe["towers"]) {
      ASSERT_EQ(t["parts"].size(), 2u);
      EXPECT_EQ(t["parts"][0]["layers"], "hidden");
      EXPECT_EQ(t["parts"][1]["device"], "cpu:1");
    }
  }
}

// --placement overrides the file's: another placement, or none for whole towers.
TEST(PlacementCli, FlagOverridesTheModelFilesPlacement) {
  const std::string file = mlp_file("\"" + kTwoMlpParts + "\"", "placed.json");
  const std::string m1 = test_path("m1.jsonl"), m2 = test_path("m2.jsonl");
  std::string out;
  ASSERT_EQ(run_towers(
                mlp_run_of(file) + "--metrics " + m1 + " --placement 'hidden,softmax_linear@cpu:2'",
                &out),
            0)
      << out;
  auto summary = metrics_events(m1, "summary");
  ASSERT_EQ(summary.size(), 1u);
  EXPECT_EQ(metrics_events(m1, "config")[0]["config"]["placement"], "hidden,softmax_linear@cpu:2");
  for (const auto& t : summary[0]["pipeline"]["towers"]) {
    ASSERT_EQ(t["parts"].size(), 1u);
    EXPECT_EQ(t["parts"][0]["device"], "cpu:2");
    EXPECT_EQ(t["parts"][0]["layers"], "hidden..softmax_linear");
  }
  ASSERT_EQ(run_towers(mlp_run_of(file) + "--metrics " + m2 + " --placement none", &out), 0) << out;
  summary = metrics_events(m2, "summary");
  ASSERT_EQ(summary.size(), 1u);
  EXPECT_FALSE(summary[0].contains("pipeline")) << "whole towers have no pipeline";
  EXPECT_EQ(metrics_events(m2, "config")[0]["config"]["placement"], "");
  // Without a placement micro-batches have nothing to flow through.
  EXPECT_EQ(run_towers(mlp_run_of(file) + "--placement none --micro-batches 2", &out), 1);
  EXPECT_NE(out.find("--micro-batches needs --placement"), std::string::npos) << out;
}

// A bad placement in a file is an error at its place in the file, as the file's other errors
// are, whatever --placement says; the run's checks of a placement name the file too.
TEST(PlacementCli, BadPlacementInAModelFileNamesTheFileLineAndColumn) {
  const std::string m = " --metrics " + test_path("never.jsonl");
  auto expect_error = [&](const std::string& placement_json, const std::string& flags,
                          const std::vector<std::string>& needles) {
    std::string text;
    const std::string file = mlp_file(placement_json, "net.json", &text);
    const size_t at = text.find(placement_json);  // on line 2
    const std::string where = fmt::format("{}:2:{}: field 'placement'", file, at - text.find('\n'));
    std::string out;
    EXPECT_EQ(run_towers(mlp_run_of(file) + flags + m, &out), 1) << flags << "\n" << out;
    EXPECT_NE(out.find("towers: error: " + where), std::string::npos)
        << "'" << where << "' not in: " << out;
    for (const std::string& n : needles)
      EXPECT_NE(out.find(n), std::string::npos) << "'" << n << "' not in: " << out;
    EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1) << "one line: " << out;
  };
  expect_error("\"hidden@cpu:0;logits@cpu:1\"", "",
               {"unknown layer 'logits' in part 2", "model mlp has: hidden, softmax_linear"});
  expect_error("\"hidden@cpu:0;softmax_linear@tpu:1\"", "", {"unknown device 'tpu:1'"});
  expect_error("\"softmax_linear@cpu:0;hidden@cpu:1\"", "", {"parts out of order"});
  expect_error("\"hidden@cpu:0;logits@cpu:1\"", "--placement '" + kTwoMlpParts + "'",
               {"unknown layer 'logits'"});
  expect_error("\"" + kTwoMlpParts + "\"", "--device cuda",
               {"with --device cuda: a placed tower names its devices", "--placement none"});
  // Micro-batches are a flag: its errors name the flag, with the file's placement.
  std::string out;
  const std::string file = mlp_file("\"" + kTwoMlpParts + "\"", "placed.json");
  EXPECT_EQ(run_towers(mlp_run_of(file) + "--micro-batches 4" + m, &out), 1) << out;
  EXPECT_NE(out.find("--micro-batches 4: micro-batches of 32 examples"), std::string::npos) << out;
  EXPECT_FALSE(std::filesystem::exists(test_path("never.jsonl")));
}

}  // namespace
}  // namespace towers
