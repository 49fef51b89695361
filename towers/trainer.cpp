#include "towers/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <memory>
#include <utility>
#include <cstdio>
#include <vector>

#include <unistd.h>

#include <fmt/format.h>

#include "core/check.h"
#include "core/device.h"
#include "core/gpu.h"
#include "core/parallel.h"
#include "data/load.h"
#include "data/pipeline.h"
#include "io/checkpoint.h"
#include "metrics/metrics.h"
#include "models/models.h"
#include "towers/tower.h"
#include "towers/tower_group.h"

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
    tower.host().execute([&] {
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

std::vector<std::pair<int, int>> parse_slow_towers(const std::vector<std::string>& specs,
                                                   int towers) {
  std::vector<std::pair<int, int>> out;
  for (const std::string& s : specs) {
    int t = -1, ms = -1;
    char tail = 0;
    const bool ok = std::sscanf(s.c_str(), "%d:%d%c", &t, &ms, &tail) == 2;
    TOWERS_REQUIRE(ok && t >= 0 && t < towers && ms >= 0,
                   "--slow-tower '{}': expected TOWER:MILLISECONDS with 0 <= TOWER < {}", s,
                   towers);
    out.emplace_back(t, ms);
  }
  return out;
}

}  // namespace

void validate(const TrainConfig& c) {
  TOWERS_REQUIRE(c.towers >= 1, "--towers must be at least 1, got {}", c.towers);
  TOWERS_REQUIRE(c.towers <= 256, "--towers {} is too many (at most 256)", c.towers);
  const std::optional<Mode> parsed_mode = mode_named(c.mode);
  TOWERS_REQUIRE(parsed_mode, "--mode: unknown mode '{}' (known: {})", c.mode, mode_names());
  const Mode mode = *parsed_mode;
  TOWERS_REQUIRE(c.threads_per_tower >= 0, "--threads-per-tower must be >= 0 (0 = cores / towers), got {}",
                 c.threads_per_tower);
  TOWERS_REQUIRE(c.replicas_to_aggregate >= 0 && c.replicas_to_aggregate <= c.towers,
                 "--replicas-to-aggregate must be between 1 and --towers ({}), got {}", c.towers,
                 c.replicas_to_aggregate);
  TOWERS_REQUIRE(c.replicas_to_aggregate == 0 || mode == Mode::Sync,
                 "--replicas-to-aggregate applies to --mode sync only");
  TOWERS_REQUIRE(mode != Mode::Ssp || c.staleness >= 0,
                 "--mode ssp needs --staleness S (S >= 0, the most steps a tower may run ahead)");
  TOWERS_REQUIRE(mode == Mode::Ssp || c.staleness < 0, "--staleness applies to --mode ssp only");
  TOWERS_REQUIRE(!c.use_locking || mode != Mode::Sync,
                 "--use-locking applies to --mode async and ssp (sync applies once per step)");
  TOWERS_REQUIRE(c.device == "cpu" || c.device == "cuda",
                 "--device: unknown device '{}' (known: cpu, cuda)", c.device);
  const std::optional<Reduce> parsed_reduce = reduce_named(c.reduce);
  TOWERS_REQUIRE(parsed_reduce, "--reduce: unknown reduction '{}' (known: host, nccl)", c.reduce);
  const Reduce reduce = *parsed_reduce;
  TOWERS_REQUIRE(c.gpus >= 0, "--gpus must be >= 0 (0 = all), got {}", c.gpus);
  TOWERS_REQUIRE(c.device == "cuda" ||
                     (c.gpus == 0 && !c.tf32 && c.cuda_graphs && reduce == Reduce::Host),
                 "--gpus, --tf32, --no-cuda-graphs and --reduce nccl need --device cuda");
  TOWERS_REQUIRE(reduce == Reduce::Host || (mode == Mode::Sync && c.replicas_to_aggregate == 0),
                 "--reduce nccl is for --mode sync without --replicas-to-aggregate");
  TOWERS_REQUIRE(c.lr_scaling == "none" || c.lr_scaling == "linear",
                 "--lr-scaling: unknown rule '{}' (known: none, linear)", c.lr_scaling);
  parse_slow_towers(c.slow_towers, c.towers);
  TOWERS_REQUIRE(c.batch >= 1, "--batch must be at least 1, got {}", c.batch);
  TOWERS_REQUIRE(c.batch <= 65536, "--batch {} is too large (at most 65536 per tower)", c.batch);
  TOWERS_REQUIRE(c.epochs >= 0.0 && std::isfinite(c.epochs), "--epochs must be >= 0, got {}", c.epochs);
  TOWERS_REQUIRE(c.steps >= 0, "--steps must be >= 0, got {}", c.steps);
  TOWERS_REQUIRE(c.stop_at_step >= 0, "--stop-at-step must be >= 0, got {}", c.stop_at_step);
  TOWERS_REQUIRE(c.epochs > 0.0 || c.steps > 0, "give the run a length: --epochs or --steps");
  TOWERS_REQUIRE(!(c.epochs > 0.0 && c.steps > 0), "give only one of --epochs and --steps");
  TOWERS_REQUIRE(c.keep_checkpoints >= 1, "--keep-checkpoints must be at least 1, got {}",
                 c.keep_checkpoints);
  TOWERS_REQUIRE(c.checkpoint_every_epochs >= 0.0, "--checkpoint-every must be >= 0, got {}",
                 c.checkpoint_every_epochs);
  TOWERS_REQUIRE(c.eval_every_epochs >= 0.0, "--eval-every must be >= 0, got {}", c.eval_every_epochs);
  TOWERS_REQUIRE(c.target_accuracy >= 0.0 && c.target_accuracy <= 1.0,
                 "--target-accuracy must be a fraction in [0, 1], got {}", c.target_accuracy);
  TOWERS_REQUIRE(c.target_accuracy == 0.0 || c.eval_every_epochs > 0.0,
                 "--target-accuracy needs periodic evaluation (--eval-every > 0)");
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
          {"threads_per_tower", c.threads_per_tower},
          {"device", c.device},
          {"gpus", c.gpus},
          {"reduce", c.reduce},
          {"tf32", c.tf32},
          {"cuda_graphs", c.cuda_graphs},
          {"mode", c.mode},
          {"replicas_to_aggregate", c.replicas_to_aggregate},
          {"staleness", c.staleness},
          {"use_locking", c.use_locking},
          {"staleness_aware_lr", c.staleness_aware_lr},
          {"lr_scaling", c.lr_scaling},
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
  const Mode mode = *mode_named(c.mode);
  const int cores = hardware_threads();
  const int threads = c.threads_per_tower > 0 ? c.threads_per_tower : std::max(1, cores / c.towers);
  auto graph = build_model(c.model);
  const ParameterLayout& layout = graph->layout();

  // Everything that can be wrong with the input is found before anything is written.
  data::DataSplit data = data::load_dataset(
      dataset_request(c.dataset, c.data_dir, graph->input_shape(), c.synthetic_size, c.seed));
  data::Transforms tf =
      data::transforms_for(c.augment, c.dataset, graph->input_shape(), data.train, c.model);
  const int64_t n_train = data.train.size();

  EngineConfig ec;
  ec.mode = mode;
  ec.towers = c.towers;
  ec.threads_per_tower = threads;
  ec.replicas_to_aggregate = c.replicas_to_aggregate;
  ec.staleness = std::max<int64_t>(c.staleness, 0);
  ec.use_locking = c.use_locking;
  ec.staleness_aware_lr = c.staleness_aware_lr;
  ec.stragglers = parse_slow_towers(c.slow_towers, c.towers);
  std::string placement = fmt::format("on cpu ({} threads each)", threads);
  if (c.device == "cuda") {
    // The GPUs are checked before anything is written, like every other input.
    GpuList found = list_gpus();
    TOWERS_REQUIRE(!found.gpus.empty(), "--device cuda: no GPU available: {}", found.why_none);
    const int have = static_cast<int>(found.gpus.size());
    TOWERS_REQUIRE(c.gpus <= have, "--gpus {}: this machine has {} GPU(s)", c.gpus, have);
    ec.device = DeviceKind::Cuda;
    ec.gpus = std::min(c.gpus > 0 ? c.gpus : have, c.towers);
    ec.reduce = *reduce_named(c.reduce);
    ec.tf32 = c.tf32;
    ec.cuda_graphs = c.cuda_graphs;
    TOWERS_REQUIRE(ec.reduce == Reduce::Host || c.towers <= ec.gpus,
                   "--reduce nccl: {} towers on {} GPU(s); NCCL needs one tower per GPU (use "
                   "--reduce host to share GPUs)", c.towers, ec.gpus);
    placement = fmt::format("on {} GPU(s) ({}){}{}", ec.gpus, found.gpus[0].name,
                            c.towers > ec.gpus
                                ? fmt::format(",{} {} towers share {} GPU",
                                              c.towers % ec.gpus == 0 ? "" : " up to",
                                              ceil_div(c.towers, ec.gpus),
                                              c.towers % ec.gpus == 0 ? "each" : "a")
                                : "",
                            c.tf32 ? ", TF32" : "");
  }
  const int aggregated = mode == Mode::Sync ? (c.replicas_to_aggregate > 0 ? c.replicas_to_aggregate : c.towers) : 1;
  // One step = one applied update; the schedule counts the examples behind the updates.
  const int64_t per_update = c.batch * aggregated;
  if (c.lr_scaling == "linear") c.schedule.lr *= static_cast<float>(aggregated);

  const int64_t total_steps =
      c.steps > 0 ? c.steps
                  : static_cast<int64_t>(std::ceil(c.epochs * static_cast<double>(n_train) / per_update));
  c.schedule.total_epochs = static_cast<double>(total_steps) * per_update / n_train;

  if (!c.checkpoint_dir.empty()) {
    std::error_code ec_dir;
    std::filesystem::create_directories(c.checkpoint_dir, ec_dir);
    TOWERS_REQUIRE(std::filesystem::is_directory(c.checkpoint_dir),
                   "--checkpoint-dir: '{}' is not a directory and cannot be created{}",
                   c.checkpoint_dir, ec_dir ? ": " + ec_dir.message() : "");
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
  int64_t start_step = 0, start_examples = 0;
  std::optional<std::string> resume_from;
  if (c.resume) resume_from = io::latest_checkpoint(c.checkpoint_dir);
  if (resume_from) {
    const io::CheckpointMeta head = io::read_checkpoint_meta(*resume_from);
    TOWERS_REQUIRE(head.model == c.model, "--resume: {} holds model '{}' but --model is '{}'",
                   *resume_from, head.model, c.model);
    io::Checkpoint ck = io::load_checkpoint(*resume_from, layout, opt.slot_names());
    const auto& old = ck.meta.config;
    TOWERS_REQUIRE(old.is_object(), "--resume: {} has no readable run configuration", *resume_from);
    // The example stream is a function of (seed, batch, towers, mode): resuming with others
    // would not continue the same run.
    auto same = [&](const char* key, const auto& now, const char* flag) {
      using T = std::decay_t<decltype(now)>;
      const T was = old.value(key, now);
      TOWERS_REQUIRE(was == now, "--resume: {} was trained with {} {}, this run has {} {}",
                     *resume_from, flag, was, flag, now);
    };
    same("batch", c.batch, "--batch");
    same("seed", c.seed, "--seed");
    same("dataset", c.dataset, "--dataset");
    same("augment", c.augment, "--augment");
    same("towers", c.towers, "--towers");
    same("mode", c.mode, "--mode");
    if (c.dataset == "synthetic") same("synthetic_size", c.synthetic_size, "--synthetic-size");
    std::copy(ck.params.data(), ck.params.data() + layout.total(), params.begin());
    for (auto& [name, buf] : ck.slots)
      std::copy(buf.data(), buf.data() + layout.total(), opt.slot(name));
    opt.load_state(ck.meta.optimizer_state);
    start_step = ck.meta.step;
    start_examples = ck.meta.examples_seen;
  } else {
    layout.initialize(params.data(), c.seed);
  }

  LocalParameterStore store(params.data(), opt, store_access(ec), store_locking(ec),
                            ec.device == DeviceKind::Cuda);
  std::unique_ptr<TowerGroup> group;
  try {
    group = std::make_unique<TowerGroup>(*graph, ec, c.batch, store);
  } catch (const std::bad_alloc&) {
    TOWERS_BAD_INPUT("--batch {} x --towers {}: not enough memory for the activations of model {}",
                     c.batch, c.towers, c.model);
  }
  std::unique_ptr<Tower> eval_tower;  // made on first use: every core, or the first GPU
  auto evaluate_now = [&] {
    if (!eval_tower) {
      TowerPlacement p;
      p.kind = ec.device;
      p.threads = cores;
      p.tf32 = ec.tf32;  // evaluate with the arithmetic the run trains with
      eval_tower = make_tower(*graph, 256, p);
    }
    eval_tower->load_params(params.data());
    return evaluate(*eval_tower, data.test, tf.eval);
  };

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
                 {"threads_per_tower", threads}, {"cores", cores},
                 {"oversubscribed", ec.device == DeviceKind::Cpu && c.towers * threads > cores},
                 {"device", group->tower(0).device().name()},
                 {"gpus", ec.device == DeviceKind::Cuda ? ec.gpus : 0},
                 {"towers_per_gpu", ec.device == DeviceKind::Cuda ? ceil_div(c.towers, ec.gpus) : 0}});
  say(fmt::format("towers: model {} ({} parameters), {} on {} ({} train / {} test), {} steps, "
                  "{} x {} tower(s) of batch {} {}{}",
                  c.model, layout.count(), c.optimizer.name, c.dataset, n_train, data.test.size(),
                  total_steps, c.mode, c.towers, c.batch, placement,
                  resume_from ? fmt::format(", resumed from {} at step {}", *resume_from, start_step) : ""));

  auto epoch_at = [&](int64_t step) { return static_cast<double>(step) * per_update / n_train; };
  TrainSummary sum;
  sum.start_step = start_step;
  auto write_checkpoint = [&](int64_t step) {
    io::CheckpointMeta meta{c.model, step, start_examples + (step - start_step) * per_update,
                            epoch_at(step), config_json, opt.state()};
    std::string path = io::save_checkpoint(c.checkpoint_dir, meta, layout, params.data(),
                                           opt.slots(), c.keep_checkpoints);
    metrics.write({{"event", "checkpoint"}, {"step", step}, {"path", path}});
    sum.last_checkpoint = path;
  };

  const auto t_train = Clock::now();
  double side_seconds = 0.0;
  const int64_t end_step = c.stop_at_step > 0 ? std::min(c.stop_at_step, total_steps) : total_steps;
  auto crossed = [&](double every, int64_t step) {
    return every > 0.0 && std::floor(epoch_at(step) / every) > std::floor(epoch_at(step - 1) / every);
  };
  bool eval_due = false, ckpt_due = false;  // set by on_update, done by side_work
  RunHooks hooks;
  hooks.lr_at = [&](int64_t step) { return learning_rate(c.schedule, epoch_at(step)); };
  std::atomic<bool> target_reached{false};
  hooks.stop_requested = [&] { return g_stop_requested.load() || target_reached.load(); };
  hooks.on_update = [&](const UpdateRecord& r) {
    const double loss = r.loss;
    TOWERS_REQUIRE(std::isfinite(loss), "training diverged at step {} (loss {}): lower --lr (now {})",
                   r.version, loss, c.schedule.lr);
    sum.final_loss = loss;
    metrics.write({{"event", "step"}, {"step", r.version}, {"epoch", epoch_at(r.version)},
                   {"loss", loss}, {"train_accuracy", static_cast<double>(r.correct) / r.examples},
                   {"lr", r.lr}, {"tower", r.tower >= 0 ? nlohmann::json(r.tower) : nlohmann::json()},
                   {"contributors", r.contributors}, {"staleness", r.staleness},
                   {"wall_seconds", seconds_since(t_start)}});
    if (!c.quiet) {
      const double elapsed = seconds_since(t_train) - side_seconds;
      const double rate = (r.version - start_step) / std::max(elapsed, 1e-9);
      progress.update(r.version, end_step, epoch_at(r.version), loss, rate * per_update,
                      (end_step - r.version) / std::max(rate, 1e-9), c.log_every);
    }
    if (r.version >= end_step) return false;  // the end has its own evaluation and checkpoint
    eval_due = eval_due || crossed(c.eval_every_epochs, r.version);
    ckpt_due = ckpt_due || (!c.checkpoint_dir.empty() && crossed(c.checkpoint_every_epochs, r.version));
    return eval_due || ckpt_due;
  };
  hooks.side_work = [&](int64_t step) {
    const auto t_side = Clock::now();
    if (std::exchange(eval_due, false)) {
      EvalResult ev = evaluate_now();
      metrics.write({{"event", "eval"}, {"step", step}, {"epoch", epoch_at(step)},
                     {"test_accuracy", ev.accuracy}, {"test_loss", ev.loss},
                     {"wall_seconds", seconds_since(t_start)},
                     {"train_seconds", seconds_since(t_train) - side_seconds - seconds_since(t_side)}});
      say(fmt::format("epoch {:.2f}: test accuracy {:.2f}% (loss {:.4f})", epoch_at(step),
                      100.0 * ev.accuracy, ev.loss));
      if (c.target_accuracy > 0.0 && ev.accuracy >= c.target_accuracy && !target_reached.load()) {
        sum.time_to_target = seconds_since(t_train) - side_seconds - seconds_since(t_side);
        sum.wall_to_target = seconds_since(t_start);
        metrics.write({{"event", "target"}, {"step", step}, {"epoch", epoch_at(step)},
                       {"test_accuracy", ev.accuracy}, {"train_seconds", sum.time_to_target},
                       {"wall_seconds", sum.wall_to_target}});
        say(fmt::format("test accuracy {:.2f}% reaches the target {:.2f}% after {} of training",
                        100.0 * ev.accuracy, 100.0 * c.target_accuracy,
                        format_duration(sum.time_to_target)));
        target_reached.store(true);
      }
    }
    if (std::exchange(ckpt_due, false)) write_checkpoint(step);
    side_seconds += seconds_since(t_side);  // images/s measures training only
  };

  group->run(data.train, tf.train, c.seed, start_step, end_step, start_examples / c.batch, hooks);
  const int64_t step = group->version();
  sum.interrupted = g_stop_requested.load() && step < end_step;
  const double train_seconds = seconds_since(t_train) - side_seconds;
  if (!c.checkpoint_dir.empty() && step > start_step) write_checkpoint(step);
  if (sum.interrupted)
    say(fmt::format("interrupted at step {}{}", step,
                    sum.last_checkpoint.empty() ? "" : "; saved " + sum.last_checkpoint));

  // An interrupted run stops promptly: its checkpoint is written, the test pass is skipped.
  EvalResult ev;
  if (!sum.interrupted) ev = evaluate_now();
  if (c.target_accuracy > 0.0 && !target_reached.load() && !sum.interrupted &&
      ev.accuracy >= c.target_accuracy) {
    sum.time_to_target = train_seconds;
    sum.wall_to_target = seconds_since(t_start);
  }
  sum.steps = step;
  sum.epochs = epoch_at(step);
  sum.test_accuracy = ev.accuracy;
  sum.test_loss = ev.loss;
  const int64_t trained = (step - start_step) * per_update;
  sum.train_images_per_sec = trained / std::max(train_seconds, 1e-9);
  sum.wall_seconds = seconds_since(t_start);
  sum.tower_stats = group->stats().to_json(train_seconds);
  nlohmann::json summary = {{"event", "summary"},
                            {"model", c.model},
                            {"dataset", c.dataset},
                            {"mode", c.mode},
                            {"towers", c.towers},
                            {"threads_per_tower", threads},
                            {"test_accuracy", sum.interrupted ? nlohmann::json() : nlohmann::json(sum.test_accuracy)},
                            {"test_loss", sum.interrupted ? nlohmann::json() : nlohmann::json(sum.test_loss)},
                            {"train_images_per_sec", sum.train_images_per_sec},
                            {"wall_seconds", sum.wall_seconds},
                            {"train_seconds", train_seconds},
                            {"steps", sum.steps},
                            {"start_step", start_step},
                            {"epochs", sum.epochs},
                            {"final_loss", sum.final_loss},
                            {"interrupted", sum.interrupted},
                            {"checkpoint", sum.last_checkpoint},
                            {"target_accuracy", c.target_accuracy},
                            {"time_to_target", sum.time_to_target >= 0 ? nlohmann::json(sum.time_to_target) : nlohmann::json()},
                            {"wall_to_target", sum.wall_to_target >= 0 ? nlohmann::json(sum.wall_to_target) : nlohmann::json()}};
  summary.update(sum.tower_stats);
  metrics.write(summary);
  if (!sum.interrupted)
    say(fmt::format("done: {} steps ({:.2f} epochs) in {}, {:.0f} images/s; test accuracy {:.2f}% "
                    "on {} examples",
                    sum.steps, sum.epochs, format_duration(sum.wall_seconds),
                    sum.train_images_per_sec, 100.0 * sum.test_accuracy, ev.examples));
  if (c.towers > 1 && !c.quiet) {
    std::string line = fmt::format("towers: max staleness {}, dropped gradients {};", group->stats().max_staleness(),
                                   group->stats().dropped_total());
    for (const auto& t : sum.tower_stats["towers"])
      line += fmt::format(" [{}: {} steps, {:.0f} ms p50, {:.0f} ms p99]", t["tower"].get<int>(),
                          t["steps"].get<int64_t>(), t["step_ms_p50"].get<double>(),
                          t["step_ms_p99"].get<double>());
    say(line);
  }
  return sum;
}

EvalSummary evaluate_checkpoint(const std::string& path, const std::string& dataset,
                                const std::string& data_dir, int threads,
                                const std::string& device) {
  TOWERS_REQUIRE(device == "cpu" || device == "cuda",
                 "--device: unknown device '{}' (known: cpu, cuda)", device);
  if (device == "cuda") {
    const GpuList found = list_gpus();
    TOWERS_REQUIRE(!found.gpus.empty(), "--device cuda: no GPU available: {}", found.why_none);
  }
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
  TowerPlacement p;
  p.kind = device == "cuda" ? DeviceKind::Cuda : DeviceKind::Cpu;
  p.threads = threads > 0 ? threads : hardware_threads();
  std::unique_ptr<Tower> tower = make_tower(*graph, 256, p);
  tower->load_params(ck.params.data());
  EvalResult ev = evaluate(*tower, data.test, tf.eval);
  return {meta.model, meta.step, ev.examples, ev.accuracy, ev.loss};
}

}  // namespace towers
