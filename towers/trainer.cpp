#include "towers/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <memory>
#include <vector>

#include <unistd.h>

#include <fmt/format.h>

#include "core/check.h"
#include "core/device.h"
#include "data/load.h"
#include "data/pipeline.h"
#include "io/checkpoint.h"
#include "metrics/metrics.h"
#include "models/models.h"
#include "towers/tower.h"

namespace towers {

std::atomic<bool> g_stop_requested{false};

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

struct EvalResult {
  double accuracy = 0.0, loss = 0.0;
  int64_t examples = 0;
};

EvalResult evaluate(Tower& tower, const data::Dataset& test, const data::AugmentConfig& cfg) {
  const int64_t b = tower.max_batch();
  const int64_t per = numel(tower.graph().input_shape());
  std::vector<float> images(b * per);
  std::vector<int32_t> labels(b);
  double loss = 0.0;
  int64_t correct = 0;
  for (int64_t i = 0; i < test.size(); i += b) {
    const int64_t e = std::min(i + b, test.size());
    tower.device().execute([&] {
      data::make_eval_batch(test, cfg, i, e, images.data(), labels.data());
    });
    StepStats s = tower.evaluate(images.data(), labels.data(), e - i);
    loss += s.loss_sum;
    correct += s.correct;
  }
  return {static_cast<double>(correct) / test.size(), loss / test.size(), test.size()};
}

data::DatasetRequest dataset_request(const std::string& name, const std::string& dir,
                                     const Shape& input, int64_t synthetic_size, uint64_t seed) {
  data::DatasetRequest r;
  r.name = name;
  r.dir = dir;
  r.synthetic_shape = input;
  r.synthetic_train = synthetic_size;
  r.synthetic_test = std::max<int64_t>(synthetic_size / 5, 1);
  r.seed = seed;
  return r;
}

}  // namespace

void validate(const TrainConfig& c) {
  TOWERS_REQUIRE(c.towers >= 1, "--towers must be at least 1, got {}", c.towers);
  TOWERS_REQUIRE(c.towers == 1,
                 "--towers {}: this build trains one tower per run; multi-tower modes are not "
                 "available yet",
                 c.towers);
  TOWERS_REQUIRE(c.batch >= 1, "--batch must be at least 1, got {}", c.batch);
  TOWERS_REQUIRE(c.batch <= 65536, "--batch {} is too large (at most 65536 per tower)", c.batch);
  TOWERS_REQUIRE(c.epochs >= 0.0 && std::isfinite(c.epochs), "--epochs must be >= 0, got {}", c.epochs);
  TOWERS_REQUIRE(c.steps >= 0, "--steps must be >= 0, got {}", c.steps);
  TOWERS_REQUIRE(c.stop_at_step >= 0, "--stop-at-step must be >= 0, got {}", c.stop_at_step);
  TOWERS_REQUIRE(c.epochs > 0.0 || c.steps > 0, "give the run a length: --epochs or --steps");
  TOWERS_REQUIRE(!(c.epochs > 0.0 && c.steps > 0), "give only one of --epochs and --steps");
  TOWERS_REQUIRE(c.threads >= 0, "--threads must be >= 0 (0 = all cores), got {}", c.threads);
  TOWERS_REQUIRE(c.keep_checkpoints >= 1, "--keep-checkpoints must be at least 1, got {}",
                 c.keep_checkpoints);
  TOWERS_REQUIRE(c.checkpoint_every_epochs >= 0.0, "--checkpoint-every must be >= 0, got {}",
                 c.checkpoint_every_epochs);
  TOWERS_REQUIRE(c.eval_every_epochs >= 0.0, "--eval-every must be >= 0, got {}", c.eval_every_epochs);
  TOWERS_REQUIRE(c.log_every >= 1, "--log-every must be at least 1, got {}", c.log_every);
  TOWERS_REQUIRE(!c.resume || !c.checkpoint_dir.empty(), "--resume needs --checkpoint-dir DIR");
  TOWERS_REQUIRE(c.synthetic_size >= 1, "--synthetic-size must be at least 1, got {}", c.synthetic_size);
  const auto& o = c.optimizer;
  TOWERS_REQUIRE(!o.momentum || (*o.momentum >= 0.0f && *o.momentum < 1.0f),
                 "--momentum must be in [0, 1), got {}", o.momentum.value_or(0.0f));
  validate(c.schedule);
  build_model(c.model);  // throws for an unknown model
  const ParameterLayout empty;
  Optimizer probe(empty, o);  // throws for an unknown optimizer
}

nlohmann::json to_json(const TrainConfig& c) {
  return {{"model", c.model},
          {"dataset", c.dataset},
          {"data_dir", c.data_dir},
          {"augment", c.augment},
          {"synthetic_size", c.synthetic_size},
          {"epochs", c.epochs},
          {"steps", c.steps},
          {"batch", c.batch},
          {"towers", c.towers},
          {"threads", c.threads},
          {"seed", c.seed},
          {"optimizer", c.optimizer.name},
          {"momentum", c.optimizer.momentum ? nlohmann::json(*c.optimizer.momentum) : nlohmann::json()},
          {"nesterov", c.optimizer.nesterov},
          {"lr", c.schedule.lr},
          {"lr_schedule", c.schedule.kind},
          {"decay_epochs", c.schedule.decay_epochs},
          {"decay_factor", c.schedule.decay_factor},
          {"warmup_epochs", c.schedule.warmup_epochs}};
}

TrainSummary train(const TrainConfig& c_in) {
  TrainConfig c = c_in;
  validate(c);
  const auto t_start = Clock::now();
  const int threads = c.threads > 0 ? c.threads : hardware_threads();
  auto graph = build_model(c.model);
  const ParameterLayout& layout = graph->layout();

  // Everything that can be wrong with the input is found before anything is written.
  data::DataSplit data = data::load_dataset(
      dataset_request(c.dataset, c.data_dir, graph->input_shape(), c.synthetic_size, c.seed));
  data::Transforms tf =
      data::transforms_for(c.augment, c.dataset, graph->input_shape(), data.train, c.model);
  const int64_t n_train = data.train.size();

  if (c.schedule.kind == "cosine" && c.epochs > 0.0) c.schedule.total_epochs = c.epochs;
  const int64_t total_steps =
      c.steps > 0 ? c.steps
                  : static_cast<int64_t>(std::ceil(c.epochs * static_cast<double>(n_train) / c.batch));
  if (c.schedule.kind == "cosine" && c.steps > 0)
    c.schedule.total_epochs = static_cast<double>(total_steps) * c.batch / n_train;

  if (!c.checkpoint_dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(c.checkpoint_dir, ec);
    TOWERS_REQUIRE(std::filesystem::is_directory(c.checkpoint_dir),
                   "--checkpoint-dir: '{}' is not a directory and cannot be created{}",
                   c.checkpoint_dir, ec ? ": " + ec.message() : "");
    TOWERS_REQUIRE(access(c.checkpoint_dir.c_str(), W_OK) == 0,
                   "--checkpoint-dir: '{}' is not writable", c.checkpoint_dir);
    // A fresh run into a folder of another run's checkpoints would later mix the two on
    // --resume or in the rotation of old files.
    if (!c.resume) {
      auto existing = io::latest_checkpoint(c.checkpoint_dir);
      TOWERS_REQUIRE(!existing,
                     "--checkpoint-dir: '{}' already holds checkpoints ({}); add --resume to "
                     "continue that run, or give an empty directory",
                     c.checkpoint_dir, existing.value_or(""));
    }
  }

  std::vector<float> params(layout.total());
  Optimizer opt(layout, c.optimizer);
  int64_t start_step = 0;
  std::optional<std::string> resume_from;
  if (c.resume) resume_from = io::latest_checkpoint(c.checkpoint_dir);
  if (resume_from) {
    const io::CheckpointMeta head = io::read_checkpoint_meta(*resume_from);
    TOWERS_REQUIRE(head.model == c.model, "--resume: {} holds model '{}' but --model is '{}'",
                   *resume_from, head.model, c.model);
    io::Checkpoint ck = io::load_checkpoint(*resume_from, layout, opt.slot_names());
    const auto& old = ck.meta.config;
    TOWERS_REQUIRE(old.is_object(), "--resume: {} has no readable run configuration", *resume_from);
    // The example stream is a function of (seed, batch): resuming with others would not
    // continue the same run.
    TOWERS_REQUIRE(old.value("batch", c.batch) == c.batch,
                   "--resume: {} was trained with --batch {}, this run has --batch {}",
                   *resume_from, old.value("batch", c.batch), c.batch);
    TOWERS_REQUIRE(old.value("seed", c.seed) == c.seed,
                   "--resume: {} was trained with --seed {}, this run has --seed {}",
                   *resume_from, old.value("seed", c.seed), c.seed);
    TOWERS_REQUIRE(old.value("dataset", c.dataset) == c.dataset,
                   "--resume: {} was trained on --dataset {}, this run has --dataset {}",
                   *resume_from, old.value("dataset", c.dataset), c.dataset);
    TOWERS_REQUIRE(old.value("augment", c.augment) == c.augment,
                   "--resume: {} was trained with --augment {}, this run has --augment {}",
                   *resume_from, old.value("augment", c.augment), c.augment);
    TOWERS_REQUIRE(c.dataset != "synthetic" ||
                       old.value("synthetic_size", c.synthetic_size) == c.synthetic_size,
                   "--resume: {} was trained with --synthetic-size {}, this run has {}",
                   *resume_from, old.value("synthetic_size", c.synthetic_size), c.synthetic_size);
    std::copy(ck.params.data(), ck.params.data() + layout.total(), params.begin());
    for (auto& [name, buf] : ck.slots)
      std::copy(buf.data(), buf.data() + layout.total(), opt.slot(name));
    opt.load_state(ck.meta.optimizer_state);
    start_step = ck.meta.step;
  } else {
    layout.initialize(params.data(), c.seed);
  }

  std::unique_ptr<Tower> tower_ptr;
  try {
    tower_ptr = std::make_unique<Tower>(*graph, c.batch, threads);
  } catch (const std::bad_alloc&) {
    TOWERS_BAD_INPUT("--batch {}: not enough memory for the activations of model {}", c.batch,
                     c.model);
  }
  Tower& tower = *tower_ptr;
  data::BatchPipeline pipeline(data.train, tf.train, c.batch, c.seed, start_step, 2);

  // Only now, with every input checked and memory in hand, is anything written.
  MetricsWriter metrics(c.metrics_path, resume_from.has_value());
  Progress progress(stderr);
  auto say = [&](const std::string& s) {
    if (!c.quiet) progress.line(s);
  };
  nlohmann::json config_json = to_json(c);
  metrics.write({{"event", "config"}, {"config", config_json}, {"parameters", layout.count()},
                 {"train_examples", n_train}, {"test_examples", data.test.size()},
                 {"start_step", start_step}, {"total_steps", total_steps},
                 {"threads", threads}, {"device", tower.device().name()}});
  say(fmt::format("towers: model {} ({} parameters), {} on {} ({} train / {} test), {} steps of "
                  "batch {}, {}{}",
                  c.model, layout.count(), c.optimizer.name, c.dataset, n_train,
                  data.test.size(), total_steps, c.batch, tower.device().name(),
                  resume_from ? fmt::format(", resumed from {} at step {}", *resume_from, start_step) : ""));

  auto epoch_at = [&](int64_t step) { return static_cast<double>(step) * c.batch / n_train; };
  auto write_checkpoint = [&](int64_t step) {
    io::CheckpointMeta meta{c.model, step, step * c.batch, epoch_at(step), config_json, opt.state()};
    std::string path = io::save_checkpoint(c.checkpoint_dir, meta, layout, params.data(),
                                           opt.slots(), c.keep_checkpoints);
    metrics.write({{"event", "checkpoint"}, {"step", step}, {"path", path}});
    return path;
  };

  TrainSummary sum;
  sum.start_step = start_step;
  const auto t_train = Clock::now();
  double compute_seconds = 0.0, window_loss = 0.0, side_seconds = 0.0;  // side: eval, checkpoints
  int64_t window_steps = 0, window_correct = 0;
  auto t_window = Clock::now();
  int64_t step = start_step;
  const int64_t end_step = c.stop_at_step > 0 ? std::min(c.stop_at_step, total_steps) : total_steps;
  while (step < end_step) {
    if (g_stop_requested.load()) {
      sum.interrupted = true;
      break;
    }
    data::Batch batch = pipeline.next();
    const double epoch = epoch_at(step);
    const float lr = learning_rate(c.schedule, epoch);
    const auto t0 = Clock::now();
    tower.load_params(params.data());
    StepStats s = tower.compute_gradients(batch.images.data(), batch.labels.data(), c.batch,
                                          1.0f / static_cast<float>(c.batch));
    tower.device().execute([&] { opt.apply(params.data(), tower.grads(), lr); });
    compute_seconds += seconds_since(t0);
    ++step;
    const double loss = s.loss_sum / c.batch;
    TOWERS_REQUIRE(std::isfinite(loss),
                   "training diverged at step {} (loss {}): lower --lr (now {})", step, loss,
                   c.schedule.lr);
    window_loss += loss, window_correct += s.correct, ++window_steps;
    sum.final_loss = loss;

    if (step % c.log_every == 0 || step == end_step) {
      const double dt = seconds_since(t_window);
      const double ips = window_steps * c.batch / dt;
      metrics.write({{"event", "step"}, {"step", step}, {"epoch", epoch_at(step)},
                     {"loss", window_loss / window_steps},
                     {"train_accuracy", static_cast<double>(window_correct) / (window_steps * c.batch)},
                     {"lr", lr}, {"images_per_sec", ips}, {"tower", 0}, {"staleness", 0},
                     {"wall_seconds", seconds_since(t_start)}});
      window_loss = 0.0, window_correct = 0, window_steps = 0;
      t_window = Clock::now();
    }
    if (!c.quiet) {
      const double elapsed = seconds_since(t_train) - side_seconds;
      const double rate = (step - start_step) / std::max(elapsed, 1e-9);
      progress.update(step, total_steps, epoch_at(step), loss, rate * c.batch,
                      (total_steps - step) / std::max(rate, 1e-9), c.log_every);
    }
    // Epoch-based events fire when the stream crosses a multiple of their period.
    auto crossed = [&](double every) {
      return every > 0.0 && std::floor(epoch_at(step) / every) > std::floor(epoch_at(step - 1) / every);
    };
    const auto t_side = Clock::now();
    bool side_work = false;
    if (crossed(c.eval_every_epochs) && step != end_step) {
      side_work = true;
      EvalResult ev = evaluate(tower, data.test, tf.eval);
      metrics.write({{"event", "eval"}, {"step", step}, {"epoch", epoch_at(step)},
                     {"test_accuracy", ev.accuracy}, {"test_loss", ev.loss},
                     {"wall_seconds", seconds_since(t_start)}});
      say(fmt::format("epoch {:.2f}: test accuracy {:.2f}% (loss {:.4f})", epoch_at(step),
                      100.0 * ev.accuracy, ev.loss));
    }
    if (!c.checkpoint_dir.empty() && crossed(c.checkpoint_every_epochs) && step != end_step) {
      side_work = true;
      sum.last_checkpoint = write_checkpoint(step);
    }
    if (side_work) {
      // images/s measures training: the window restarts after evaluations and checkpoints.
      side_seconds += seconds_since(t_side);
      t_window = Clock::now();
    }
  }
  const double train_seconds = seconds_since(t_train) - side_seconds;
  if (!c.checkpoint_dir.empty() && step > start_step) sum.last_checkpoint = write_checkpoint(step);
  if (sum.interrupted) say(fmt::format("interrupted at step {}{}", step,
                                       sum.last_checkpoint.empty() ? "" : "; saved " + sum.last_checkpoint));

  // An interrupted run stops promptly: its checkpoint is written, the test pass is skipped.
  EvalResult ev;
  if (!sum.interrupted) ev = evaluate(tower, data.test, tf.eval);
  sum.steps = step;
  sum.epochs = epoch_at(step);
  sum.test_accuracy = ev.accuracy;
  sum.test_loss = ev.loss;
  const int64_t trained = (step - start_step) * c.batch;
  sum.train_images_per_sec = trained / std::max(train_seconds, 1e-9);
  sum.wall_seconds = seconds_since(t_start);
  metrics.write({{"event", "summary"},
                 {"model", c.model},
                 {"dataset", c.dataset},
                 {"test_accuracy", sum.interrupted ? nlohmann::json() : nlohmann::json(sum.test_accuracy)},
                 {"test_loss", sum.interrupted ? nlohmann::json() : nlohmann::json(sum.test_loss)},
                 {"train_images_per_sec", sum.train_images_per_sec},
                 {"compute_images_per_sec", trained / std::max(compute_seconds, 1e-9)},
                 {"wall_seconds", sum.wall_seconds},
                 {"train_seconds", train_seconds},
                 {"steps", sum.steps},
                 {"start_step", start_step},
                 {"epochs", sum.epochs},
                 {"final_loss", sum.final_loss},
                 {"interrupted", sum.interrupted},
                 {"checkpoint", sum.last_checkpoint}});
  if (!sum.interrupted)
    say(fmt::format("done: {} steps ({:.2f} epochs) in {}, {:.0f} images/s; test accuracy {:.2f}% "
                  "on {} examples",
                  sum.steps, sum.epochs, format_duration(sum.wall_seconds),
                  sum.train_images_per_sec, 100.0 * sum.test_accuracy, ev.examples));
  return sum;
}

EvalSummary evaluate_checkpoint(const std::string& path, const std::string& dataset,
                                const std::string& data_dir, int threads) {
  TOWERS_REQUIRE(std::filesystem::exists(path), "--checkpoint: no such file '{}'", path);
  io::CheckpointMeta meta = io::read_checkpoint_meta(path);
  auto graph = build_model(meta.model);
  io::Checkpoint ck = io::load_checkpoint(path, graph->layout(), {});
  const auto& cfg = ck.meta.config;
  const std::string ds = !dataset.empty() ? dataset : cfg.value("dataset", std::string("fashion-mnist"));
  const std::string dir = !data_dir.empty() || !dataset.empty() ? data_dir : cfg.value("data_dir", std::string());
  data::DataSplit data = data::load_dataset(dataset_request(
      ds, dir, graph->input_shape(), cfg.value("synthetic_size", int64_t{10000}),
      cfg.value("seed", uint64_t{1})));
  data::Transforms tf = data::transforms_for("none", ds, graph->input_shape(), data.test, meta.model);
  Tower tower(*graph, 256, threads > 0 ? threads : hardware_threads());
  tower.load_params(ck.params.data());
  EvalResult ev = evaluate(tower, data.test, tf.eval);
  return {meta.model, meta.step, ev.examples, ev.accuracy, ev.loss};
}

}  // namespace towers
