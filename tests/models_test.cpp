// Model tests: the tutorial net's shapes and parameter count, and a gradient check of the
// whole cifar10 net (cross-entropy through every layer) on a tiny batch. Model files: the
// built-in files give the tutorial's nets exactly (their layouts as data below, and the same
// logits and gradients as the nets written directly in C++), and every kind of bad file gives
// one error that points at the file, line and column, the layer and the field.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include "core/check.h"
#include "core/rng.h"
#include "cli_util.h"
#include "gradcheck.h"
#include "io/json_source.h"
#include "layers/conv2d.h"
#include "layers/dense.h"
#include "layers/gelu.h"
#include "layers/global_avg_pool.h"
#include "layers/lrn.h"
#include "layers/maxpool.h"
#include "models/builtin_models.h"
#include "models/model_file.h"
#include "models/models.h"
#include "towers/tower.h"

namespace towers {
namespace {

TEST(Models, Cifar10HasTheTutorialsParameterCount) {
  auto g = build_model("cifar10");
  EXPECT_EQ(g->layout().count(), 1068298);
  std::vector<std::string> names;
  for (const auto& l : g->layers()) names.push_back(l->name());
  EXPECT_EQ(names, (std::vector<std::string>{"conv1", "pool1", "norm1", "conv2", "norm2", "pool2",
                                             "local3", "local4", "softmax_linear"}));
  EXPECT_EQ(g->layers()[5]->out_shape(), (Shape{64, 6, 6}));
  EXPECT_EQ(g->layout().find("conv1/weight").spec.shape, (Shape{64, 3, 5, 5}));
  EXPECT_EQ(g->layout().find("local3/weight").spec.shape, (Shape{384, 2304}));
  EXPECT_FLOAT_EQ(g->layout().find("local3/weight").spec.weight_decay, 0.004f);
  EXPECT_FLOAT_EQ(g->layout().find("conv1/weight").spec.weight_decay, 0.0f);
}

TEST(Models, FashionIsTheSameNetOn28x28x1) {
  auto g = build_model("fashion");
  EXPECT_EQ(g->input_shape(), (Shape{1, 28, 28}));
  EXPECT_EQ(g->layout().find("local3/weight").spec.shape, (Shape{384, 3136}));
}

TEST(Models, UnknownNameListsTheKnownOnes) {
  try {
    build_model("resnet9000");
    FAIL();
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("resnet9000"), std::string::npos);
    EXPECT_NE(m.find("cifar10"), std::string::npos);
  }
}

TEST(Models, InitialisationIsDeterministicAndFollowsTheTutorial) {
  auto g = build_model("cifar10");
  std::vector<float> a(g->layout().total()), b(g->layout().total());
  g->layout().initialize(a.data(), 7);
  g->layout().initialize(b.data(), 7);
  EXPECT_EQ(a, b);
  const Variable& c2b = g->layout().find("conv2/bias");
  EXPECT_FLOAT_EQ(a[c2b.offset], 0.1f);
  const Variable& w = g->layout().find("conv1/weight");
  double s2 = 0, mx = 0;
  for (int64_t i = 0; i < w.size; ++i) s2 += a[w.offset + i] * a[w.offset + i], mx = std::max(mx, (double)std::fabs(a[w.offset + i]));
  EXPECT_LE(mx, 2 * 5e-2 + 1e-6);  // truncated at 2 stddev
  EXPECT_NEAR(std::sqrt(s2 / w.size), 5e-2 * 0.88, 5e-3);  // truncated normal's std ~0.88 sigma
}

TEST(Models, WholeCifar10NetGradientMatchesNumerical) {
  auto g = build_model("cifar10");
  CpuTower tower(*g, 2, 2);
  testing::expect_cifar10_gradients_match_numerical(tower);
}

// The check above can fail: with every gradient 10% off (twice its relative tolerance), every
// variable is reported.
TEST(Models, WholeNetCheckRejectsAGradientTenPercentOff) {
  auto g = build_model("cifar10");
  CpuTower tower(*g, 2, 2);
  ::testing::TestPartResultArray failures;
  {
    ::testing::ScopedFakeTestPartResultReporter intercept(
        ::testing::ScopedFakeTestPartResultReporter::INTERCEPT_ONLY_CURRENT_THREAD, &failures);
    testing::expect_cifar10_gradients_match_numerical(tower, 1.1f);
  }
  size_t mismatched = 0;
  for (int i = 0; i < failures.size(); ++i)
    mismatched += std::string(failures.GetTestPartResult(i).message()).find("analytic") !=
                  std::string::npos;
  EXPECT_EQ(mismatched, g->layout().variables().size());
}

// ---- the built-in model files ----------------------------------------------------------------

struct LayerFact {
  std::string name, kind;
  Shape out;
};
struct VarFact {
  std::string name;
  Shape shape;
  int64_t offset;
  Init init;
  float weight_decay;
};
struct ModelFacts {
  std::string model;
  Shape input;
  int classes;
  int64_t total, count;
  std::vector<LayerFact> layers;
  std::vector<VarFact> vars;
};

using Kind = Init::Kind;

// The tutorial's nets as towers has always laid them out: layer names and output shapes,
// variables with their offsets in the flat array, initialisers and weight decay.
const std::vector<ModelFacts>& expected_models() {
  const auto tn = [](float s) { return Init::truncated_normal(s); };
  const auto c = [](float v) { return Init::constant(v); };
  static const std::vector<ModelFacts> facts = {
      {"cifar10",
       {3, 24, 24},
       10,
       1068304,
       1068298,
       {{"conv1", "conv2d", {64, 24, 24}},
        {"pool1", "maxpool", {64, 12, 12}},
        {"norm1", "lrn", {64, 12, 12}},
        {"conv2", "conv2d", {64, 12, 12}},
        {"norm2", "lrn", {64, 12, 12}},
        {"pool2", "maxpool", {64, 6, 6}},
        {"local3", "dense", {384}},
        {"local4", "dense", {192}},
        {"softmax_linear", "dense", {10}}},
       {{"conv1/weight", {64, 3, 5, 5}, 0, tn(5e-2f), 0.0f},
        {"conv1/bias", {64}, 4800, c(0.0f), 0.0f},
        {"conv2/weight", {64, 64, 5, 5}, 4864, tn(5e-2f), 0.0f},
        {"conv2/bias", {64}, 107264, c(0.1f), 0.0f},
        {"local3/weight", {384, 2304}, 107328, tn(0.04f), 0.004f},
        {"local3/bias", {384}, 992064, c(0.1f), 0.0f},
        {"local4/weight", {192, 384}, 992448, tn(0.04f), 0.004f},
        {"local4/bias", {192}, 1066176, c(0.1f), 0.0f},
        {"softmax_linear/weight", {10, 192}, 1066368, tn(1.0f / 192.0f), 0.0f},
        {"softmax_linear/bias", {10}, 1068288, c(0.0f), 0.0f}}},
      {"fashion",
       {1, 28, 28},
       10,
       1384592,
       1384586,
       {{"conv1", "conv2d", {64, 28, 28}},
        {"pool1", "maxpool", {64, 14, 14}},
        {"norm1", "lrn", {64, 14, 14}},
        {"conv2", "conv2d", {64, 14, 14}},
        {"norm2", "lrn", {64, 14, 14}},
        {"pool2", "maxpool", {64, 7, 7}},
        {"local3", "dense", {384}},
        {"local4", "dense", {192}},
        {"softmax_linear", "dense", {10}}},
       {{"conv1/weight", {64, 1, 5, 5}, 0, tn(5e-2f), 0.0f},
        {"conv1/bias", {64}, 1600, c(0.0f), 0.0f},
        {"conv2/weight", {64, 64, 5, 5}, 1664, tn(5e-2f), 0.0f},
        {"conv2/bias", {64}, 104064, c(0.1f), 0.0f},
        {"local3/weight", {384, 3136}, 104128, tn(0.04f), 0.004f},
        {"local3/bias", {384}, 1308352, c(0.1f), 0.0f},
        {"local4/weight", {192, 384}, 1308736, tn(0.04f), 0.004f},
        {"local4/bias", {192}, 1382464, c(0.1f), 0.0f},
        {"softmax_linear/weight", {10, 192}, 1382656, tn(1.0f / 192.0f), 0.0f},
        {"softmax_linear/bias", {10}, 1384576, c(0.0f), 0.0f}}},
      {"mlp",
       {1, 28, 28},
       10,
       101776,
       101770,
       {{"hidden", "dense", {128}}, {"softmax_linear", "dense", {10}}},
       {{"hidden/weight", {128, 784}, 0, tn(0.05f), 0.0f},
        {"hidden/bias", {128}, 100352, c(0.1f), 0.0f},
        {"softmax_linear/weight", {10, 128}, 100480, tn(1.0f / 128.0f), 0.0f},
        {"softmax_linear/bias", {10}, 101760, c(0.0f), 0.0f}}},
  };
  return facts;
}

// The same nets written directly against the layer classes: an oracle for what the files say
// beyond the layout (strides, padding, ReLUs, the LRN's constants).
std::unique_ptr<Graph> reference_net(const std::string& model) {
  using kernels::Padding;
  if (model == "mlp") {
    auto g = std::make_unique<Graph>("mlp", Shape{1, 28, 28}, 10);
    g->add<Dense>("hidden", DenseConfig{128, true, 0.05f, 0.1f, 0.0f});
    g->add<Dense>("softmax_linear", DenseConfig{10, false, 1.0f / 128.0f, 0.0f, 0.0f});
    return g;
  }
  auto g =
      std::make_unique<Graph>(model, model == "cifar10" ? Shape{3, 24, 24} : Shape{1, 28, 28}, 10);
  const kernels::LrnParams lrn{4, 1.0f, 0.001f / 9.0f, 0.75f};
  g->add<Conv2D>("conv1", Conv2DConfig{64, 5, 1, Padding::Same, true, 5e-2f, 0.0f, 0.0f});
  g->add<MaxPool>("pool1", 3, 2, Padding::Same);
  g->add<Lrn>("norm1", lrn);
  g->add<Conv2D>("conv2", Conv2DConfig{64, 5, 1, Padding::Same, true, 5e-2f, 0.1f, 0.0f});
  g->add<Lrn>("norm2", lrn);
  g->add<MaxPool>("pool2", 3, 2, Padding::Same);
  g->add<Dense>("local3", DenseConfig{384, true, 0.04f, 0.1f, 0.004f});
  g->add<Dense>("local4", DenseConfig{192, true, 0.04f, 0.1f, 0.004f});
  g->add<Dense>("softmax_linear", DenseConfig{10, false, 1.0f / 192.0f, 0.0f, 0.0f});
  return g;
}

TEST(ModelFile, BuiltInsAreTheModelsOfModelsFolder) {
  EXPECT_EQ(model_names(), (std::vector<std::string>{"airbench", "cifar10", "fashion", "mlp",
                                                      "resnet-small-cifar", "resnet-small"}));  // file-name order: '-' < '.'
  for (const BuiltinModel& m : builtin_models()) {
    EXPECT_EQ(m.file, "models/" + std::string(m.name) + ".json");
    const ModelSpec spec = parse_model(m.text, std::string(m.file));
    EXPECT_EQ(spec.name, m.name) << "the file's \"name\"";
    EXPECT_FALSE(spec.placement) << m.name << ": a built-in model keeps no placement";
  }
}

// The compiled-in text is the file's (CMake regenerates it when a file changes).
TEST(ModelFile, BuiltInsMatchTheFilesOfTheSourceTree) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::path(TOWERS_SOURCE_DIR) / "models";
  if (!fs::is_directory(dir)) GTEST_SKIP() << "no source tree at " << dir << " (a carried build)";
  size_t files = 0;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().extension() != ".json") continue;
    ++files;
    std::ifstream in(e.path(), std::ios::binary);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    bool found = false;
    for (const BuiltinModel& m : builtin_models())
      if (m.name == e.path().stem().string()) {
        found = true;
        EXPECT_EQ(m.text, text) << e.path();
      }
    EXPECT_TRUE(found) << e.path() << " is not compiled in: re-run cmake";
  }
  EXPECT_EQ(files, builtin_models().size());
}

// The nets beyond the tutorial: where each stage ends, and BatchNorm's running statistics as
// state variables next to the trainable ones.
TEST(ModelFile, ResNetAndAirbenchHaveTheirLayouts) {
  struct Stop {
    const char* layer;
    Shape out;
  };
  const std::vector<std::pair<std::string, std::vector<Stop>>> nets = {
      {"resnet-small",
       {{"conv1", {24, 28, 28}}, {"res1", {24, 28, 28}}, {"pool1", {24, 14, 14}},
        {"res2", {48, 14, 14}}, {"pool2", {48, 7, 7}}, {"res3", {96, 7, 7}}, {"pool", {96, 1, 1}},
        {"logits", {10}}}},
      {"resnet-small-cifar",
       {{"conv1", {24, 32, 32}}, {"pool1", {24, 16, 16}}, {"res3", {96, 8, 8}}, {"logits", {10}}}},
      {"airbench",
       {{"whiten", {24, 31, 31}}, {"group1_pool", {64, 15, 15}}, {"group2_pool", {256, 7, 7}},
        {"group3_gelu2", {256, 3, 3}}, {"pool", {256, 1, 1}}, {"logits", {10}}}}};
  for (const auto& [model, stops] : nets) {
    SCOPED_TRACE(model);
    auto g = build_model(model);
    for (const Stop& stop : stops) {
      const auto it = std::find_if(g->layers().begin(), g->layers().end(),
                                   [&](const auto& l) { return l->name() == stop.layer; });
      ASSERT_NE(it, g->layers().end()) << stop.layer;
      EXPECT_EQ((*it)->out_shape(), stop.out) << stop.layer;
    }
    int trainable = 0, state = 0;
    for (const Variable& v : g->layout().variables()) {
      trainable += v.spec.trainable;
      state += !v.spec.trainable && v.spec.state_rate > 0.0f;
    }
    // conv and dense: weight and bias; batchnorm: gamma and beta, and two running statistics.
    const int convs = model == "airbench" ? 7 : 9, bns = model == "airbench" ? 6 : 9;
    EXPECT_EQ(trainable, 2 * (convs + 1) + 2 * bns);
    EXPECT_EQ(state, 2 * bns);
  }
  // 271,258 weights and biases (9 convolutions, the dense layer) and 4 x 504 of BatchNorm.
  EXPECT_EQ(build_model("resnet-small")->layout().count(), 273'274);
}

TEST(ModelFile, BuiltInsHaveTheTutorialsLayouts) {
  for (const ModelFacts& want : expected_models()) {
    SCOPED_TRACE(want.model);
    auto g = build_model(want.model);
    EXPECT_EQ(g->model(), want.model);
    EXPECT_EQ(g->input_shape(), want.input);
    EXPECT_EQ(g->num_classes(), want.classes);
    EXPECT_EQ(g->layout().total(), want.total);
    EXPECT_EQ(g->layout().count(), want.count);
    ASSERT_EQ(g->layers().size(), want.layers.size());
    for (size_t i = 0; i < want.layers.size(); ++i) {
      EXPECT_EQ(g->layers()[i]->name(), want.layers[i].name);
      EXPECT_EQ(g->layers()[i]->kind(), want.layers[i].kind);
      EXPECT_EQ(g->layers()[i]->out_shape(), want.layers[i].out) << want.layers[i].name;
    }
    const auto& vars = g->layout().variables();
    ASSERT_EQ(vars.size(), want.vars.size());
    for (size_t i = 0; i < vars.size(); ++i) {
      const VarFact& v = want.vars[i];
      SCOPED_TRACE(v.name);
      EXPECT_EQ(vars[i].spec.name, v.name);
      EXPECT_EQ(vars[i].spec.shape, v.shape);
      EXPECT_EQ(vars[i].offset, v.offset);
      EXPECT_EQ(vars[i].spec.init.kind, v.init.kind);
      EXPECT_EQ(vars[i].spec.init.value, v.init.value);  // bitwise: the same float
      EXPECT_EQ(vars[i].spec.weight_decay, v.weight_decay);
      EXPECT_TRUE(vars[i].spec.trainable);
    }
  }
}

// Same initial parameters, and the same logits, loss and gradients bit for bit, as the nets
// written in C++ (the tutorial's; the others exist only as files).
TEST(ModelFile, BuiltInsComputeExactlyLikeTheNetsWrittenInCpp) {
  for (const std::string model : {"cifar10", "fashion", "mlp"}) {
    SCOPED_TRACE(model);
    auto file = build_model(model);
    auto ref = reference_net(model);
    const ParameterLayout& layout = ref->layout();
    ASSERT_EQ(file->layout().total(), layout.total());
    std::vector<float> a(layout.total()), b(layout.total());
    file->layout().initialize(a.data(), 11);
    layout.initialize(b.data(), 11);
    ASSERT_EQ(std::memcmp(a.data(), b.data(), sizeof(float) * a.size()), 0) << "initial parameters";

    const int64_t n = 4;
    std::vector<float> x(n * numel(ref->input_shape()));
    Rng rng(3);
    for (float& v : x) v = rng.uniform(-1.0f, 1.0f);
    const std::vector<int32_t> y = {1, 7, 3, 0};
    CpuTower tf(*file, n, 1), tr(*ref, n, 1);
    tf.load_params(a.data());
    tr.load_params(b.data());
    const StepStats sf = tf.compute_gradients(x.data(), y.data(), n, 1.0f / n);
    const StepStats sr = tr.compute_gradients(x.data(), y.data(), n, 1.0f / n);
    EXPECT_EQ(sf.loss_sum, sr.loss_sum);
    EXPECT_EQ(std::memcmp(tf.logits(), tr.logits(), sizeof(float) * n * 10), 0) << "logits";
    EXPECT_EQ(std::memcmp(tf.grads(), tr.grads(), sizeof(float) * layout.total()), 0)
        << "gradients";
  }
}

TEST(ModelFile, AUsersFileIsReadFromItsPath) {
  const std::string path = testutil::test_path("tiny.json");
  std::ofstream(path) << R"({"name": "tiny", "input": [2, 6, 6], "classes": 3, "layers": [
    {"name": "c", "type": "conv2d", "filters": 4, "kernel": 3, "stride": 2, "padding": "valid",
     "weight_init": {"stddev": 0.1}, "inputs": ["input"]},
    {"name": "n", "type": "lrn"},
    {"name": "out", "type": "dense", "units": 3, "relu": false, "weight_init": {"stddev": 0.2},
     "bias_init": 0.5, "weight_decay": 0.001, "inputs": ["n"]}]})";
  auto g = build_model(path);
  EXPECT_EQ(g->model(), "tiny");
  EXPECT_EQ(g->layers()[0]->out_shape(), (Shape{4, 2, 2}));  // ceil((6 - 3 + 1) / 2)
  EXPECT_EQ(g->layout().count(), 4 * 2 * 9 + 4 + 3 * 16 + 3);
  const Variable& w = g->layout().find("out/weight");
  EXPECT_EQ(w.spec.init.value, 0.2f);
  EXPECT_EQ(w.spec.weight_decay, 0.001f);
  EXPECT_EQ(g->layout().find("out/bias").spec.init.value, 0.5f);
  EXPECT_EQ(g->layout().find("c/bias").spec.init.value, 0.0f);  // bias_init defaults to 0
  EXPECT_TRUE(is_model_path(path));
  EXPECT_TRUE(is_model_path("nets/x"));
  EXPECT_FALSE(is_model_path("cifar10"));
}

// GELU keeps any shape (after a dense layer too); global average pooling turns (C, H, W) into
// (C, 1, 1), which a dense layer reads as C inputs.
TEST(ModelFile, GeluAndGlobalAvgPoolBuildFromAFile) {
  const std::string path = testutil::test_path("gap.json");
  std::ofstream(path) << R"({"name": "gap", "input": [3, 10, 10], "classes": 4, "layers": [
    {"name": "c", "type": "conv2d", "filters": 8, "kernel": 3, "relu": false,
     "weight_init": {"stddev": 0.1}},
    {"name": "act", "type": "gelu"},
    {"name": "gap", "type": "global_avg_pool", "inputs": ["act"]},
    {"name": "h", "type": "dense", "units": 6, "relu": false, "weight_init": {"stddev": 0.1}},
    {"name": "act2", "type": "gelu"},
    {"name": "out", "type": "dense", "units": 4, "relu": false, "weight_init": {"stddev": 0.1}}]})";
  auto g = build_model(path);
  ASSERT_EQ(g->layers().size(), 6u);
  EXPECT_EQ(g->layers()[1]->kind(), "gelu");
  EXPECT_EQ(g->layers()[1]->out_shape(), (Shape{8, 10, 10}));
  EXPECT_EQ(g->layers()[2]->kind(), "global_avg_pool");
  EXPECT_EQ(g->layers()[2]->out_shape(), (Shape{8, 1, 1}));
  EXPECT_EQ(g->layers()[4]->out_shape(), (Shape{6}));
  EXPECT_EQ(g->layout().count(), 8 * 3 * 9 + 8 + 6 * 8 + 6 + 4 * 6 + 4);
  const ModelSpec spec = read_model_file(path);
  EXPECT_TRUE(std::holds_alternative<GeluConfig>(spec.layers[1].config));
  EXPECT_TRUE(std::holds_alternative<GlobalAvgPoolConfig>(spec.layers[2].config));
  const std::vector<std::string> types = layer_types();
  EXPECT_NE(std::find(types.begin(), types.end(), "gelu"), types.end());
  EXPECT_NE(std::find(types.begin(), types.end(), "global_avg_pool"), types.end());
}

// ---- errors in model files -------------------------------------------------------------------

// (line, column) of the first occurrence of `at` in text.
std::pair<int64_t, int64_t> position_of(const std::string& text, const std::string& at) {
  const size_t offset = text.find(at);
  EXPECT_NE(offset, std::string::npos) << "'" << at << "' is not in the text";
  const size_t line_start = text.rfind('\n', offset);
  const int64_t line =
      1 + std::count(text.begin(), text.begin() + static_cast<std::ptrdiff_t>(offset), '\n');
  const int64_t column =
      static_cast<int64_t>(offset - (line_start == std::string::npos ? 0 : line_start + 1)) + 1;
  return {line, column};
}

// Writes text as <test dir>/<name> and returns its path and the message of the one error
// that building it gives.
std::pair<std::string, std::string> model_error(const std::string& text, const std::string& name) {
  const std::string path = testutil::test_path(name);
  std::ofstream(path) << text;
  try {
    build_model(path);
  } catch (const Error& e) {
    return {path, e.what()};
  }
  ADD_FAILURE() << "no error for:\n" << text;
  return {path, ""};
}

struct BadModel {
  std::string what;  // the kind of error, and the file's name
  std::string text;
  std::string at;  // where the error must point: the first occurrence of this in the text
  std::vector<std::string> says;  // the layer, the field, and what is wrong
};

// A valid model: 1x8x8 -> conv 3x3 (4) -> pool 2/2 -> dense 10.
std::string net(const std::string& conv = R"("filters": 4, "kernel": 3)",
                const std::string& pool = R"("kernel": 2, "stride": 2)",
                const std::string& out = R"("units": 10)", const std::string& top = "") {
  return R"({"name": "small", "input": [1, 8, 8], "classes": 10,)" + top + R"(
  "layers": [
    {"name": "c1", "type": "conv2d", )" +
         conv + R"(, "weight_init": {"stddev": 0.1}},
    {"name": "p1", "type": "maxpool", )" +
         pool + R"(},
    {"name": "out", "type": "dense", )" +
         out + R"(, "relu": false, "weight_init": {"stddev": 0.1}}
  ]
})";
}

// net()'s layers, to give it a top-level field.
const std::string kConv = R"("filters": 4, "kernel": 3)";
const std::string kPool = R"("kernel": 2, "stride": 2)";
const std::string kOut = R"("units": 10)";

const std::vector<BadModel>& bad_models() {
  static const std::vector<BadModel> cases = {
      {"unknown_type",
       net(R"("filters": 4, "kernel": 3)", R"("kernel": 2, "stride": 2)")
           .replace(net().find("\"maxpool\""), 9, "\"maxpol\""),
       "\"maxpol\"",
       {"layers[1] 'p1': field 'type'", "unknown layer type 'maxpol'", "did you mean 'maxpool'?",
        "known: conv2d, maxpool, lrn, dense, gelu, relu, global_avg_pool, residual, batchnorm, "
        "dropout"}},
      {"missing_field",
       net(R"("kernel": 3)"),
       "{\"name\": \"c1\"",
       {"layers[0] 'c1' (conv2d): missing field 'filters'", "output channels"}},
      {"missing_top_field",
       R"({"name": "m", "input": [1, 8, 8], "layers": []})",
       "{",
       {"missing field 'classes'"}},
      {"unknown_field",
       net(R"("filters": 4, "kernel": 3)", R"("kernel": 2, "strides": 2)"),
       "\"strides\"",
       {"layers[1] 'p1' (maxpool): unknown field 'strides'", "did you mean 'stride'?",
        "known: name, type, inputs, kernel, stride, padding"}},
      {"unknown_top_field",
       net("\"filters\": 4, \"kernel\": 3", "\"kernel\": 2, \"stride\": 2", "\"units\": 10",
           " \"clases\": 10,"),
       "\"clases\"",
       {"unknown field 'clases'", "did you mean 'classes'?"}},
      {"wrong_type",
       net(R"("filters": "4", "kernel": 3)"),
       "\"4\"",
       {"layers[0] 'c1' (conv2d): field 'filters'", "expected an integer, got \"4\" (a string)"}},
      {"wrong_type_bool",
       net(R"("filters": 4, "kernel": 3, "relu": "yes")"),
       "\"yes\"",
       {"layers[0] 'c1' (conv2d): field 'relu'", "expected true or false"}},
      {"out_of_range",
       net(R"("filters": 4, "kernel": 0)"),
       "0, \"weight_init\"",
       {"layers[0] 'c1' (conv2d): field 'kernel'", "must be from 1 to 4096, got 0"}},
      {"out_of_range_float",
       net(R"("filters": 4, "kernel": 3, "weight_decay": -0.5)"),
       "-0.5",
       {"layers[0] 'c1' (conv2d): field 'weight_decay'", "must be >= 0, got -0.5"}},
      {"bad_padding",
       net(R"("filters": 4, "kernel": 3, "padding": "full")"),
       "\"full\"",
       {"layers[0] 'c1' (conv2d): field 'padding'", "unknown padding \"full\"",
        "\"same\", \"valid\""}},
      {"kernel_too_large",
       net(R"("filters": 4, "kernel": 3)", R"("kernel": 9, "stride": 2, "padding": "valid")"),
       "9, \"stride\"",
       {"layers[1] 'p1' (maxpool): field 'kernel'", "9x9 window does not fit its 8x8 input",
        "from layers[0] 'c1'", "\"valid\""}},
      {"image_layer_after_dense",
       R"({"name": "m", "input": [1, 8, 8], "classes": 10, "layers": [
  {"name": "d1", "type": "dense", "units": 32, "weight_init": {"stddev": 0.1}},
  {"name": "c1", "type": "conv2d", "filters": 10, "kernel": 1, "weight_init": {"stddev": 0.1}}]})",
       "\"conv2d\"",
       {"layers[1] 'c1' (conv2d): field 'type'", "needs an image input (C, H, W)",
        "layers[0] 'd1' gives [32]"}},
      {"logits_not_classes",
       net(R"("filters": 4, "kernel": 3)", R"("kernel": 2, "stride": 2)", R"("units": 12)"),
       "12,",
       {"layers[2] 'out' (dense): field 'units'", "12 per example", "\"classes\" is 10"}},
      {"duplicate_layer_name",
       net(R"("filters": 4, "kernel": 3)", R"("kernel": 2, "stride": 2)")
           .replace(net().find("\"out\""), 5, "\"c1\""),
       "\"c1\", \"type\": \"dense\"",
       {"layers[2] 'c1' (dense): field 'name'", "already the name of layers[0] (line 3)"}},
      {"duplicate_key",
       net(R"("filters": 4, "kernel": 3, "kernel": 5)"),
       "\"kernel\": 5",
       {"layers[0] 'c1' (conv2d): field 'kernel' is given twice", "first at line 3"}},
      {"syntax_error",
       net().replace(net().find("},\n    {\"name\": \"p1\""), 2, "}\n"),
       "{\"name\": \"p1\"",
       {"JSON syntax error", "unexpected '{'"}},
      {"inputs_skip_a_layer",
       net(R"("filters": 4, "kernel": 3)", R"("kernel": 2, "stride": 2, "inputs": ["input"])"),
       "[\"input\"]",
       {"layers[1] 'p1' (maxpool): field 'inputs'", "chains",
        "the one before it, 'c1', not 'input'"}},
      {"inputs_several",
       net(R"("filters": 4, "kernel": 3)", R"("kernel": 2, "stride": 2)",
           R"("units": 10, "inputs": ["p1", "c1"])"),
       "[\"p1\", \"c1\"]",
       {"layers[2] 'out' (dense): field 'inputs'", "several inputs"}},
      {"inputs_unknown",
       net(R"("filters": 4, "kernel": 3, "inputs": ["image"])"),
       "[\"image\"]",
       {"layers[0] 'c1' (conv2d): field 'inputs'", "'image' is not the name of an earlier layer"}},
      {"init_type",
       net(R"("filters": 4, "kernel": 3)")
           .replace(net().find("{\"stddev\": 0.1}"), 15, "{\"type\": \"glorot\", \"stddev\": 0.1}"),
       "\"glorot\"",
       {"layers[0] 'c1' (conv2d): field 'weight_init.type'", "unknown initialiser \"glorot\"",
        "truncated_normal"}},
      {"init_missing_stddev",
       net(R"("filters": 4, "kernel": 3)")
           .replace(net().find("{\"stddev\": 0.1}"), 15, "{\"type\": \"truncated_normal\"}"),
       "{\"type\": \"truncated_normal\"}",
       {"layers[0] 'c1' (conv2d): missing field 'weight_init.stddev'"}},
      {"bad_input_shape",
       R"({"name": "m", "input": [3, 24], "classes": 10, "layers": []})",
       "[3, 24]",
       {"field 'input'", "[C, H, W]"}},
      {"bad_layer_name",
       net(R"("filters": 4, "kernel": 3)").replace(net().find("\"c1\""), 4, "\"c 1\""),
       "\"c 1\"",
       {"layers[0] (conv2d): field 'name'", "'c 1' is not a name"}},
      {"layer_named_input",
       net(R"("filters": 4, "kernel": 3)").replace(net().find("\"c1\""), 4, "\"input\""),
       "\"input\", \"type\"",
       {"layers[0] 'input' (conv2d): field 'name'", "names the model's input"}},
      {"lrn_bias",
       R"({"name": "m", "input": [1, 4, 4], "classes": 16, "layers": [
  {"name": "n", "type": "lrn", "bias": 0},
  {"name": "out", "type": "dense", "units": 16, "weight_init": {"stddev": 0.1}}]})",
       "0}",
       {"layers[0] 'n' (lrn): field 'bias'", "must be > 0"}},
      {"nothing_to_train",
       R"({"name": "m", "input": [10, 2, 2], "classes": 10, "layers": [
  {"name": "p", "type": "maxpool", "kernel": 2, "stride": 2}]})",
       "[\n",
       {"field 'layers'", "nothing to train"}},
      {"too_many_parameters",
       net(R"("filters": 1000000, "kernel": 3)", R"("kernel": 2, "stride": 2)", R"("units": 1000)"),
       "1000, \"relu\"",
       {"layers[2] 'out' (dense): field 'units'", "more than the 268435456"}},
      {"not_an_object", "[1, 2]", "[", {"a model file holds one object", "an array"}},
      // "placement": checked against the layers as --placement is, at its value.
      {"placement_unknown_layer",
       net(kConv, kPool, kOut, R"( "placement": "c1,p1@cpu:0;logits@cpu:1",)"),
       "\"c1,p1@cpu:0;logits",
       {"field 'placement': unknown layer 'logits' in part 2", "model small has: c1, p1, out"}},
      {"placement_unknown_device",
       net(kConv, kPool, kOut, R"( "placement": "c1..p1@cpu:0;out@tpu:1",)"),
       "\"c1..p1@cpu:0;out@tpu",
       {"field 'placement': unknown device 'tpu:1' in part 2", "cpu:NxT"}},
      {"placement_gpu",
       net(kConv, kPool, kOut, R"( "placement": "c1..p1@cpu:0;out@cuda:x",)"),
       "\"c1..p1@cpu:0;out@cuda",
       {"field 'placement': unknown device 'cuda:x' in part 2"}},
      {"placement_missing_layer",
       net(kConv, kPool, kOut, R"( "placement": "c1..p1@cpu:0",)"),
       "\"c1..p1@cpu:0\"",
       {"field 'placement': layer out is in no part"}},
      {"placement_out_of_order",
       net(kConv, kPool, kOut, R"( "placement": "out@cpu:1;c1..p1@cpu:0",)"),
       "\"out@cpu:1",
       {"field 'placement': parts out of order"}},
      {"placement_empty",
       net(kConv, kPool, kOut, R"( "placement": "",)"),
       "\"\",",
       {"field 'placement': empty placement", "c1..out@cpu:0"}},
      {"placement_not_a_string",
       net(kConv, kPool, kOut, R"( "placement": ["c1..out@cpu"],)"),
       "[\"c1..out@cpu\"]",
       {"field 'placement': expected a string, got [\"c1..out@cpu\"] (an array)"}},
      {"placement_control_character",
       net(kConv, kPool, kOut, R"( "placement": "c1..p1@cpu:0;\nout@cpu:1",)"),
       "\"c1..p1@cpu:0;",
       {"field 'placement': a placement is one line of text"}},
      {"placement_misspelt",
       net(kConv, kPool, kOut, R"( "placment": "c1..out@cpu",)"),
       "\"placment\"",
       {"unknown field 'placment'", "did you mean 'placement'?"}},
      // Micro-batches depend on --batch: a flag, not a field of the model.
      {"micro_batches_is_a_flag",
       net(kConv, kPool, kOut, R"( "micro_batches": 2,)"),
       "\"micro_batches\"",
       {"unknown field 'micro_batches'", "placement"}},
      {"gelu_has_no_fields",
       R"({"name": "g", "input": [1, 8, 8], "classes": 10, "layers": [
    {"name": "c1", "type": "conv2d", "filters": 4, "kernel": 3, "weight_init": {"stddev": 0.1}},
    {"name": "act", "type": "gelu", "approximate": "tanh"},
    {"name": "out", "type": "dense", "units": 10, "weight_init": {"stddev": 0.1}}]})",
       "\"approximate\"",
       {"layers[1] 'act' (gelu): unknown field 'approximate'", "known: name, type, inputs)"}},
      {"global_avg_pool_has_no_fields",
       R"({"name": "g", "input": [1, 8, 8], "classes": 10, "layers": [
    {"name": "c1", "type": "conv2d", "filters": 4, "kernel": 3, "weight_init": {"stddev": 0.1}},
    {"name": "gap", "type": "global_avg_pool", "kernel": 8},
    {"name": "out", "type": "dense", "units": 10, "weight_init": {"stddev": 0.1}}]})",
       "\"kernel\": 8",
       {"layers[1] 'gap' (global_avg_pool): unknown field 'kernel'", "known: name, type, inputs)"}},
      {"global_avg_pool_needs_an_image",
       R"({"name": "g", "input": [1, 8, 8], "classes": 10, "layers": [
    {"name": "h", "type": "dense", "units": 10, "weight_init": {"stddev": 0.1}},
    {"name": "gap", "type": "global_avg_pool"}]})",
       "\"global_avg_pool\"",
       {"layers[1] 'gap' (global_avg_pool): field 'type'", "needs an image input (C, H, W)",
        "layers[0] 'h' gives [10]"}},
      {"dropout_rate_must_be_below_one",
       R"({"name": "g", "input": [1, 8, 8], "classes": 10, "layers": [
    {"name": "h", "type": "dense", "units": 32, "weight_init": {"stddev": 0.1}},
    {"name": "drop", "type": "dropout", "rate": 1.0},
    {"name": "out", "type": "dense", "units": 10, "weight_init": {"stddev": 0.1}}]})",
       "1.0}",
       {"layers[1] 'drop' (dropout): field 'rate'", "must be below 1", "got 1"}},
      {"dropout_rate_is_a_number",
       R"({"name": "g", "input": [1, 8, 8], "classes": 10, "layers": [
    {"name": "h", "type": "dense", "units": 32, "weight_init": {"stddev": 0.1}},
    {"name": "drop", "type": "dropout", "rate": -0.5},
    {"name": "out", "type": "dense", "units": 10, "weight_init": {"stddev": 0.1}}]})",
       "-0.5",
       {"layers[1] 'drop' (dropout): field 'rate'", "-0.5"}},
      {"gelu_keeps_the_shape_so_classes_must_match",
       R"({"name": "g", "input": [1, 8, 8], "classes": 10, "layers": [
    {"name": "c1", "type": "conv2d", "filters": 10, "kernel": 3, "weight_init": {"stddev": 0.1}},
    {"name": "gap", "type": "global_avg_pool"},
    {"name": "act", "type": "gelu", "inputs": ["gap"]},
    {"name": "out", "type": "dense", "units": 9, "weight_init": {"stddev": 0.1}}]})",
       "9,",
       {"layers[3] 'out' (dense): field 'units'", "9 per example", "\"classes\" is 10"}},
  };
  return cases;
}

TEST(ModelFileErrors, EachNamesTheFileLineColumnLayerAndField) {
  for (const BadModel& c : bad_models()) {
    SCOPED_TRACE(c.what);
    const auto [path, message] = model_error(c.text, c.what + ".json");
    const auto [line, column] = position_of(c.text, c.at);
    EXPECT_EQ(message.rfind(fmt::format("{}:{}:{}: ", path, line, column), 0), 0u)
        << "expected " << path << ":" << line << ":" << column << " at the start of: " << message;
    for (const std::string& s : c.says)
      EXPECT_NE(message.find(s), std::string::npos) << "missing '" << s << "' in: " << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << "one line: " << message;
  }
}

// A placement in a file is kept with the place of its value, for the trainer's messages; the
// graph is the same as without it.
TEST(ModelFile, APlacementIsReadWithWhereItIs) {
  const std::string text =
      net(kConv, kPool, kOut, R"( "placement": "c1, p1 @ cpu:0;out@cpu:1x2",)");
  const std::string path = testutil::test_path("placed.json");
  std::ofstream(path) << text;
  const ModelSpec spec = read_model(path);
  ASSERT_TRUE(spec.placement);
  EXPECT_EQ(*spec.placement, "c1, p1 @ cpu:0;out@cpu:1x2");
  const auto [line, column] = position_of(text, "\"c1, p1");
  EXPECT_EQ(spec.placement_origin, fmt::format("{}:{}:{}: field 'placement'", path, line, column));
  const std::unique_ptr<Graph> placed = build_model(path);
  const std::unique_ptr<Graph> plain = build_graph(parse_model(net(), "plain.json"));
  EXPECT_EQ(placed->layout().total(), plain->layout().total());
  EXPECT_EQ(placed->layers().size(), plain->layers().size());
  EXPECT_FALSE(parse_model(net(), "plain.json").placement);
}

TEST(ModelFileErrors, NestingTooDeepIsRefusedWhereItStarts) {
  const std::string head = R"({"name": "m", "description": )";
  const std::string text = head + std::string(100, '[') + std::string(100, ']') + "}";
  const auto [path, message] = model_error(text, "deep.json");
  // The root object and 63 arrays are allowed; the 64th array is not.
  EXPECT_EQ(message.rfind(fmt::format("{}:1:{}: ", path, head.size() + 64), 0), 0u) << message;
  EXPECT_NE(message.find("nested deeper than 64"), std::string::npos) << message;
}

TEST(ModelFileErrors, FilesThatCannotBeReadNameThePath) {
  const std::string dir = testutil::test_path("dir");
  std::filesystem::create_directories(dir);
  const std::string missing = testutil::test_path("missing.json");
  const std::string large = testutil::test_path("large.json");
  std::ofstream(large) << std::string(kMaxModelFileBytes + 1, ' ');
  for (const auto& [path, says] : std::vector<std::pair<std::string, std::string>>{
           {missing, "no such file"}, {dir + "/", "is a directory"}, {large, "larger than"}}) {
    try {
      build_model(path);
      ADD_FAILURE() << "no error for " << path;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("model file '" + path + "'"), std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  }
}

// ---- JsonSource: where values and keys start -------------------------------------------------

TEST(JsonSource, RecordsWhereValuesAndKeysStart) {
  const std::string text =
      "{\"a\": 12,\n"
      " \"b\": \"x\\\"y\",\n"
      " \"c\": [true, null, -1.5e3\n"
      " ],\n"
      " \"d/e\": {\"f\": false}}";
  const io::JsonSource doc = io::JsonSource::parse(text, "t.json");
  EXPECT_EQ(doc.root()["b"], "x\"y");
  using Pos = std::pair<int64_t, int64_t>;
  auto at = [](const io::TextPos& p) { return Pos(p.line, p.column); };
  EXPECT_EQ(at(doc.value_pos("")), Pos(1, 1));
  EXPECT_EQ(at(doc.value_pos("/a")), position_of(text, "12"));
  EXPECT_EQ(at(doc.key_pos("/a")), position_of(text, "\"a\""));
  EXPECT_EQ(at(doc.value_pos("/b")), position_of(text, "\"x"));
  EXPECT_EQ(at(doc.value_pos("/c")), position_of(text, "[true"));
  EXPECT_EQ(at(doc.value_pos("/c/0")), position_of(text, "true"));
  EXPECT_EQ(at(doc.value_pos("/c/1")), position_of(text, "null"));
  EXPECT_EQ(at(doc.value_pos("/c/2")), position_of(text, "-1.5e3"));  // the parser looked past it
  EXPECT_EQ(at(doc.value_pos("/d~1e")), position_of(text, "{\"f\""));
  EXPECT_EQ(at(doc.value_pos("/d~1e/f")), position_of(text, "false"));
  EXPECT_EQ(io::JsonSource::child("/x", "d/e~"), "/x/d~1e~0");
  EXPECT_EQ(doc.where(doc.value_pos("/a")), "t.json:1:7");
  EXPECT_TRUE(doc.duplicate_keys().empty());

  const io::JsonSource dup = io::JsonSource::parse("{\"k\": 1,\n \"k\": 2}", "d.json");
  ASSERT_EQ(dup.duplicate_keys().size(), 1u);
  EXPECT_EQ(dup.duplicate_keys()[0].key, "k");
  EXPECT_EQ(at(dup.duplicate_keys()[0].first), Pos(1, 2));
  EXPECT_EQ(at(dup.duplicate_keys()[0].second), Pos(2, 2));
  try {
    io::JsonSource::parse("{\"k\": 1,\n \"j\" 2}", "s.json");
    ADD_FAILURE() << "no syntax error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).rfind("s.json:2:6: JSON syntax error: ", 0), 0u) << e.what();
  }
}

}  // namespace
}  // namespace towers
