// End-to-end tests of the `towers` command: training runs that learn, exact resume, bitwise
// reproducibility, model files, `towers eval`, and every kind of bad input — each must exit
// non-zero with one message naming the flag or file, and leave no output behind.
#include <sys/wait.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include "cli_util.h"
#include "data/load.h"
#include "data/pipeline.h"
#include "io/checkpoint.h"
#include "models/builtin_models.h"
#include "models/model_file.h"
#include "models/models.h"
#include "towers/tower.h"

namespace towers {
namespace {

namespace fs = std::filesystem;

struct RunResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr together
};

RunResult run_towers(const std::string& args) {
  RunResult r;
  r.exit_code = testutil::run_towers(args, &r.output);
  return r;
}

std::string temp_dir() {
  const fs::path dir = testutil::test_folder(
      "towers_cli_", *::testing::UnitTest::GetInstance()->current_test_info());
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir.string();
}

std::vector<nlohmann::json> read_jsonl(const std::string& path) {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line));
  return out;
}

// A small, fast, learnable run: the MLP on synthetic 28x28x1 data.
const std::string kQuick =
    "train --model mlp --dataset synthetic --synthetic-size 2000 --batch 32 --optimizer momentum "
    "--lr 0.02 --quiet --seed 5 ";

void write_bytes_plain(const std::string& path, const std::string& s) { std::ofstream(path) << s; }

void expect_error(const RunResult& r, const std::vector<std::string>& needles) {
  EXPECT_NE(r.exit_code, 0) << r.output;
  for (const auto& s : needles) EXPECT_NE(r.output.find(s), std::string::npos) << "missing '" << s << "' in: " << r.output;
  EXPECT_EQ(r.output.find("internal error"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("Segmentation"), std::string::npos) << r.output;
}

TEST(Cli, TrainLearnsAndWritesASummary) {
  const std::string dir = temp_dir();
  auto r = run_towers(kQuick + "--epochs 2 --metrics " + dir + "/m.jsonl");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto lines = read_jsonl(dir + "/m.jsonl");
  ASSERT_GE(lines.size(), 3u);
  EXPECT_EQ(lines.front()["event"], "config");
  const auto& s = lines.back();
  ASSERT_EQ(s["event"], "summary");
  for (const char* k : {"test_accuracy", "train_images_per_sec", "wall_seconds", "steps"})
    EXPECT_TRUE(s.contains(k)) << k;
  EXPECT_EQ(s["steps"], 125);  // ceil(2 epochs * 2000 / 32)
  EXPECT_EQ(s["weights"], "trained");                // (no --ema)
  EXPECT_GT(s["test_accuracy"].get<double>(), 0.9);  // chance is 0.1
  EXPECT_GT(s["train_images_per_sec"].get<double>(), 0.0);
  int steps_logged = 0;
  for (const auto& l : lines) steps_logged += l["event"] == "step";
  EXPECT_GE(steps_logged, 2);
}

TEST(Cli, ResumeContinuesExactlyWhereItStopped) {
  const std::string a = temp_dir() + "/a", b = temp_dir() + "/b";
  // Adam (its update count is state), a cosine schedule fixed by --steps 100, and an epoch
  // boundary (62.5 steps) with its reshuffle, evaluation and checkpoint before the stop at 70.
  const std::string run =
      "train --model mlp --dataset synthetic --synthetic-size 2000 --batch 32 --optimizer adam "
      "--lr 0.002 --lr-schedule cosine --quiet --seed 9 --steps 100 ";
  ASSERT_EQ(run_towers(run + "--checkpoint-dir " + a).exit_code, 0);
  // b stops at step 70 of the same 100-step schedule, then resumes.
  auto r1 = run_towers(run + "--stop-at-step 70 --checkpoint-dir " + b);
  ASSERT_EQ(r1.exit_code, 0) << r1.output;
  ASSERT_TRUE(fs::exists(b + "/ckpt-000000070.safetensors")) << r1.output;
  // The run's header says where this job stops, beside the schedule's length.
  const auto said = run_towers(
      "train --model mlp --dataset synthetic --synthetic-size 512 "
      "--steps 8 --stop-at-step 4");
  ASSERT_EQ(said.exit_code, 0) << said.output;
  EXPECT_NE(said.output.find("8 steps (this job stops at step 4: --stop-at-step)"),
            std::string::npos)
      << said.output;
  auto r = run_towers(run + "--resume --checkpoint-dir " + b + " --metrics " + b + "/m.jsonl");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(read_jsonl(b + "/m.jsonl").back()["start_step"], 70);
  auto g = build_model("mlp");
  auto ca = io::load_checkpoint(a + "/ckpt-000000100.safetensors", g->layout(), {"m", "v"});
  auto cb = io::load_checkpoint(b + "/ckpt-000000100.safetensors", g->layout(), {"m", "v"});
  const size_t bytes = sizeof(float) * g->layout().total();
  EXPECT_EQ(std::memcmp(ca.params.data(), cb.params.data(), bytes), 0) << "parameters differ";
  for (int s = 0; s < 2; ++s)
    EXPECT_EQ(std::memcmp(ca.slots[s].second.data(), cb.slots[s].second.data(), bytes), 0)
        << "slot " << ca.slots[s].first << " differs";
  EXPECT_EQ(ca.meta.optimizer_state, cb.meta.optimizer_state);
}

// --resume in a folder with no checkpoint yet (a job killed before its first one) starts from
// the seed, and says so, so that a mistyped folder is not taken for a resumed run.
TEST(Cli, ResumeWithoutACheckpointSaysItStartsFromTheSeed) {
  const std::string dir = temp_dir() + "/none";
  const std::string run =
      "train --model mlp --dataset synthetic --synthetic-size 2000 --batch 32 --seed 5 --resume "
      "--checkpoint-dir " +
      dir + " --steps ";
  auto r = run_towers(run + "3");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("--resume: no checkpoint in '" + dir + "' yet, so from the seed"),
            std::string::npos)
      << r.output;
  EXPECT_TRUE(fs::exists(dir + "/ckpt-000000003.safetensors")) << r.output;
  // With a checkpoint there, the run says where it resumed from instead.
  r = run_towers(run + "5");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.find("no checkpoint"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("resumed from " + dir + "/ckpt-000000003.safetensors at step 3"),
            std::string::npos)
      << r.output;
}

// The recipe flags: label smoothing, Nesterov momentum, the weights' moving average and
// Lookahead. Their slots ("ema", "lookahead") are checkpointed, so a resumed run ends bitwise
// where the uninterrupted one does; evaluations, and `towers eval` of the checkpoint, read the
// averaged weights.
TEST(Cli, RecipeFlagsResumeExactlyAndEvaluateTheAverage) {
  const std::string a = temp_dir() + "/a", b = temp_dir() + "/b";
  const std::string run =
      "train --model mlp --dataset synthetic --synthetic-size 2000 --batch 32 --optimizer "
      "momentum --nesterov --lr 0.02 --label-smoothing 0.1 --ema 0.99 --lookahead 5 --quiet "
      "--seed 9 --steps 100 ";
  auto ra = run_towers(run + "--checkpoint-dir " + a + " --metrics " + a + "/m.jsonl");
  ASSERT_EQ(ra.exit_code, 0) << ra.output;
  ASSERT_EQ(run_towers(run + "--stop-at-step 70 --checkpoint-dir " + b).exit_code, 0);
  auto r = run_towers(run + "--resume --checkpoint-dir " + b);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto g = build_model("mlp");
  const std::vector<std::string> slots = {"momentum", "ema", "lookahead"};
  auto ca = io::load_checkpoint(a + "/ckpt-000000100.safetensors", g->layout(), slots);
  auto cb = io::load_checkpoint(b + "/ckpt-000000100.safetensors", g->layout(), slots);
  const size_t bytes = sizeof(float) * g->layout().total();
  EXPECT_EQ(std::memcmp(ca.params.data(), cb.params.data(), bytes), 0) << "parameters differ";
  for (size_t s = 0; s < slots.size(); ++s)
    EXPECT_EQ(std::memcmp(ca.slots[s].second.data(), cb.slots[s].second.data(), bytes), 0)
        << "slot " << slots[s] << " differs";
  // The average is not the weights (it lags them), and the run's own evaluation is of it.
  EXPECT_NE(std::memcmp(ca.params.data(), ca.slots[1].second.data(), bytes), 0);
  const auto records = read_jsonl(a + "/m.jsonl");
  const double summary = records.back()["test_accuracy"].get<double>();
  EXPECT_GT(summary, 0.5);
  // ... and every record of an evaluation says so (1.6 epochs: one at epoch 1, then the end).
  int evals = 0;
  for (const auto& rec : records)
    if (rec["event"] == "eval" || rec["event"] == "summary") {
      EXPECT_EQ(rec["weights"], "ema") << rec.dump();
      EXPECT_EQ(rec["tta"], "none") << rec.dump();
      ++evals;
    }
  EXPECT_EQ(evals, 2);
  // The terminal says it too, and how the test images were scored.
  auto said = run_towers(
      "train --model mlp --dataset synthetic --synthetic-size 500 --batch 32 "
      "--ema 0.9 --tta flip --steps 20");
  ASSERT_EQ(said.exit_code, 0) << said.output;
  EXPECT_NE(
      said.output.find("the weights' moving average (--ema), with mirror images (--tta flip)"),
      std::string::npos)
      << said.output;
  auto e = run_towers("eval --checkpoint " + a + "/ckpt-000000100.safetensors --metrics " + a +
                      "/e.json");
  ASSERT_EQ(e.exit_code, 0) << e.output;
  const auto ev = read_jsonl(a + "/e.json").at(0);
  EXPECT_EQ(ev["test_accuracy"].get<double>(), summary);
  EXPECT_EQ(ev["weights"], "ema");
  // A file of the trained weights alone (as `towers pull` writes one from the shards) is
  // evaluated with them, and says so, though its config records --ema.
  const std::string c = fs::path(a).parent_path().string() + "/c";
  const std::string plain = io::save_checkpoint(c, ca.meta, g->layout(), ca.params.data(), {}, 0);
  auto p = run_towers("eval --checkpoint " + plain + " --metrics " + c + "/e.json");
  ASSERT_EQ(p.exit_code, 0) << p.output;
  EXPECT_EQ(read_jsonl(c + "/e.json").at(0)["weights"], "trained");
  // Resuming with the wrappers or the loss changed is refused by name.
  expect_error(run_towers(run + "--ema 0 --resume --checkpoint-dir " + b), {"--ema"});
  expect_error(run_towers(run + "--lookahead-alpha 0.8 --resume --checkpoint-dir " + b),
               {"--lookahead-alpha"});
  expect_error(run_towers(run + "--label-smoothing 0.2 --resume --checkpoint-dir " + b),
               {"--label-smoothing"});
}

// --tta flip changes what evaluations measure and nothing else: the training is bitwise the
// run's without it, `towers eval` follows the run's choice unless told otherwise, and the
// flipped score is the mean of each image's and its mirror image's logits, recomputed here
// from the tower's own logits.
TEST(Cli, FlipTestTimeAugmentationScoresTheMeanOfEachImageAndItsMirror) {
  const std::string a = temp_dir() + "/a", b = temp_dir() + "/b";
  const std::string run = "train --model mlp --dataset synthetic --synthetic-size 1000 --batch 32 "
                          "--lr 0.05 --quiet --seed 4 --steps 2 ";
  ASSERT_EQ(run_towers(run + "--tta flip --checkpoint-dir " + a + " --metrics " + a + "/m.jsonl")
                .exit_code, 0);
  ASSERT_EQ(run_towers(run + "--checkpoint-dir " + b + " --metrics " + b + "/m.jsonl").exit_code, 0);
  auto g = build_model("mlp");
  const std::string file = "/ckpt-000000002.safetensors";
  auto ca = io::load_checkpoint(a + file, g->layout(), {});
  auto cb = io::load_checkpoint(b + file, g->layout(), {});
  ASSERT_EQ(std::memcmp(ca.params.data(), cb.params.data(), sizeof(float) * g->layout().total()), 0);
  const double flipped = read_jsonl(a + "/m.jsonl").back()["test_accuracy"].get<double>();
  const double plain = read_jsonl(b + "/m.jsonl").back()["test_accuracy"].get<double>();

  ASSERT_EQ(run_towers("eval --checkpoint " + a + file + " --metrics " + a + "/e.json").exit_code, 0);
  ASSERT_EQ(run_towers("eval --tta none --checkpoint " + a + file + " --metrics " + a + "/n.json")
                .exit_code, 0);
  const auto e = read_jsonl(a + "/e.json").at(0), n = read_jsonl(a + "/n.json").at(0);
  EXPECT_EQ(e["tta"], "flip");
  EXPECT_EQ(e["test_accuracy"].get<double>(), flipped);
  EXPECT_EQ(n["tta"], "none");
  EXPECT_EQ(n["test_accuracy"].get<double>(), plain);

  // The same score by hand: the synthetic test split as the run drew it, its logits and its
  // mirror images' logits from a tower, averaged, argmax against the label.
  data::DatasetRequest req;
  req.name = "synthetic";
  req.synthetic_shape = g->input_shape();
  req.synthetic_train = 1000;
  req.synthetic_test = 200;
  req.seed = 4;
  const data::DataSplit split = data::load_dataset(req);
  const data::Transforms tf = data::transforms_for("none", "synthetic", g->input_shape(), split.test, "mlp");
  const int64_t count = split.test.size(), per = numel(g->input_shape()), k = 10;
  const int64_t w = g->input_shape().back();
  std::vector<float> images(count * per), mirrored(count * per), z(count * k), zm(count * k);
  std::vector<int32_t> labels(count);
  data::make_eval_batch(split.test, tf.eval, 0, count, images.data(), labels.data());
  for (int64_t r = 0; r < count * per / w; ++r)
    for (int64_t x = 0; x < w; ++x) mirrored[r * w + x] = images[r * w + (w - 1 - x)];
  CpuTower tower(*g, count, 1);
  tower.load_params(ca.params.data());
  tower.evaluate(images.data(), labels.data(), count);
  tower.copy_logits(z.data(), count);
  tower.evaluate(mirrored.data(), labels.data(), count);
  tower.copy_logits(zm.data(), count);
  int64_t correct = 0, changed = 0;
  for (int64_t i = 0; i < count; ++i) {
    int64_t best = 0, best_plain = 0;
    for (int64_t j = 1; j < k; ++j) {
      if (0.5f * (z[i * k + j] + zm[i * k + j]) > 0.5f * (z[i * k + best] + zm[i * k + best])) best = j;
      if (z[i * k + j] > z[i * k + best_plain]) best_plain = j;
    }
    correct += best == labels[i];
    changed += best != best_plain;
  }
  EXPECT_EQ(flipped, static_cast<double>(correct) / static_cast<double>(count));
  EXPECT_GT(changed, 0) << "the mirror images never changed a prediction: the check is blind";

  expect_error(run_towers(run + "--tta mirror"), {"--tta", "mirror"});
  expect_error(run_towers("eval --tta crop --checkpoint " + a + file), {"--tta", "crop"});
}

TEST(Cli, FreshRunRefusesADirectoryOfAnotherRunsCheckpoints) {
  const std::string dir = temp_dir();
  ASSERT_EQ(run_towers(kQuick + "--steps 3 --checkpoint-dir " + dir).exit_code, 0);
  expect_error(run_towers(kQuick + "--steps 3 --checkpoint-dir " + dir), {dir, "--resume"});
}

TEST(Cli, SameSeedGivesBitwiseIdenticalRuns) {
  // Two threads are asked for explicitly (on one core they simply take turns), so the
  // comparison happens whatever the machine or its CPU affinity allows.
  const std::string a = temp_dir() + "/a", b = temp_dir() + "/b";
  ASSERT_EQ(run_towers("train --model cifar10 --dataset synthetic --synthetic-size 64 --batch 16 "
                       "--steps 3 --quiet --threads-per-tower 2 --checkpoint-dir " + a).exit_code, 0);
  ASSERT_EQ(run_towers("train --model cifar10 --dataset synthetic --synthetic-size 64 --batch 16 "
                       "--steps 3 --quiet --threads-per-tower 1 --checkpoint-dir " + b).exit_code, 0);
  auto g = build_model("cifar10");
  auto ca = io::load_checkpoint(a + "/ckpt-000000003.safetensors", g->layout(), {});
  auto cb = io::load_checkpoint(b + "/ckpt-000000003.safetensors", g->layout(), {});
  // Different thread counts too: the work split never depends on the threads.
  EXPECT_EQ(std::memcmp(ca.params.data(), cb.params.data(), sizeof(float) * g->layout().total()), 0);
}

TEST(Cli, EvalReportsTheAccuracyOfACheckpoint) {
  const std::string dir = temp_dir();
  ASSERT_EQ(run_towers(kQuick + "--epochs 1 --checkpoint-dir " + dir + " --metrics " + dir + "/m.jsonl").exit_code, 0);
  const double trained = read_jsonl(dir + "/m.jsonl").back()["test_accuracy"];
  auto r = run_towers("eval --checkpoint " + dir + "/ckpt-000000063.safetensors --metrics " + dir + "/e.json");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("test accuracy"), std::string::npos);
  EXPECT_DOUBLE_EQ(read_jsonl(dir + "/e.json").back()["test_accuracy"].get<double>(), trained);
}

TEST(Cli, HelpListsEverySubcommand) {
  auto r = run_towers("--help");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // launch is parsed apart from the others (its flags end at --), and is listed all the same.
  for (const char* cmd : {"train", "scale", "eval", "ps", "pull", "launch", "devices"})
    EXPECT_NE(r.output.find(std::string("\n  ") + cmd + " "), std::string::npos) << cmd << "\n"
                                                                                 << r.output;
  r = run_towers("launch --help");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("--workers"), std::string::npos) << r.output;
}

TEST(CliBadInput, NonsenseFlags) {
  const std::string dir = temp_dir();
  const std::string m = " --metrics " + dir + "/m.jsonl";
  expect_error(run_towers(kQuick + "--steps 5 --towers 0" + m), {"--towers"});
  expect_error(run_towers(kQuick + "--steps 5 --mode hogwild" + m), {"--mode", "hogwild"});
  expect_error(run_towers(kQuick + "--steps 5 --mode ssp" + m), {"--staleness"});
  expect_error(run_towers(kQuick + "--steps 5 --towers 2 --replicas-to-aggregate 3" + m), {"--replicas-to-aggregate"});
  expect_error(run_towers(kQuick + "--steps 5 --towers 2 --slow-tower 2:10" + m), {"--slow-tower", "2:10"});
  expect_error(
      run_towers(kQuick + "--steps 5 --towers 3 --slow-tower 2:lately --replicas-to-aggregate 2" +
                 m),
      {"--slow-tower", "2:lately"});
  expect_error(run_towers(kQuick + "--steps 5 --towers 3 --slow-tower 2:late" + m),
               {"--slow-tower 2:late", "--replicas-to-aggregate below --towers"});
  expect_error(run_towers(kQuick + "--steps 5 --towers 3 --mode async --slow-tower 1:late" + m),
               {"--slow-tower 1:late", "--mode sync", "async towers neither wait"});
  expect_error(run_towers(kQuick +
                          "--steps 5 --towers 3 --replicas-to-aggregate 1 --slow-tower 2:late "
                          "--slow-tower 2:late" +
                          m),
               {"--slow-tower 2:late is given twice"});
  expect_error(run_towers(kQuick +
                          "--steps 5 --towers 2 --mode ssp --staleness 1 --slow-tower 0:late "
                          "--slow-tower 1:late" +
                          m),
               {"--slow-tower", "2 late towers of --towers 2", "--mode ssp"});
  expect_error(run_towers(kQuick +
                          "--steps 5 --towers 3 --replicas-to-aggregate 2 --slow-tower 1:late "
                          "--slow-tower 2:late" +
                          m),
               {"--slow-tower", "2 late towers", "leaves room for 1"});
  expect_error(run_towers(kQuick + "--steps 5 --use-locking" + m), {"--use-locking"});
  expect_error(run_towers(kQuick + "--steps 5 --params gpu" + m), {"--params", "gpu"});
  expect_error(run_towers(kQuick + "--steps 5 --params mirrored" + m), {"--params mirrored", "--device cuda"});
  expect_error(run_towers(kQuick + "--steps 5 --input gpu" + m), {"--input", "gpu"});
  expect_error(run_towers(kQuick + "--steps 5 --input device" + m), {"--input device", "--device cuda"});
  const std::string gpu = kQuick + "--device cuda --params mirrored --steps 5 ";
  expect_error(run_towers(gpu + "--towers 2 --mode async --staleness-aware-lr" + m),
               {"--params mirrored", "--staleness-aware-lr"});
  expect_error(run_towers(gpu + "--towers 2 --sync-every 4" + m), {"--sync-every", "sync mode"});
  expect_error(run_towers(gpu + "--mode async --sync-every -1" + m), {"--sync-every", "-1"});
  expect_error(run_towers(kQuick + "--steps 5 --mode async --sync-every 4" + m),
               {"--sync-every", "--params host"});
  expect_error(run_towers(gpu + "--towers 3 --replicas-to-aggregate 2" + m), {"--params mirrored", "--replicas-to-aggregate"});
  expect_error(run_towers(gpu + "--mode async --ema 0.99" + m), {"--params mirrored", "--ema", "async"});
  const std::string plain = "train --model mlp --dataset synthetic --synthetic-size 200 --quiet ";
  expect_error(run_towers(plain + "--steps 5 --lr -0.1" + m), {"--lr", "-0.1"});
  // (a value past a float's range is quoted as typed, not as the inf it would become)
  expect_error(run_towers(plain + "--steps 5 --lr 1e40" + m),
               {"--lr", "1e40", "beyond a float's range"});
  expect_error(run_towers(plain + "--steps 5 --momentum -4e38" + m),
               {"--momentum", "-4e38", "beyond a float's range"});
  expect_error(run_towers(plain + "--steps 5 --lr 1e400" + m),
               {"--lr", "1e400", "beyond a float's range"});
  {  // FLT_MAX as printed is in range: the run starts, and its first update diverges
    const auto r = run_towers(plain + "--steps 5 --lr 3.4028235e38");
    EXPECT_EQ(r.output.find("beyond a float's range"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("training diverged"), std::string::npos) << r.output;
  }
  expect_error(run_towers(plain + "--steps 5 --seed -1" + m),
               {"--seed", "whole number >= 0", "-1"});
  expect_error(run_towers(kQuick + "--steps 5 --batch 0" + m), {"--batch"});
  expect_error(run_towers(plain + "--steps 5 --optimizer adamw9" + m), {"--optimizer", "adamw9"});
  expect_error(run_towers("train --model resnet9000 --steps 5" + m), {"unknown model", "resnet9000", "cifar10"});
  expect_error(run_towers("train --model mlp --dataset imagenet --steps 5" + m), {"--dataset", "imagenet"});
  expect_error(run_towers(kQuick + m), {"--epochs", "--steps"});
  expect_error(run_towers(kQuick + "--steps ten" + m), {"--steps"});
  expect_error(run_towers(kQuick + "--steps 5 --lr-schedule zigzag" + m), {"--lr-schedule", "zigzag"});
  expect_error(run_towers(kQuick + "--steps 5 --resume" + m), {"--resume", "--checkpoint-dir"});
  expect_error(run_towers("train --model cifar10 --dataset fashion-mnist --steps 5" + m), {"--model cifar10", "channel"});
  auto syntax = run_towers("train --bogus-flag 3");
  expect_error(syntax, {"--bogus-flag"});
  EXPECT_EQ(syntax.exit_code, 2) << "flag syntax errors exit with 2";
  EXPECT_EQ(run_towers(kQuick + "--steps ten").exit_code, 2);
  expect_error(run_towers(kQuick + "--steps 5 --momentum 1.5" + m), {"--momentum"});
  expect_error(run_towers(kQuick + "--steps 5 --label-smoothing 1" + m), {"--label-smoothing"});
  expect_error(run_towers(kQuick + "--steps 5 --ema 1.5" + m), {"--ema"});
  expect_error(run_towers(kQuick + "--steps 5 --lookahead -2" + m), {"--lookahead"});
  expect_error(run_towers(kQuick + "--steps 5 --lookahead 5 --lookahead-alpha 0" + m),
               {"--lookahead-alpha"});
  // A checkpoint "directory" that is a file is found before training, not after.
  write_bytes_plain(dir + "/afile", "x");
  auto ck = run_towers(kQuick + "--steps 5 --checkpoint-dir " + dir + "/afile" + m);
  expect_error(ck, {"--checkpoint-dir", dir + "/afile"});
  EXPECT_FALSE(fs::exists(dir + "/m.jsonl")) << "a failed run left its metrics file";
}

void write_bytes(const std::string& path, const std::vector<uint8_t>& b) {
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(b.data()), b.size());
}

std::vector<uint8_t> idx_header(uint32_t magic, std::vector<uint32_t> dims) {
  std::vector<uint8_t> b;
  auto be = [&](uint32_t v) {
    for (int s = 24; s >= 0; s -= 8) b.push_back(static_cast<uint8_t>(v >> s));
  };
  be(magic);
  for (uint32_t d : dims) be(d);
  return b;
}

// A complete Fashion-MNIST-shaped folder of 4 tiny IDX files; `breaker` damages one of them.
std::string fake_fashion(const std::string& dir, const std::function<void(const std::string&)>& breaker) {
  for (auto [prefix, n] : {std::pair{"train", 8u}, std::pair{"t10k", 4u}}) {
    auto img = idx_header(0x803, {n, 28, 28});
    img.resize(img.size() + n * 784, 7);
    write_bytes(dir + "/" + prefix + "-images-idx3-ubyte", img);
    auto lab = idx_header(0x801, {n});
    lab.resize(lab.size() + n, 3);
    write_bytes(dir + "/" + prefix + "-labels-idx1-ubyte", lab);
  }
  breaker(dir);
  return dir;
}

TEST(CliBadInput, DataFiles) {
  const std::string root = temp_dir();
  const std::string m = " --metrics " + root + "/m.jsonl";
  auto train_on = [&](const std::string& dir) {
    return run_towers("train --model fashion --dataset fashion-mnist --steps 1 --quiet --data " + dir + m);
  };
  expect_error(train_on(root + "/nowhere"), {root + "/nowhere"});

  fs::create_directories(root + "/ok");
  ASSERT_EQ(train_on(fake_fashion(root + "/ok", [](const std::string&) {})).exit_code, 0)
      << "the undamaged fake dataset must train";
  fs::remove(root + "/m.jsonl");

  fs::create_directories(root + "/missing");
  expect_error(train_on(fake_fashion(root + "/missing", [](const std::string& d) {
                 fs::remove(d + "/t10k-labels-idx1-ubyte");
               })),
               {"t10k-labels-idx1-ubyte"});
  fs::create_directories(root + "/trunc");
  expect_error(train_on(fake_fashion(root + "/trunc", [](const std::string& d) {
                 fs::resize_file(d + "/train-images-idx3-ubyte", 16 + 784 * 3);
               })),
               {"train-images-idx3-ubyte", "truncated"});
  fs::create_directories(root + "/magic");
  expect_error(train_on(fake_fashion(root + "/magic", [](const std::string& d) {
                 auto b = idx_header(0x804, {8, 28, 28});
                 b.resize(b.size() + 8 * 784);
                 write_bytes(d + "/train-images-idx3-ubyte", b);
               })),
               {"train-images-idx3-ubyte", "magic"});

  fs::create_directories(root + "/cifar");
  for (int i = 1; i <= 5; ++i) write_bytes(root + "/cifar/data_batch_" + std::to_string(i) + ".bin", std::vector<uint8_t>(3073 * 2, 1));
  write_bytes(root + "/cifar/test_batch.bin", std::vector<uint8_t>(3073 * 2 + 100, 1));
  expect_error(run_towers("train --model cifar10 --dataset cifar10 --steps 1 --data " + root + "/cifar" + m),
               {"test_batch.bin", "3073"});
  EXPECT_FALSE(fs::exists(root + "/m.jsonl")) << "a failed run left its metrics file";
}

TEST(CliBadInput, Checkpoints) {
  const std::string dir = temp_dir();
  ASSERT_EQ(run_towers(kQuick + "--steps 3 --checkpoint-dir " + dir).exit_code, 0);
  const std::string ck = dir + "/ckpt-000000003.safetensors";
  expect_error(run_towers("eval --checkpoint " + dir + "/nope.safetensors"), {"nope.safetensors"});

  // One flipped byte in the data section: the checksum catches it.
  const std::string bad = dir + "/corrupt.safetensors";
  fs::copy_file(ck, bad);
  {
    std::fstream f(bad, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-10, std::ios::end);
    char c;
    f.read(&c, 1);
    c ^= 0x5a;
    f.seekp(-10, std::ios::end);
    f.write(&c, 1);
  }
  expect_error(run_towers("eval --checkpoint " + bad), {"corrupt.safetensors", "checksum"});

  const std::string junk = dir + "/junk.safetensors";
  write_bytes(junk, {1, 2, 3});
  expect_error(run_towers("eval --checkpoint " + junk), {"junk.safetensors"});

  // A valid safetensors file that is not a towers checkpoint.
  const std::string foreign = dir + "/foreign.safetensors";
  std::string header = R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  while (header.size() % 8) header += ' ';
  std::vector<uint8_t> f(8, 0);
  f[0] = static_cast<uint8_t>(header.size());
  f.insert(f.end(), header.begin(), header.end());
  f.insert(f.end(), {0, 0, 128, 63});
  write_bytes(foreign, f);
  expect_error(run_towers("eval --checkpoint " + foreign), {"foreign.safetensors", "not a towers checkpoint"});

  // Resuming a different model from this directory.
  expect_error(run_towers("train --model fashion --dataset synthetic --steps 5 --resume --quiet --checkpoint-dir " + dir),
               {"mlp", "fashion"});
}

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// A safetensors file's JSON header (metadata included) and its data section.
std::pair<nlohmann::json, std::string> split_safetensors(const std::string& bytes) {
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = n << 8 | static_cast<uint8_t>(bytes.at(i));
  return {nlohmann::json::parse(bytes.substr(8, n)), bytes.substr(8 + n)};
}

// `--model FILE` trains bit for bit like the built-in name whose file it is: the checkpoints
// have the same bytes of parameters and momentum, and the same metadata but for the model,
// which records what --model said.
TEST(CliModelFile, TrainsBitwiseLikeTheBuiltInName) {
  const std::string dir = temp_dir();
  const std::string file = dir + "/cifar10.json";
  for (const BuiltinModel& m : builtin_models())
    if (m.name == "cifar10") std::ofstream(file) << m.text;
  const std::string run =
      "train --dataset synthetic --synthetic-size 64 --batch 16 --steps 3 --optimizer momentum "
      "--lr 0.05 --quiet --checkpoint-dir ";
  auto a = run_towers(run + dir + "/a --model cifar10");
  ASSERT_EQ(a.exit_code, 0) << a.output;
  auto b = run_towers(run + dir + "/b --model " + file);
  ASSERT_EQ(b.exit_code, 0) << b.output;
  auto [head_a, data_a] = split_safetensors(file_bytes(dir + "/a/ckpt-000000003.safetensors"));
  auto [head_b, data_b] = split_safetensors(file_bytes(dir + "/b/ckpt-000000003.safetensors"));
  ASSERT_EQ(data_a.size(), sizeof(float) * 2 * 1068298) << "parameters and momentum";
  EXPECT_TRUE(data_a == data_b) << "the parameters or the optimizer's slots differ";
  EXPECT_EQ(head_b["__metadata__"]["model"], file);
  for (nlohmann::json* h : {&head_a, &head_b}) {
    nlohmann::json& meta = (*h)["__metadata__"];
    nlohmann::json config = nlohmann::json::parse(meta["config"].get<std::string>());
    config["model"] = meta["model"] = "(--model)";
    meta["config"] = config.dump();
  }
  EXPECT_EQ(head_a, head_b);
  // The checkpoint names the file, and eval builds the model from it.
  auto e = run_towers("eval --checkpoint " + dir + "/b/ckpt-000000003.safetensors");
  EXPECT_EQ(e.exit_code, 0) << e.output;
}

// The step losses of a run's metrics file and the means of its first and last ten, printed
// under `label`.
struct LossTrend {
  std::vector<double> loss;
  double first = 0, last = 0;
};
LossTrend loss_trend(const std::string& metrics, const std::string& label) {
  LossTrend t;
  for (const auto& l : read_jsonl(metrics))
    if (l["event"] == "step") t.loss.push_back(l["loss"].get<double>());
  if (t.loss.size() < 10) return t;
  for (int i = 0; i < 10; ++i) t.first += t.loss[i] / 10, t.last += t.loss[t.loss.size() - 10 + i] / 10;
  std::printf("  %smean loss: first ten steps %.4f, last ten %.4f\n", label.c_str(), t.first, t.last);
  return t;
}

// A net of the newer layers, conv2d -> gelu -> global_avg_pool -> dense, read from a file,
// trains through the CLI: the mean loss of its last ten steps is well below that of its first
// ten, and every loss is finite.
TEST(CliModelFile, GeluGlobalAvgPoolNetLearns) {
  const std::string dir = temp_dir();
  const std::string file = dir + "/gap.json";
  write_bytes_plain(file, R"({"name": "gap", "input": [1, 12, 12], "classes": 10, "layers": [
  {"name": "conv", "type": "conv2d", "filters": 32, "kernel": 3, "relu": false,
   "weight_init": {"stddev": 0.2}},
  {"name": "act", "type": "gelu"},
  {"name": "gap", "type": "global_avg_pool"},
  {"name": "out", "type": "dense", "units": 10, "relu": false, "weight_init": {"stddev": 0.1}}]})");
  auto r = run_towers("train --model " + file +
                      " --dataset synthetic --synthetic-size 640 --batch 32 --optimizer adam "
                      "--lr 0.03 --steps 60 --quiet --seed 3 --metrics " +
                      dir + "/m.jsonl");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const LossTrend t = loss_trend(dir + "/m.jsonl", "");
  ASSERT_EQ(t.loss.size(), 60u);
  for (double v : t.loss) ASSERT_TRUE(std::isfinite(v));
  EXPECT_LT(t.last, 0.8 * t.first);
}

// conv2d -> batchnorm -> relu -> global_avg_pool -> dense from a file: it learns, its running
// statistics move off their initial values and are checkpointed, and eval (which normalizes
// with them) reads the checkpoint. Sync over 2 towers runs the same net.
TEST(CliModelFile, BatchNormNetLearnsAndCheckpointsItsRunningStatistics) {
  const std::string dir = temp_dir();
  const std::string file = dir + "/bn.json";
  write_bytes_plain(file, R"({"name": "bn", "input": [1, 12, 12], "classes": 10, "layers": [
  {"name": "conv", "type": "conv2d", "filters": 16, "kernel": 3, "relu": false,
   "weight_init": {"stddev": 0.2}},
  {"name": "bn", "type": "batchnorm"},
  {"name": "act", "type": "relu"},
  {"name": "gap", "type": "global_avg_pool"},
  {"name": "out", "type": "dense", "units": 10, "relu": false, "weight_init": {"stddev": 0.1}}]})");
  for (const std::string towers : {"1", "2"}) {
    SCOPED_TRACE("towers " + towers);
    const std::string run = dir + "/t" + towers;
    auto r = run_towers("train --model " + file + " --towers " + towers +
                        " --dataset synthetic --synthetic-size 640 --batch 32 --optimizer adam "
                        "--lr 0.03 --steps 150 --quiet --seed 3 --checkpoint-dir " + run +
                        " --metrics " + run + "/m.jsonl");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const LossTrend t = loss_trend(run + "/m.jsonl", towers + " tower(s): ");
    ASSERT_EQ(t.loss.size(), 150u);
    EXPECT_LT(t.last, 0.8 * t.first);
    const std::string ckpt = run + "/ckpt-000000150.safetensors";
    const auto g = build_graph(read_model_file(file));
    const auto c = io::load_checkpoint(ckpt, g->layout(), {"m", "v"});
    const Variable& mean = g->layout().find("bn/moving_mean");
    const Variable& var = g->layout().find("bn/moving_variance");
    int moved = 0;
    for (int64_t i = 0; i < 16; ++i) {
      moved += c.params.data()[mean.offset + i] != 0.0f;
      const float v = c.params.data()[var.offset + i];
      moved += v != 1.0f && v > 0.0f && std::isfinite(v);
    }
    EXPECT_EQ(moved, 32);
    auto e = run_towers("eval --checkpoint " + ckpt);
    EXPECT_EQ(e.exit_code, 0) << e.output;
  }
}

// A small residual net from a file (conv, then a block of conv -> batchnorm -> relu -> conv
// with the identity shortcut, relu, global average pooling, dense) learns through the CLI.
TEST(CliModelFile, ResidualNetLearns) {
  const std::string dir = temp_dir();
  const std::string file = dir + "/res.json";
  write_bytes_plain(file, R"({"name": "res", "input": [1, 12, 12], "classes": 10, "layers": [
  {"name": "stem", "type": "conv2d", "filters": 8, "kernel": 3, "weight_init": {"stddev": 0.3}},
  {"name": "block", "type": "residual", "layers": [
    {"name": "c1", "type": "conv2d", "filters": 8, "kernel": 3, "relu": false,
     "weight_init": {"stddev": 0.1}},
    {"name": "bn1", "type": "batchnorm"},
    {"name": "r1", "type": "relu"},
    {"name": "c2", "type": "conv2d", "filters": 8, "kernel": 3, "relu": false,
     "weight_init": {"stddev": 0.1}}]},
  {"name": "act", "type": "relu"},
  {"name": "gap", "type": "global_avg_pool"},
  {"name": "out", "type": "dense", "units": 10, "relu": false, "weight_init": {"stddev": 0.1}}]})");
  auto r = run_towers("train --model " + file +
                      " --dataset synthetic --synthetic-size 640 --batch 32 --optimizer adam "
                      "--lr 0.03 --steps 150 --quiet --seed 3 --metrics " + dir + "/m.jsonl");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const LossTrend t = loss_trend(dir + "/m.jsonl", "");
  ASSERT_EQ(t.loss.size(), 150u);
  EXPECT_LT(t.last, 0.8 * t.first);
  // A block whose inner layers change the shape is named with its inner layer's place.
  const std::string bad = dir + "/bad.json";
  write_bytes_plain(bad, R"({"name": "bad", "input": [1, 12, 12], "classes": 10, "layers": [
  {"name": "block", "type": "residual", "layers": [
    {"name": "c1", "type": "conv2d", "filters": 4, "kernel": 3, "weight_init": {"stddev": 0.1}}]},
  {"name": "out", "type": "dense", "units": 10, "relu": false, "weight_init": {"stddev": 0.1}}]})");
  expect_error(run_towers("train --dataset synthetic --steps 2 --model " + bad),
               {bad + ":2:", "layers[0] 'block' (residual)", "field 'layers'", "[4, 12, 12]",
                "[1, 12, 12]"});
  write_bytes_plain(bad, R"({"name": "bad", "input": [1, 12, 12], "classes": 10, "layers": [
  {"name": "block", "type": "residual", "layers": [
    {"name": "c1", "type": "conv2d", "filter": 1, "kernel": 3, "weight_init": {"stddev": 0.1}}]},
  {"name": "out", "type": "dense", "units": 10, "relu": false, "weight_init": {"stddev": 0.1}}]})");
  expect_error(run_towers("train --dataset synthetic --steps 2 --model " + bad),
               {bad + ":3:", "layers[0].layers[0] 'c1' (conv2d)", "unknown field 'filter'"});
}

// dense -> dropout -> dense from a file. Dropout's masks are a function of the seed, the batch
// and each example's place in it, so: 2 sync towers of 64 end bitwise where 1 tower of 128
// does (the dense layers sum their weight gradients in chunks of 64 examples, so towers of 64
// and more sum in one tree); a run stopped and resumed ends bitwise where the uninterrupted one does; the masks
// matter (rate 0 trains to other weights); and the net learns.
TEST(CliModelFile, DropoutIsExactAcrossTowersAndResume) {
  const std::string dir = temp_dir();
  auto write_net = [&](const std::string& file, const std::string& rate) {
    write_bytes_plain(file, R"({"name": "drop", "input": [1, 12, 12], "classes": 10, "layers": [
  {"name": "hidden", "type": "dense", "units": 64, "weight_init": {"stddev": 0.1}},
  {"name": "drop", "type": "dropout", "rate": )" + rate + R"(},
  {"name": "out", "type": "dense", "units": 10, "relu": false, "weight_init": {"stddev": 0.1}}]})");
  };
  const std::string net = dir + "/drop.json", plain = dir + "/plain.json";
  write_net(net, "0.5");
  write_net(plain, "0.0");
  const std::string base = " --dataset synthetic --synthetic-size 640 --optimizer momentum "
                           "--lr 0.05 --steps 60 --quiet --seed 3 ";
  auto run = [&](const std::string& name, const std::string& model, const std::string& flags) {
    const std::string out = dir + "/" + name;
    auto r = run_towers("train --model " + model + base + flags + " --checkpoint-dir " + out +
                        " --metrics " + out + "/m.jsonl");
    EXPECT_EQ(r.exit_code, 0) << name << ": " << r.output;
    return out;
  };
  const std::string one = run("one", net, "--towers 1 --batch 128");
  const std::string two = run("two", net, "--towers 2 --batch 64 --mode sync");
  const std::string zero = run("zero", plain, "--towers 1 --batch 128");
  run("resumed", net, "--towers 1 --batch 128 --stop-at-step 25");
  const std::string resumed = run("resumed", net, "--towers 1 --batch 128 --resume");
  const auto g = build_graph(read_model_file(net));
  auto params = [&](const std::string& out) {
    const auto c = io::load_checkpoint(out + "/ckpt-000000060.safetensors", g->layout(), {"momentum"});
    return std::vector<float>(c.params.data(), c.params.data() + g->layout().total());
  };
  const std::vector<float> p1 = params(one);
  EXPECT_EQ(params(two), p1) << "2 sync towers of 64 differ from 1 tower of 128";
  EXPECT_EQ(params(resumed), p1) << "the resumed run differs from the uninterrupted one";
  EXPECT_NE(params(zero), p1) << "dropout 0.5 trained the weights of dropout 0";
  const LossTrend t = loss_trend(one + "/m.jsonl", "dropout 0.5: ");
  ASSERT_EQ(t.loss.size(), 60u);
  EXPECT_LT(t.last, 0.8 * t.first);
}

// --sync-bn: 2 sync towers of 64 normalize over the global batch of 128, as 1 tower of 128
// does, so after 20 updates their parameters are those of one tower up to the order of the
// statistics' additions (per-tower lanes added in tower order against one tower's lanes, in
// double: float-close). Without it each tower normalizes over its own 64 and the parameters
// move away by orders of magnitude more. The flag is refused where there is no global batch.
// (GPU towers: tests/gpu/sync_bn_gpu_test.cpp.)
TEST(CliModelFile, SyncBnNormalizesOverTheGlobalBatch) {
  const std::string dir = temp_dir();
  const std::string file = dir + "/bn.json";
  write_bytes_plain(file, testutil::kBatchNormNet);
  const std::string base = "train --model " + file +
                           " --dataset synthetic --synthetic-size 1280 --optimizer momentum "
                           "--lr 0.05 --steps 20 --quiet --seed 3 ";
  auto run = [&](const std::string& name, const std::string& flags) {
    const std::string out = dir + "/" + name;
    auto r = run_towers(base + flags + " --checkpoint-dir " + out);
    EXPECT_EQ(r.exit_code, 0) << name << ": " << r.output;
    const auto g = build_graph(read_model_file(file));
    const auto c = io::load_checkpoint(out + "/ckpt-000000020.safetensors", g->layout(), {"momentum"});
    return std::vector<float>(c.params.data(), c.params.data() + g->layout().total());
  };
  const std::vector<float> one = run("one", "--towers 1 --batch 128");
  const std::vector<float> synced = run("synced", "--towers 2 --batch 64 --sync-bn");
  const std::vector<float> own = run("own", "--towers 2 --batch 64");
  double scale = 0, d_synced = 0, d_own = 0;
  for (size_t i = 0; i < one.size(); ++i) {
    scale = std::max(scale, std::fabs(static_cast<double>(one[i])));
    d_synced = std::max(d_synced, std::fabs(static_cast<double>(synced[i]) - one[i]));
    d_own = std::max(d_own, std::fabs(static_cast<double>(own[i]) - one[i]));
  }
  std::printf("  largest parameter difference from 1 tower of 128 (largest |p| %.3g): --sync-bn "
              "%.3g, per-tower statistics %.3g\n", scale, d_synced, d_own);
  EXPECT_LT(d_synced, 1e-4 * scale);
  EXPECT_GT(d_own, 1e-3 * scale);
  expect_error(run_towers(base + "--towers 2 --batch 64 --sync-bn --mode async"),
               {"--sync-bn", "--mode sync", "not --mode async"});
  expect_error(run_towers(base + "--towers 2 --batch 64 --sync-bn --replicas-to-aggregate 1"),
               {"--sync-bn", "--replicas-to-aggregate"});
}

TEST(CliBadInput, ModelFile) {
  const std::string dir = temp_dir();
  const std::string m = " --metrics " + dir + "/m.jsonl";
  const std::string file = dir + "/net.json";
  write_bytes_plain(file, R"({"name": "net", "input": [1, 28, 28], "classes": 10, "layers": [
  {"name": "hidden", "type": "dense", "units": 64, "weight_init": {"stddev": 0.1}},
  {"name": "out", "type": "dense", "unit": 10, "weight_init": {"stddev": 0.1}}]})");
  auto r = run_towers("train --dataset synthetic --steps 2 --model " + file + m);
  expect_error(r, {file + ":3:36: ", "layers[1] 'out' (dense)", "unknown field 'unit'",
                   "did you mean 'units'?"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << "one line: " << r.output;
  expect_error(run_towers("train --dataset synthetic --steps 2 --model " + dir + "/none.json" + m),
               {"model file '" + dir + "/none.json'", "no such file"});
  // A valid file with fewer outputs than the data has labels.
  const std::string three = dir + "/three.json";
  write_bytes_plain(three, R"({"name": "three", "input": [1, 28, 28], "classes": 3, "layers": [
  {"name": "out", "type": "dense", "units": 3, "relu": false, "weight_init": {"stddev": 0.1}}]})");
  expect_error(run_towers("train --dataset synthetic --steps 2 --model " + three + m),
               {"--model " + three + " has 3 classes", "--dataset synthetic has 10"});
  EXPECT_FALSE(fs::exists(dir + "/m.jsonl")) << "a failed run left its metrics file";
}

}  // namespace
}  // namespace towers
