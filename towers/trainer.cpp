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
#include <fmt/ranges.h>

#include "core/check.h"
#include "core/clock.h"
#include "core/device.h"
#include "core/gpu.h"
#include "core/parallel.h"
#include "data/load.h"
#include "data/pipeline.h"
#include "io/checkpoint.h"
#include "layers/loss.h"
#include "metrics/metrics.h"
#include "models/models.h"
#include "towers/mirrored_store.h"
#include "towers/placed_tower.h"
#include "towers/placement.h"
#include "towers/remote/remote_store.h"
#include "towers/remote/wire.h"
#include "towers/tower.h"
#include "towers/tower_group.h"

namespace towers {

std::atomic<bool> g_stop_requested{false};

namespace {

// A remote sync run that has gone back to a restarted shard's checkpoint this many times stops.
constexpr int kMaxRollbacks = 16;

struct EvalResult {
  double accuracy = 0.0, loss = 0.0;
  int64_t examples = 0;
};

void check_tta(const std::string& tta, const std::string& origin) {
  TOWERS_REQUIRE(tta == "none" || tta == "flip",
                 "{}: unknown test-time augmentation '{}' (known: none, flip)", origin, tta);
}

// Mirrors each image of a batch left-right, in place.
void flip_images(float* images, int64_t n, const Shape& input) {
  const int64_t w = input.back(), rows = numel(input) / w;
  for (int64_t r = 0; r < n * rows; ++r) std::reverse(images + r * w, images + (r + 1) * w);
}

// The test split's accuracy and mean (plain) cross-entropy. tta "flip" scores each image by
// the mean of its logits and its mirror image's (test-time augmentation).
EvalResult evaluate(Tower& tower, const data::Dataset& test, const data::AugmentConfig& cfg,
                    const std::string& tta) {
  const bool flip = tta == "flip";
  const int64_t b = tower.max_batch(), k = tower.graph().num_classes();
  const int64_t per = numel(tower.graph().input_shape());
  std::vector<float> images(b * per), logits(flip ? b * k : 0), mirrored(flip ? b * k : 0);
  std::vector<int32_t> labels(b);
  double loss = 0.0;
  int64_t correct = 0;
  for (int64_t i = 0; i < test.size(); i += b) {
    const int64_t e = std::min(i + b, test.size()), n = e - i;
    tower.host().execute([&] {
      data::make_eval_batch(test, cfg, i, e, images.data(), labels.data());
    });
    StepStats s = tower.evaluate(images.data(), labels.data(), n);
    if (flip) {
      tower.copy_logits(logits.data(), n);
      tower.host().execute([&] { flip_images(images.data(), n, tower.graph().input_shape()); });
      tower.evaluate(images.data(), labels.data(), n);
      tower.copy_logits(mirrored.data(), n);
      tower.host().execute([&] {
        for (int64_t j = 0; j < n * k; ++j) logits[j] = 0.5f * (logits[j] + mirrored[j]);
        LossArgs la;
        la.n = n;
        la.classes = k;
        la.logits = logits.data();
        la.labels = labels.data();
        const LossSums r = tower.graph().loss().forward(la);
        s = StepStats{r.loss_sum, r.correct, n};
      });
    }
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

// The towers of the whole run: with a cluster, every worker's (worker r runs r*T .. r*T+T-1;
// --slow-tower names them so).
int all_towers(const TrainConfig& c) {
  return remote::cluster_requested(c.cluster)
             ? c.towers * remote::read_cluster(c.cluster, c.task).cluster.workers()
             : c.towers;
}

// --slow-tower's specs: TOWER:MS sleeps, TOWER:late towers that are always late.
struct SlowTowers {
  std::vector<std::pair<int, int>> sleeps;
  std::vector<int> late;
};

SlowTowers parse_slow_towers(const std::vector<std::string>& specs, int towers) {
  SlowTowers out;
  for (const std::string& s : specs) {
    int t = -1, ms = -1, used = 0;
    char tail = 0;
    const bool late =
        std::sscanf(s.c_str(), "%d:late%n", &t, &used) == 1 && used == static_cast<int>(s.size());
    const bool ok = late || std::sscanf(s.c_str(), "%d:%d%c", &t, &ms, &tail) == 2;
    TOWERS_REQUIRE(ok && t >= 0 && t < towers && (late || ms >= 0),
                   "--slow-tower '{}': expected TOWER:MILLISECONDS or TOWER:late with 0 <= "
                   "TOWER < {}",
                   s, towers);
    TOWERS_REQUIRE(!late || std::find(out.late.begin(), out.late.end(), t) == out.late.end(),
                   "--slow-tower {}:late is given twice", t);
    if (late)
      out.late.push_back(t);
    else
      out.sleeps.emplace_back(t, ms);
  }
  return out;
}

// The placement a run uses, and how errors about it begin: --placement when given ("none":
// whole towers), else the model file's "placement"; text is empty for whole towers.
struct RunPlacement {
  std::string text, origin;
  bool from_file = false;
};

RunPlacement run_placement(const TrainConfig& c, const ModelSpec& spec) {
  if (c.placement == "none") return {};
  if (!c.placement.empty()) return {c.placement, "--placement", false};
  if (spec.placement) return {*spec.placement, spec.placement_origin, true};
  return {};
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
  if (c.device != "cuda") {
    // The GPU flags given, by name.
    std::vector<std::string> given;
    if (c.gpus != 0) given.push_back(fmt::format("--gpus {}", c.gpus));
    if (c.tf32) given.push_back("--tf32");
    if (!c.cuda_graphs) given.push_back("--no-cuda-graphs");
    if (c.backward_branches) given.push_back("--backward-branches");
    if (reduce != Reduce::Host) given.push_back("--reduce nccl");
    TOWERS_REQUIRE(given.empty(), "{} {} for GPU towers: {} --device cuda", fmt::join(given, ", "),
                   given.size() == 1 ? "is" : "are", given.size() == 1 ? "it needs" : "they need");
  }
  TOWERS_REQUIRE(reduce == Reduce::Host ||
                     (mode == Mode::Sync &&
                      (c.replicas_to_aggregate == 0 || c.replicas_to_aggregate == c.towers)),
                 "--reduce nccl is for --mode sync without backup towers (--replicas-to-aggregate below --towers)");
  TOWERS_REQUIRE(c.input == "host" || c.input == "device",
                 "--input: unknown place '{}' (known: host, device)", c.input);
  TOWERS_REQUIRE(c.input == "host" || c.device == "cuda",
                 "--input device makes the training batches on the GPU from a copy of the "
                 "training set there: it needs --device cuda");
  TOWERS_REQUIRE(c.params == "host" || c.params == "mirrored",
                 "--params: unknown home '{}' (known: host, mirrored)", c.params);
  if (c.params == "mirrored") {
    TOWERS_REQUIRE(c.device == "cuda",
                   "--params mirrored keeps a copy of the parameters on each GPU: it needs "
                   "--device cuda");
    TOWERS_REQUIRE(mode != Mode::Sync || c.replicas_to_aggregate == 0 ||
                       c.replicas_to_aggregate == c.towers,
                   "--params mirrored averages every tower's gradient in each sync update; for "
                   "--replicas-to-aggregate (backup towers) use --params host");
    TOWERS_REQUIRE(!c.staleness_aware_lr || mode == Mode::Sync,
                   "--params mirrored applies each async step's update inside the step, at the "
                   "learning rate of its start: --staleness-aware-lr needs --params host");
  }
  TOWERS_REQUIRE(c.sync_every >= 0, "--sync-every must be at least 1 step (0: the default, 1), got {}",
                 c.sync_every);
  TOWERS_REQUIRE(c.sync_every == 0 || (c.params == "mirrored" && mode != Mode::Sync),
                 "--sync-every sets how often async and ssp towers with --params mirrored fold "
                 "their steps into the host copy; {}",
                 c.params == "mirrored" ? "sync mode averages every step"
                                        : "with --params host every step updates the host copy");
  check_tta(c.tta, "--tta");
  TOWERS_REQUIRE(c.on_divergence == "stop" || c.on_divergence == "skip-step",
                 "--on-divergence: unknown policy '{}' (known: stop, skip-step)", c.on_divergence);
  TOWERS_REQUIRE(c.clip_grad_norm >= 0.0 && std::isfinite(c.clip_grad_norm),
                 "--clip-grad-norm must be a finite number >= 0 (0: off), got {}", c.clip_grad_norm);
  TOWERS_REQUIRE(c.lr_scaling == "none" || c.lr_scaling == "linear",
                 "--lr-scaling: unknown rule '{}' (known: none, linear)", c.lr_scaling);
  const SlowTowers slow = parse_slow_towers(c.slow_towers, all_towers(c));
  if (!slow.late.empty()) {
    // A late tower waits until the others can go no further without it: backup towers apply
    // updates without it, SSP towers wait for it at the bound.
    const int k = c.replicas_to_aggregate == 0 ? c.towers : c.replicas_to_aggregate;
    const int late = static_cast<int>(slow.late.size());
    TOWERS_REQUIRE(((mode == Mode::Sync && k < c.towers) || mode == Mode::Ssp) &&
                       !remote::cluster_requested(c.cluster),
                   "--slow-tower {}:late holds each gradient until the other towers can go no "
                   "further without it: that needs --mode sync with --replicas-to-aggregate "
                   "below --towers, or --mode ssp, in one process (here {})",
                   slow.late.front(),
                   remote::cluster_requested(c.cluster) ? "the towers are in several processes"
                   : mode == Mode::Async ? "async towers neither wait for it nor update without it"
                                         : "every update would wait for it forever");
    TOWERS_REQUIRE(mode == Mode::Ssp || late <= c.towers - k,
                   "--slow-tower: {} late towers, but --replicas-to-aggregate {} of --towers {} "
                   "leaves room for {}: the others could never make an update",
                   late, k, c.towers, c.towers - k);
    TOWERS_REQUIRE(mode != Mode::Ssp || late < c.towers,
                   "--slow-tower: {} late towers of --towers {}: with --mode ssp at least one "
                   "tower must not be late, or none would ever wait for them",
                   late, c.towers);
  }
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
  TOWERS_REQUIRE(c.label_smoothing >= 0.0f && c.label_smoothing < 1.0f,
                 "--label-smoothing must be in [0, 1), got {}", c.label_smoothing);
  TOWERS_REQUIRE(o.ema >= 0.0 && o.ema < 1.0, "--ema must be a decay in [0, 1), got {}", o.ema);
  TOWERS_REQUIRE(o.lookahead_k >= 0, "--lookahead must be >= 0 updates, got {}", o.lookahead_k);
  TOWERS_REQUIRE(o.lookahead_alpha > 0.0f && o.lookahead_alpha <= 1.0f,
                 "--lookahead-alpha must be in (0, 1], got {}", o.lookahead_alpha);
  TOWERS_REQUIRE(c.params != "mirrored" || mode == Mode::Sync ||
                     (o.ema == 0.0 && o.lookahead_k == 0),
                 "--params mirrored in {} mode keeps one replica per tower, folded into the "
                 "host copy every --sync-every steps, and --ema and --lookahead would follow "
                 "one replica's weights: use --mode sync or --params host", c.mode);
  if (c.sync_bn) {
    // Async, SSP and backup towers have no global batch: each update is one tower's batch (or
    // the first K of the round's), at versions that differ.
    TOWERS_REQUIRE(mode == Mode::Sync && (c.replicas_to_aggregate == 0 ||
                                          c.replicas_to_aggregate == c.towers),
                   "--sync-bn normalizes over the global batch of a sync step: it needs --mode "
                   "sync with every tower in each update{}",
                   mode == Mode::Sync ? " (no --replicas-to-aggregate below --towers)"
                                      : fmt::format(", not --mode {}", c.mode));
    TOWERS_REQUIRE(!remote::cluster_requested(c.cluster), "--sync-bn with a cluster: the towers "
                   "of other worker processes cannot join a step's statistics; it is for the "
                   "towers of one process");
  }
  const ModelSpec spec = read_model(c.model);  // throws for an unknown model or a bad file
  const RunPlacement placement = run_placement(c, spec);
  bool gpu_part = false;  // the placement puts a part on a GPU
  TOWERS_REQUIRE(!c.sync_bn || placement.text.empty(),
                 "--sync-bn with {}: a placed tower's parts normalize per tower; use whole "
                 "towers", placement.origin);
  if (!placement.text.empty() || c.micro_batches != 1) {
    TOWERS_REQUIRE(!placement.text.empty(),
                   "--micro-batches needs --placement, or a model file with a \"placement\" "
                   "(micro-batches flow through the parts of a placed tower)");
    TOWERS_REQUIRE(c.device == "cpu",
                   "{} with --device {}: a placed tower names its devices in the placement "
                   "(cpu:N and cuda:N parts); leave --device at cpu{}", placement.origin,
                   c.device, placement.from_file ? ", or give --placement none for whole towers" : "");
    const std::unique_ptr<Graph> g = build_graph(spec);
    const Placement parsed = parse_placement(placement.text, *g, placement.origin);
    for (size_t q = 0; q < parsed.parts.size(); ++q) {
      const PlacedPart& part = parsed.parts[q];
      if (part.kind != DeviceKind::Cuda) continue;
      gpu_part = true;
      const GpuList found = list_gpus();
      TOWERS_REQUIRE(static_cast<size_t>(part.index) < found.gpus.size(),
                     "{}: part {} is placed on {}, but this machine has {} GPU(s){}",
                     placement.origin, q + 1, part.device_name(), found.gpus.size(),
                     found.gpus.empty() ? " (" + found.why_none + ")" : "");
      TOWERS_REQUIRE(c.micro_batches <= kMaxGpuPartMicroBatches,
                     "--micro-batches {}: part {} on {} sums at most {} micro-batches",
                     c.micro_batches, q + 1, part.device_name(), kMaxGpuPartMicroBatches);
    }
    check_micro_batches(*g, c.batch, c.micro_batches);
  }
  if (c.device != "cuda" && !gpu_part && !c.cudnn.is_default()) {
    std::vector<std::string> given;
    if (c.cudnn.nondeterministic) given.push_back("--cudnn-nondeterministic");
    if (c.cudnn.benchmark) given.push_back("--cudnn-benchmark");
    if (c.cudnn.gemm_only) given.push_back("--cudnn-gemm-only");
    TOWERS_BAD_INPUT(
        "{} {} cuDNN's convolutions on a GPU: {} --device cuda, or a placement with "
        "a cuda:N part",
        fmt::join(given, ", "), given.size() == 1 ? "rules" : "rule",
        given.size() == 1 ? "it needs" : "they need");
  }
  TOWERS_REQUIRE(c.conv.empty() || conv_algorithm_named(c.conv),
                 "--conv: unknown algorithm '{}' (known: auto, im2col, winograd)", c.conv);
  TOWERS_REQUIRE(find_optimizer(o.name), "--optimizer: unknown optimizer '{}' (known: {})",
                 o.name, fmt::join(optimizer_names(), ", "));
  if (remote::cluster_requested(c.cluster)) {
    const remote::ClusterTask ct = remote::read_cluster(c.cluster, c.task);
    TOWERS_REQUIRE(ct.task_given, "{}: this process's task is not named: add --task worker:I "
                   "(or a \"task\" to the cluster file)", ct.cluster.origin);
    TOWERS_REQUIRE(ct.task.type != "ps", "--task {}: a parameter-server shard runs as `towers ps "
                   "--cluster FILE --task {}`, not `towers train`", ct.task.name(), ct.task.name());
    TOWERS_REQUIRE(c.params == "host", "--params {} with a cluster: the parameters live on the "
                   "parameter-server shards (--params host)", c.params);
    TOWERS_REQUIRE(c.clip_grad_norm == 0.0, "--clip-grad-norm with a cluster: the global norm "
                   "of a round is not known to any one worker; leave it off");
    TOWERS_REQUIRE(!c.staleness_aware_lr || c.mode == "sync",
                   "--staleness-aware-lr with a cluster in --mode {}: a push's staleness counts "
                   "the other workers' updates, which only the shards see once they apply it, "
                   "after its learning rate is sent; leave it off", c.mode);
    TOWERS_REQUIRE(c.replicas_to_aggregate <= ct.cluster.workers(),
                   "--replicas-to-aggregate {} with a cluster counts workers, and {} has {}",
                   c.replicas_to_aggregate, ct.cluster.origin, ct.cluster.workers());
    TOWERS_REQUIRE(c.rpc_timeout > 0.0 && c.heartbeat_timeout > 0.0,
                   "--rpc-timeout and --heartbeat-timeout must be > 0 seconds");
    TOWERS_REQUIRE(c.rpc_piece_kib >= 1 && c.rpc_piece_kib <= (1 << 18),
                   "--rpc-piece-kib {}: pieces of 1 KiB to 256 MiB", c.rpc_piece_kib);
    TOWERS_REQUIRE(c.rpc_stripes >= 1 && c.rpc_stripes <= remote::kMaxStripes,
                   "--rpc-stripes {}: 1 to {} connections a shard", c.rpc_stripes,
                   remote::kMaxStripes);
    remote::check_tls({c.tls_cert, c.tls_key, c.tls_ca});
    remote::read_token(c.token_file, "TOWERS_TOKEN", false, /*warn=*/false);  // (Run warns)
  } else {
    TOWERS_REQUIRE(c.task.empty(), "--task {} needs --cluster FILE (or TF_CONFIG)", c.task);
  }
}

nlohmann::json to_json(const TrainConfig& c) {
  return {
      {"model", c.model},
      {"dataset", c.dataset},
      {"data_dir", c.data_dir},
      {"augment", c.augment},
      {"tta", c.tta},
      {"synthetic_size", c.synthetic_size},
      {"epochs", c.epochs},
      {"steps", c.steps},
      {"batch", c.batch},
      {"towers", c.towers},
      {"threads_per_tower", c.threads_per_tower},
      {"placement", c.placement},
      {"micro_batches", c.micro_batches},
      {"device", c.device},
      {"gpus", c.gpus},
      {"reduce", c.reduce},
      {"params", c.params},
      {"sync_every", c.sync_every},
      {"tf32", c.tf32},
      {"cuda_graphs", c.cuda_graphs},
      {"backward_branches", c.backward_branches},
      {"cudnn_nondeterministic", c.cudnn.nondeterministic},
      {"cudnn_benchmark", c.cudnn.benchmark},
      {"cudnn_gemm_only", c.cudnn.gemm_only},
      {"input", c.input},
      {"mode", c.mode},
      {"replicas_to_aggregate", c.replicas_to_aggregate},
      {"staleness", c.staleness},
      {"use_locking", c.use_locking},
      {"staleness_aware_lr", c.staleness_aware_lr},
      {"lr_scaling", c.lr_scaling},
      {"on_divergence", c.on_divergence},
      {"clip_grad_norm", c.clip_grad_norm},
      {"seed", c.seed},
      {"optimizer", c.optimizer.name},
      {"momentum", c.optimizer.momentum ? nlohmann::json(*c.optimizer.momentum) : nlohmann::json()},
      {"nesterov", c.optimizer.nesterov},
      {"ema", c.optimizer.ema},
      {"lookahead", c.optimizer.lookahead_k},
      {"lookahead_alpha", c.optimizer.lookahead_alpha},
      {"label_smoothing", c.label_smoothing},
      {"sync_bn", c.sync_bn},
      {"conv", c.conv},
      {"lr", c.schedule.lr},
      {"lr_schedule", c.schedule.kind},
      {"decay_epochs", c.schedule.decay_epochs},
      {"decay_factor", c.schedule.decay_factor},
      {"warmup_epochs", c.schedule.warmup_epochs}};
}

// ---- train: setup, loop, summary ------------------------------------------------------------
//
// train() reads top to bottom:
//   Run run(c);         setup: every input checked (flags, data, GPUs, checkpoint folder,
//                       the checkpoint to resume), parameters restored or initialised, towers
//                       made; nothing is written before this has succeeded
//   run.open();         the metrics file and the run's config line
//   run.loop();         the towers step; evaluations and checkpoints as they fall due
//   run.summary();      the last checkpoint, the test pass, the summary line
namespace {

// The cuDNN rules other than the default, for a run's first line: ", cuDNN's GEMM family only".
std::string cudnn_rules_text(const CudnnRules& r) {
  return fmt::format("{}{}{}", r.nondeterministic ? ", any cuDNN algorithm" : "",
                     r.benchmark ? ", cuDNN algorithms timed" : "",
                     r.gemm_only ? ", cuDNN's GEMM family only" : "");
}

// The flags, as the engine takes them: strings become enums here, once. GPUs are checked
// like every other input. placement describes where the towers run, for the first line.
EngineConfig engine_config(const TrainConfig& c, int threads, std::string& placement) {
  EngineConfig ec;
  ec.mode = *mode_named(c.mode);  // validate() has checked the names
  ec.towers = c.towers;
  ec.threads_per_tower = threads;
  ec.replicas_to_aggregate = c.replicas_to_aggregate;
  ec.staleness = std::max<int64_t>(c.staleness, 0);
  ec.use_locking = c.use_locking;
  ec.staleness_aware_lr = c.staleness_aware_lr;
  const SlowTowers slow = parse_slow_towers(c.slow_towers, all_towers(c));
  ec.stragglers = slow.sleeps;
  ec.late_towers = slow.late;
  ec.clip_grad_norm = c.clip_grad_norm;
  ec.sync_bn = c.sync_bn;
  ec.check_grad_norm = c.on_divergence == "skip-step";
  placement = fmt::format("on cpu ({} threads each)", threads);
  if (c.device != "cuda") return ec;
  GpuList found = list_gpus();
  TOWERS_REQUIRE(!found.gpus.empty(), "--device cuda: no GPU available: {}", found.why_none);
  const int have = static_cast<int>(found.gpus.size());
  TOWERS_REQUIRE(c.gpus <= have, "--gpus {}: this machine has {} GPU(s)", c.gpus, have);
  ec.device = DeviceKind::Cuda;
  ec.gpus = std::min(c.gpus > 0 ? c.gpus : have, c.towers);
  ec.reduce = *reduce_named(c.reduce);
  ec.tf32 = c.tf32;
  ec.cuda_graphs = c.cuda_graphs;
  ec.backward_branches = c.backward_branches;
  ec.cudnn = c.cudnn;
  ec.device_input = c.input == "device";
  TOWERS_REQUIRE(ec.reduce == Reduce::Host || c.towers <= ec.gpus,
                 "--reduce nccl: {} towers on {} GPU(s); NCCL needs one tower per GPU (use "
                 "--reduce host to share GPUs)", c.towers, ec.gpus);
  TOWERS_REQUIRE(c.params != "mirrored" || ec.mode != Mode::Sync || c.towers == 1 || ec.gpus == 1 ||
                     ec.reduce == Reduce::Nccl,
                 "--params mirrored with {} towers on {} GPUs averages with NCCL: add --reduce "
                 "nccl (one tower per GPU), or use --gpus 1", c.towers, ec.gpus);
  const std::string sharing =
      c.towers > ec.gpus ? fmt::format(",{} {} towers share {} GPU",
                                       c.towers % ec.gpus == 0 ? "" : " up to",
                                       ceil_div(c.towers, ec.gpus),
                                       c.towers % ec.gpus == 0 ? "each" : "a")
                         : "";
  placement = fmt::format("on {} GPU(s) ({}){}{}{}", ec.gpus, found.gpus[0].name, sharing,
                          c.tf32 ? ", TF32" : "", cudnn_rules_text(c.cudnn));
  return ec;
}

// A model needs a logit for every class its data has (a model file may say fewer).
void check_classes(const Graph& g, const data::DataSplit& d, const std::string& model,
                   const std::string& dataset) {
  const int have = std::max(d.train.num_classes, d.test.num_classes);
  TOWERS_REQUIRE(have <= g.num_classes(),
                 "--model {} has {} classes but --dataset {} has {}: the model needs at least as "
                 "many outputs as the data has labels", model, g.num_classes(), dataset, have);
}

// A writable checkpoint folder; a fresh run refuses one that holds another run's files.
void check_checkpoint_dir(const TrainConfig& c) {
  if (c.checkpoint_dir.empty()) return;
  std::error_code ec_dir;
  std::filesystem::create_directories(c.checkpoint_dir, ec_dir);
  TOWERS_REQUIRE(std::filesystem::is_directory(c.checkpoint_dir),
                 "--checkpoint-dir: '{}' is not a directory and cannot be created{}",
                 c.checkpoint_dir, ec_dir ? ": " + ec_dir.message() : "");
  TOWERS_REQUIRE(access(c.checkpoint_dir.c_str(), W_OK) == 0,
                 "--checkpoint-dir: '{}' is not writable", c.checkpoint_dir);
  // A fresh run into a folder of another run's checkpoints would later mix the two on
  // --resume or in the rotation of old files.
  if (c.resume) return;
  auto existing = io::latest_checkpoint(c.checkpoint_dir);
  TOWERS_REQUIRE(!existing,
                 "--checkpoint-dir: '{}' already holds checkpoints ({}); add --resume to "
                 "continue that run, or give an empty directory",
                 c.checkpoint_dir, existing.value_or(""));
}

class Run {
 public:
  explicit Run(const TrainConfig& c_in);
  void open();
  void loop();
  TrainSummary summary();

 private:
  double epoch_at(int64_t step) const {
    return static_cast<double>(step) * per_update_ / n_train_;
  }
  void restore_or_initialize();
  // Evaluates the live parameters (or, with --ema, their average) on the test set; the weights
  // it read go to evaluated_weights_.
  EvalResult evaluate_now();
  // What the terminal says of the last evaluation's weights and of --tta (empty for plain
  // weights).
  std::string eval_note() const;
  void write_checkpoint(int64_t step);
  void say(const std::string& s) {
    if (!c_.quiet) progress_.line(s);
  }
  // The hooks of the step driver.
  bool on_update(const UpdateRecord& r);
  void side_work(int64_t step);
  // A placement (--placement or the model file's): the parts, their threads (threads_ becomes
  // their sum), and placed towers.
  void place_towers();
  TowerGroup::TowerFactory tower_factory() const;
  nlohmann::json pipeline_summary();

  TrainConfig c_;
  Clock::time_point t_start_ = Clock::now(), t_train_;
  int cores_ = hardware_threads(), threads_ = 0;
  std::unique_ptr<Graph> graph_;
  data::DataSplit data_;
  data::Transforms tf_;
  int64_t n_train_ = 0;
  EngineConfig ec_;
  std::string placement_;
  std::string placement_origin_;  // "--placement", or where the model file gives it
  std::optional<Placement> placed_;
  bool placed_on_gpu() const {
    return placed_ && std::any_of(placed_->parts.begin(), placed_->parts.end(),
                                  [](const PlacedPart& p) { return p.kind == DeviceKind::Cuda; });
  }
  int64_t per_update_ = 0, total_steps_ = 0, end_step_ = 0;
  std::vector<float> params_;
  std::unique_ptr<Optimizer> opt_;
  int64_t start_step_ = 0, start_examples_ = 0;
  // The step of the checkpoint written last, or of the round a rollback went back to (its
  // checkpoint was written before); -1 for none.
  int64_t saved_step_ = -1;
  // The chief's own file of a checkpoint whose shards' saves are under way, or failed.
  std::string unsaved_by_shards_;
  std::optional<std::string> resume_from_;
  // The schedule's learning rate for the update that makes version step + 1.
  float lr_at(int64_t step) const { return learning_rate(c_.schedule, epoch_at(step)); }

  std::unique_ptr<ParameterStore> store_;
  // A remote tower group: this worker's cluster and rank; the chief (rank 0) alone
  // initialises the shards, evaluates and writes checkpoints.
  std::optional<remote::ClusterTask> cluster_;
  int rank_ = 0;
  bool chief_ = true;
  bool continues_run_ = false;  // --resume was given (a worker other than the chief drops it)
  remote::RemoteParameterStore* remote_ = nullptr;  // store_, when it is remote
  int64_t dropped_by_shards_ = 0;  // late gradients of backup-worker rounds
  std::unique_ptr<TowerGroup> group_;
  std::unique_ptr<Tower> eval_tower_;  // made on first use: every core, or the first GPU

  std::unique_ptr<MetricsWriter> metrics_;
  std::string evaluated_weights_ = "trained";  // the last evaluation's (evaluate_now)
  Progress progress_{stderr};
  nlohmann::json config_json_;
  TrainSummary sum_;
  double side_seconds_ = 0.0;       // evaluation and checkpoints: not training time
  bool eval_due_ = false, ckpt_due_ = false;  // set by on_update, done by side_work
  std::atomic<bool> target_reached_{false};
};

Run::Run(const TrainConfig& c_in) : c_(c_in) {
  validate(c_);
  threads_ = c_.threads_per_tower > 0 ? c_.threads_per_tower : std::max(1, cores_ / c_.towers);
  ModelSpec spec = read_model(c_.model);
  if (!c_.conv.empty()) set_conv_algorithm(spec, *conv_algorithm_named(c_.conv));
  graph_ = build_graph(spec);
  graph_->set_loss(std::make_unique<SoftmaxCrossEntropy>(c_.label_smoothing));
  // From here on c_.placement is the placement the run uses (its config records it): the
  // flag's, or the model file's when the flag is not given; empty for whole towers.
  const RunPlacement placement = run_placement(c_, spec);
  c_.placement = placement.text;
  placement_origin_ = placement.origin;
  // Everything that can be wrong with the input is found before anything is written.
  data_ = data::load_dataset(dataset_request(c_.dataset, c_.data_dir, graph_->input_shape(),
                                             c_.synthetic_size, c_.seed));
  check_classes(*graph_, data_, c_.model, c_.dataset);
  tf_ = data::transforms_for(c_.augment, c_.dataset, graph_->input_shape(), data_.train, c_.model);
  n_train_ = data_.train.size();
  ec_ = engine_config(c_, threads_, placement_);
  if (!c_.placement.empty()) place_towers();
  if (remote::cluster_requested(c_.cluster)) {
    cluster_ = remote::read_cluster(c_.cluster, c_.task);
    rank_ = cluster_->task.rank(cluster_->cluster);
    chief_ = rank_ == 0;
    // This worker runs the global towers rank*T .. rank*T+T-1 of W x T.
    ec_.first_tower = rank_ * c_.towers;
    ec_.all_towers = cluster_->cluster.workers() * c_.towers;
    // Backup workers are counted by the shards, in workers: every local tower's gradient goes
    // into the worker's one push.
    ec_.replicas_to_aggregate = 0;
    placement_ += fmt::format(", worker {} of {} ({}{}), {} parameter-server shard(s)", rank_,
                              cluster_->cluster.workers(), cluster_->task.name(),
                              chief_ ? ", the chief" : "", cluster_->cluster.ps.size());
  }

  // One step = one applied update; the schedule counts the examples behind the updates, as
  // the mode's policy says.
  per_update_ = make_policy(ec_)->examples_per_update(c_.batch, ec_.total_towers());
  if (c_.lr_scaling == "linear") c_.schedule.lr *= static_cast<float>(per_update_ / c_.batch);
  total_steps_ = c_.steps > 0 ? c_.steps
                              : static_cast<int64_t>(std::ceil(c_.epochs * static_cast<double>(n_train_) /
                                                               per_update_));
  c_.schedule.total_epochs = static_cast<double>(total_steps_) * per_update_ / n_train_;
  end_step_ = c_.stop_at_step > 0 ? std::min(c_.stop_at_step, total_steps_) : total_steps_;

  if (!chief_) {
    // Only the chief evaluates and writes checkpoints; a worker's parameters come from the
    // shards.
    c_.checkpoint_dir.clear();
    continues_run_ = c_.resume;
    c_.resume = false;
    c_.eval_every_epochs = 0.0;
    c_.target_accuracy = 0.0;
  }
  check_checkpoint_dir(c_);
  restore_or_initialize();
  if (cluster_) {
    remote::RemoteConfig rc;
    rc.cluster = cluster_->cluster;
    rc.rank = rank_;
    rc.token = remote::read_token(c_.token_file);
    rc.tls = {c_.tls_cert, c_.tls_key, c_.tls_ca};
    rc.rpc_timeout = c_.rpc_timeout;
    rc.heartbeat_timeout = c_.heartbeat_timeout;
    rc.piece_floats = c_.rpc_piece_kib * 1024 / static_cast<int64_t>(sizeof(float));
    rc.stripes = c_.rpc_stripes;
    rc.sessions = c_.rpc_sessions;
    rc.mode = c_.mode;
    rc.replicas_to_aggregate = c_.replicas_to_aggregate;
    rc.staleness = std::max<int64_t>(c_.staleness, 0);
    rc.use_locking = c_.use_locking;
    rc.model = c_.model;
    rc.config = to_json(c_).dump();
    rc.run_id = fmt::format("{}-{}-{}", c_.model, c_.seed,
                            std::chrono::system_clock::now().time_since_epoch().count());
    auto store = std::make_unique<remote::RemoteParameterStore>(
        rc, graph_->layout(), params_.data(), *opt_, store_access(ec_));
    if (chief_) store->initialize_shards(start_step_);
    start_step_ = store->join();
    if (!chief_) start_examples_ = start_step_ * per_update_;
    remote_ = store.get();
    store_ = std::move(store);
  } else if (c_.params == "mirrored")
    store_ = std::make_unique<MirroredParameterStore>(
        params_.data(), *opt_, ec_.reduce, [this](int64_t v) { return lr_at(v); },
        ec_.mode == Mode::Sync ? 0 : std::max<int64_t>(c_.sync_every, 1), ec_.clip_grad_norm,
        ec_.check_grad_norm);
  else
    store_ = std::make_unique<LocalParameterStore>(params_.data(), *opt_, store_access(ec_),
                                                   store_locking(ec_),
                                                   ec_.device == DeviceKind::Cuda);
  try {
    group_ = std::make_unique<TowerGroup>(*graph_, ec_, c_.batch, *store_, tower_factory());
  } catch (const std::bad_alloc&) {
    TOWERS_BAD_INPUT("--batch {} x --towers {}: not enough memory for the activations of model {}",
                     c_.batch, c_.towers, c_.model);
  }
}

void Run::place_towers() {
  placed_ = parse_placement(c_.placement, *graph_, placement_origin_);  // validate() checked it
  const std::vector<int> threads = PlacedTower::part_threads(*placed_, threads_);
  std::vector<std::string> parts;
  threads_ = 0;
  for (size_t p = 0; p < threads.size(); ++p) {
    placed_->parts[p].threads = threads[p];  // every count explicit from here on
    threads_ += threads[p];
    parts.push_back(fmt::format("{}@{}x{}", placed_->parts[p].layer_names(*graph_),
                                placed_->parts[p].device_name(), threads[p]));
  }
  // The step driver sizes oneTBB's pool by the towers' threads: every part's.
  ec_.threads_per_tower = threads_;
  placement_ = fmt::format("placed on {} parts ({}), {} micro-batch{}{}", parts.size(),
                           fmt::join(parts, "; "), c_.micro_batches,
                           c_.micro_batches > 1 ? "es" : "", cudnn_rules_text(c_.cudnn));
}

TowerGroup::TowerFactory Run::tower_factory() const {
  if (!placed_) return make_tower;
  return [this](const Graph& g, int64_t max_batch,
                const TowerPlacement&) -> std::unique_ptr<Tower> {
    return std::make_unique<PlacedTower>(g, max_batch, *placed_, c_.micro_batches,
                                         ec_.threads_per_tower, c_.cudnn);
  };
}

// --resume: the latest checkpoint of the folder, if there is one, after checking it continues
// this run; otherwise fresh parameters from the seed.
void Run::restore_or_initialize() {
  const ParameterLayout& layout = graph_->layout();
  params_.assign(layout.total(), 0.0f);
  opt_ = std::make_unique<Optimizer>(layout, c_.optimizer);
  if (c_.resume) resume_from_ = io::latest_checkpoint(c_.checkpoint_dir);
  if (!resume_from_) {
    layout.initialize(params_.data(), c_.seed);
    return;
  }
  const std::string& from = *resume_from_;
  const io::CheckpointMeta head = io::read_checkpoint_meta(from);
  TOWERS_REQUIRE(head.model == c_.model, "--resume: {} holds model '{}' but --model is '{}'", from,
                 head.model, c_.model);
  io::Checkpoint ck = io::load_checkpoint(from, layout, opt_->slot_names());
  const auto& old = ck.meta.config;
  TOWERS_REQUIRE(old.is_object(), "--resume: {} has no readable run configuration", from);
  // The example stream is a function of (seed, batch, towers, mode): resuming with others
  // would not continue the same run.
  auto same = [&](const char* key, const auto& now, const char* flag) {
    using T = std::decay_t<decltype(now)>;
    T was = now;
    try {
      was = old.value(key, now);
    } catch (const nlohmann::json::exception&) {
      TOWERS_BAD_INPUT("--resume: {} records '{}' as {}, which is not a valid {}", from, key,
                       old[key].dump(), flag);
    }
    TOWERS_REQUIRE(was == now, "--resume: {} was trained with {} {}, this run has {} {}", from,
                   flag, was, flag, now);
  };
  same("batch", c_.batch, "--batch");
  same("seed", c_.seed, "--seed");
  same("dataset", c_.dataset, "--dataset");
  same("augment", c_.augment, "--augment");
  same("towers", c_.towers, "--towers");
  same("mode", c_.mode, "--mode");
  // The wrappers' slots are in the checkpoint only when they were on.
  same("ema", c_.optimizer.ema, "--ema");
  same("lookahead", c_.optimizer.lookahead_k, "--lookahead");
  same("lookahead_alpha", c_.optimizer.lookahead_alpha, "--lookahead-alpha");
  same("label_smoothing", c_.label_smoothing, "--label-smoothing");
  same("sync_bn", c_.sync_bn, "--sync-bn");
  if (c_.dataset == "synthetic") same("synthetic_size", c_.synthetic_size, "--synthetic-size");
  std::copy(ck.params.data(), ck.params.data() + layout.total(), params_.begin());
  for (auto& [name, buf] : ck.slots)
    std::copy(buf.data(), buf.data() + layout.total(), opt_->slot(name));
  opt_->load_state(ck.meta.optimizer_state);
  start_step_ = ck.meta.step;
  start_examples_ = ck.meta.examples_seen;
}

// Only now, with every input checked and memory in hand, is anything written.
void Run::open() {
  const ParameterLayout& layout = graph_->layout();
  // A save killed before its rename (kill -9, a lost machine) leaves a full-size temporary
  // file that nothing would ever read.
  if (!c_.checkpoint_dir.empty())
    for (const std::string& stale : io::remove_stale_temporaries(c_.checkpoint_dir))
      say(fmt::format("removed {}, the unfinished write of a process that no longer exists", stale));
  // A resumed run appends to its metrics: the chief's from its checkpoint, the other workers'
  // wherever the chief resumes.
  metrics_ =
      std::make_unique<MetricsWriter>(c_.metrics_path, resume_from_.has_value() || continues_run_);
  config_json_ = to_json(c_);
  const bool cuda = ec_.device == DeviceKind::Cuda;
  metrics_->write({{"event", "config"}, {"config", config_json_}, {"parameters", layout.count()},
                   {"train_examples", n_train_}, {"test_examples", data_.test.size()},
                   {"start_step", start_step_}, {"total_steps", total_steps_},
                   {"threads_per_tower", threads_}, {"cores", cores_},
                   {"oversubscribed", !cuda && c_.towers * threads_ > cores_},
                   {"device", group_->tower(0).device().name()},
                   {"gpus", cuda ? ec_.gpus : 0},
                   {"towers_per_gpu", cuda ? ceil_div(c_.towers, ec_.gpus) : 0}});
  say(fmt::format(
      "towers: model {} ({} parameters), {} on {} ({} train / {} test), {} steps{}, "
      "{} x {} tower(s) of batch {} {}{}",
      c_.model, layout.count(), c_.optimizer.name, c_.dataset, n_train_, data_.test.size(),
      total_steps_,
      end_step_ < total_steps_
          ? fmt::format(" (this job stops at step {}: --stop-at-step)", end_step_)
          : std::string(),
      c_.mode, c_.towers, c_.batch, placement_,
      resume_from_ ? fmt::format(", resumed from {} at step {}", *resume_from_, start_step_)
      : c_.resume  ? fmt::format("; --resume: no checkpoint in '{}' yet, so from the seed",
                                 c_.checkpoint_dir)
                   : ""));
  sum_.start_step = start_step_;
}

EvalResult Run::evaluate_now() {
  if (!eval_tower_) {
    TowerPlacement p;
    p.kind = ec_.device;
    p.threads = cores_;
    p.tf32 = ec_.tf32;  // evaluate with the arithmetic the run trains with
    p.cudnn = ec_.cudnn;
    eval_tower_ = make_tower(*graph_, 256, p);
  }
  // host_params() also refreshes the optimizer's slots where a store keeps them elsewhere.
  const float* params = store_->host_params();
  // With --ema, evaluations read the averaged weights, as the TF tutorial's eval does.
  // (Before the first update the average holds nothing yet; host_params() has refreshed the
  // update count where a store keeps it elsewhere.)
  evaluated_weights_ = c_.optimizer.ema > 0.0 && opt_->updates() > 0 ? "ema" : "trained";
  eval_tower_->load_params(evaluated_weights_ == "ema" ? opt_->slot("ema") : params);
  return evaluate(*eval_tower_, data_.test, tf_.eval, c_.tta);
}

std::string Run::eval_note() const {
  std::vector<std::string> notes;
  if (evaluated_weights_ == "ema") notes.push_back("of the weights' moving average (--ema)");
  if (c_.tta == "flip") notes.push_back("with mirror images (--tta flip)");
  return notes.empty() ? std::string() : fmt::format(", {}", fmt::join(notes, ", "));
}

void Run::write_checkpoint(int64_t step) {
  // First: a store that keeps them elsewhere (GPUs, shards) refreshes the host parameters and
  // the optimizer's slots and state.
  const float* params = store_->host_params();
  io::CheckpointMeta meta{c_.model, step, start_examples_ + (step - start_step_) * per_update_,
                          epoch_at(step), config_json_, opt_->state(), {}};
  std::string path = io::save_checkpoint(c_.checkpoint_dir, meta, graph_->layout(), params,
                                         opt_->slots(), c_.keep_checkpoints);
  nlohmann::json event = {{"event", "checkpoint"}, {"step", step}, {"path", path}};
  // The shards save their ranges at the same version (those with a --checkpoint-dir), so a
  // restarted shard can restore its own.
  if (remote_) {
    unsaved_by_shards_ = path;  // until every shard has saved the step
    event["shards"] = remote_->save_shards(step);
    unsaved_by_shards_.clear();
  }
  metrics_->write(event);
  sum_.last_checkpoint = path;
  saved_step_ = step;
}

bool Run::on_update(const UpdateRecord& r) {
  const double loss = r.loss;
  // The step driver never applies an update whose loss (or, when it checks it, gradient) is not
  // finite: it records it as skipped. Whether the run goes on is --on-divergence.
  if (r.skipped && c_.on_divergence == "stop")
    TOWERS_BAD_INPUT("training diverged at step {} (loss {}, gradient norm {}); the update was "
                     "not applied and the last checkpoint is good: lower --lr (now {}), or add "
                     "--clip-grad-norm or --on-divergence skip-step",
                     r.version, loss, r.grad_norm < 0 ? std::string("not computed")
                                                      : fmt::format("{}", r.grad_norm),
                     c_.schedule.lr);
  if (r.skipped) {
    ++sum_.skipped_steps;
    if (sum_.skipped_steps == 1 || sum_.skipped_steps % 100 == 0)
      say(fmt::format("step {}: loss {} or gradient norm {} is not finite; update skipped ({} so "
                      "far)", r.version, loss, r.grad_norm, sum_.skipped_steps));
  } else {
    sum_.final_loss = loss;
  }
  nlohmann::json step = {{"event", "step"}, {"step", r.version}, {"epoch", epoch_at(r.version)},
                         {"loss", std::isfinite(loss) ? nlohmann::json(loss) : nlohmann::json()},
                         {"train_accuracy", static_cast<double>(r.correct) / r.examples},
                         {"lr", r.lr}, {"tower", r.tower >= 0 ? nlohmann::json(r.tower) : nlohmann::json()},
                         {"contributors", r.contributors}, {"staleness", r.staleness},
                         {"wall_seconds", seconds_since(t_start_)}};
  if (r.grad_norm >= 0.0 || std::isnan(r.grad_norm))
    step["grad_norm"] = std::isfinite(r.grad_norm) ? nlohmann::json(r.grad_norm) : nlohmann::json();
  if (r.skipped) step["skipped"] = true;
  metrics_->write(step);
  if (!c_.quiet) {
    const double elapsed = seconds_since(t_train_) - side_seconds_;
    const double rate = (r.version - start_step_) / std::max(elapsed, 1e-9);
    progress_.update(r.version, end_step_, epoch_at(r.version), loss, rate * per_update_,
                     (end_step_ - r.version) / std::max(rate, 1e-9), c_.log_every);
  }
  if (r.version >= end_step_) return false;  // the end has its own evaluation and checkpoint
  auto crossed = [&](double every, int64_t step) {
    return every > 0.0 &&
           std::floor(epoch_at(step) / every) > std::floor(epoch_at(step - 1) / every);
  };
  eval_due_ = eval_due_ || crossed(c_.eval_every_epochs, r.version);
  ckpt_due_ = ckpt_due_ || (!c_.checkpoint_dir.empty() && crossed(c_.checkpoint_every_epochs, r.version));
  return eval_due_ || ckpt_due_;
}

void Run::side_work(int64_t step) {
  const auto t_side = Clock::now();
  if (std::exchange(eval_due_, false)) {
    EvalResult ev = evaluate_now();
    const double trained = seconds_since(t_train_) - side_seconds_ - seconds_since(t_side);
    metrics_->write({{"event", "eval"},
                     {"step", step},
                     {"epoch", epoch_at(step)},
                     {"test_accuracy", ev.accuracy},
                     {"test_loss", ev.loss},
                     {"weights", evaluated_weights_},
                     {"tta", c_.tta},
                     {"wall_seconds", seconds_since(t_start_)},
                     {"train_seconds", trained}});
    say(fmt::format("epoch {:.2f}: test accuracy {:.2f}% (loss {:.4f}){}", epoch_at(step),
                    100.0 * ev.accuracy, ev.loss, eval_note()));
    if (c_.target_accuracy > 0.0 && ev.accuracy >= c_.target_accuracy && !target_reached_.load()) {
      sum_.time_to_target = trained;
      sum_.wall_to_target = seconds_since(t_start_);
      metrics_->write({{"event", "target"}, {"step", step}, {"epoch", epoch_at(step)},
                       {"test_accuracy", ev.accuracy}, {"train_seconds", sum_.time_to_target},
                       {"wall_seconds", sum_.wall_to_target}});
      say(fmt::format("test accuracy {:.2f}% reaches the target {:.2f}% after {} of training",
                      100.0 * ev.accuracy, 100.0 * c_.target_accuracy,
                      format_duration(sum_.time_to_target)));
      target_reached_.store(true);
    }
  }
  if (std::exchange(ckpt_due_, false)) write_checkpoint(step);
  side_seconds_ += seconds_since(t_side);  // images/s measures training only
}

void Run::loop() {
  RunHooks hooks;
  hooks.lr_at = [&](int64_t step) { return lr_at(step); };
  hooks.stop_requested = [&] { return g_stop_requested.load() || target_reached_.load(); };
  hooks.on_update = [&](const UpdateRecord& r) { return on_update(r); };
  hooks.side_work = [&](int64_t step) { side_work(step); };
  t_train_ = Clock::now();
  // The chief's evaluations and checkpoints inside the run take a rollback as its steps do.
  struct Reads {
    remote::RemoteParameterStore* store;
    explicit Reads(remote::RemoteParameterStore* s) : store(s) {
      if (store) store->read_as_worker(true);
    }
    ~Reads() {
      if (store) store->read_as_worker(false);
    }
  };
  try {
    Reads reads(remote_);
    for (int64_t from = start_step_;;) {
      try {
        // (The batch a free-running tower starts at; lockstep runs take it from the version.)
        group_->run(data_.train, tf_.train, c_.seed, from, end_step_,
                    (start_examples_ + (from - start_step_) * per_update_) / c_.batch, hooks);
        break;
      } catch (const remote::RollbackError& e) {
        // A sync run whose restarted shard went back to its checkpoint: every shard has gone
        // back to that round (the store asked them), and the run goes on from there; the
        // steps after it are taken again, with the same batches.
        if (!remote_) throw;
        ++sum_.rollbacks;
        TOWERS_REQUIRE(sum_.rollbacks <= kMaxRollbacks,
                       "{}; that is {} rollbacks in one run: stopping", e.what(), sum_.rollbacks);
        from = e.rollback.version;
        saved_step_ = from;  // (every shard restored its checkpoint of that round)
        unsaved_by_shards_.clear();  // (a checkpoint that a rollback cut short did not fail)
        eval_due_ = ckpt_due_ = false;
        target_reached_.store(false);  // (if it was, the steps that reached it are taken again)
        metrics_->write({{"event", "rollback"}, {"step", from},
                         {"generation", e.rollback.generation}, {"reason", e.what()},
                         {"wall_seconds", seconds_since(t_start_)}});
        say(fmt::format("{}; the run goes on from step {}", e.what(), from));
      }
    }
  } catch (const Error& e) {
    // A remote run that cannot go on (sync without a lost worker, a shard gone): the chief
    // saves what the shards still hold, the last complete round, before it reports the error.
    // In plain sync, a round the run went back to and stopped at is saved already: its file
    // holds the state every shard restored. (A round that a worker lost in the middle of its
    // push left applied in part on a shard is taken back there, decision 79.) (With backup
    // workers, rounds go on while the chief reads, so its file of a round need not be what
    // each shard restored.) A checkpoint that the shards failed to write (a full disk) is the
    // error itself: it is not tried again, and the chief's own file of it is named.
    if (!remote_ || !chief_ || c_.checkpoint_dir.empty()) throw;
    if (!unsaved_by_shards_.empty())
      TOWERS_BAD_INPUT("{}; the chief's own checkpoint of that step is {}", e.what(),
                       unsaved_by_shards_);
    std::string saved;
    try {
      const int64_t step = remote_->version();
      if (step > start_step_) {
        std::optional<std::string> path;
        const bool plain =
            c_.mode == "sync" && (c_.replicas_to_aggregate == 0 ||
                                  c_.replicas_to_aggregate == cluster_->cluster.workers());
        if (step == saved_step_ && plain) path = io::checkpoint_of(c_.checkpoint_dir, step);
        if (!path) {
          // A worker lost in the middle of its push may have completed the round on some
          // shards: they go back to this worker's last round (decision 79).
          if (plain && cluster_->cluster.workers() > 1) remote_->take_back(step);
          write_checkpoint(step);
          path = sum_.last_checkpoint;
        }
        saved = fmt::format("; the last complete round, step {}, is saved in {}", step, *path);
      } else {
        saved = fmt::format("; no round completed since the run's start at step {}", step);
      }
    } catch (const Error& why) {
      saved = fmt::format("; the shards could not be read for a checkpoint ({})", why.what());
    }
    TOWERS_BAD_INPUT("{}{}", e.what(), saved);
  }
}

TrainSummary Run::summary() {
  const int64_t step = group_->version();
  sum_.interrupted = g_stop_requested.load() && step < end_step_;
  const double train_seconds = seconds_since(t_train_) - side_seconds_;
  if (!c_.checkpoint_dir.empty() && step > start_step_) write_checkpoint(step);
  if (sum_.interrupted)
    say(fmt::format("interrupted at step {}{}", step,
                    sum_.last_checkpoint.empty() ? "" : "; saved " + sum_.last_checkpoint));

  // An interrupted run stops promptly: its checkpoint is written, the test pass is skipped.
  // Workers of a remote group other than the chief leave the test pass to it.
  EvalResult ev;
  const bool evaluated = !sum_.interrupted && chief_;
  if (evaluated) ev = evaluate_now();
  if (remote_) {
    // The chief reports who was lost once every other worker has finished or been lost; its
    // own "done" then lets the shards exit.
    if (chief_) sum_.lost_workers = remote_->lost_workers();
    dropped_by_shards_ = remote_->dropped();
    remote_->finish();
  }
  if (c_.target_accuracy > 0.0 && !target_reached_.load() && !sum_.interrupted &&
      ev.accuracy >= c_.target_accuracy) {
    sum_.time_to_target = train_seconds;
    sum_.wall_to_target = seconds_since(t_start_);
  }
  sum_.steps = step;
  sum_.epochs = epoch_at(step);
  sum_.test_accuracy = ev.accuracy;
  sum_.test_loss = ev.loss;
  const int64_t trained = (step - start_step_) * per_update_;
  sum_.train_images_per_sec = trained / std::max(train_seconds, 1e-9);
  sum_.wall_seconds = seconds_since(t_start_);
  sum_.tower_stats = group_->stats().to_json(train_seconds);
  auto or_null = [](bool have, double v) { return have ? nlohmann::json(v) : nlohmann::json(); };
  nlohmann::json line = {
      {"event", "summary"},
      {"model", c_.model},
      {"dataset", c_.dataset},
      {"mode", c_.mode},
      {"towers", c_.towers},
      {"threads_per_tower", threads_},
      {"test_accuracy", or_null(!sum_.interrupted, sum_.test_accuracy)},
      {"test_loss", or_null(!sum_.interrupted, sum_.test_loss)},
      // (what the test pass read; null where it did not run)
      {"weights", evaluated ? nlohmann::json(evaluated_weights_) : nlohmann::json()},
      {"tta", evaluated ? nlohmann::json(c_.tta) : nlohmann::json()},
      {"train_images_per_sec", sum_.train_images_per_sec},
      {"wall_seconds", sum_.wall_seconds},
      {"train_seconds", train_seconds},
      {"steps", sum_.steps},
      {"start_step", start_step_},
      {"epochs", sum_.epochs},
      {"final_loss", sum_.final_loss},
      {"skipped_steps", sum_.skipped_steps},
      {"interrupted", sum_.interrupted},
      {"checkpoint", sum_.last_checkpoint},
      {"target_accuracy", c_.target_accuracy},
      {"time_to_target", or_null(sum_.time_to_target >= 0, sum_.time_to_target)},
      {"wall_to_target", or_null(sum_.wall_to_target >= 0, sum_.wall_to_target)}};
  line.update(sum_.tower_stats);
  if (cluster_) {
    line["dropped_by_shards"] = dropped_by_shards_;
    line["remote"] = remote_->timing();
    line["worker"] = rank_;
    line["workers"] = cluster_->cluster.workers();
    line["lost_workers"] = sum_.lost_workers;
    line["rollbacks"] = sum_.rollbacks;
    if (!chief_) line["test_accuracy"] = line["test_loss"] = nullptr;
  }
  if (placed_) line["pipeline"] = sum_.pipeline = pipeline_summary();
  // Which cuDNN algorithms the run's convolutions used (tower 0's plans; every tower of a run
  // plans the same shapes with the same rules, and with --cudnn-benchmark the towers of one GPU
  // share its timed choices, while another GPU's own timings may choose otherwise).
  // A placed tower's are its GPU parts', each noted with its device.
  if (ec_.device == DeviceKind::Cuda || placed_on_gpu())
    line["cudnn_plans"] = group_->tower(0).plan_notes();
  metrics_->write(line);
  if (!sum_.interrupted && chief_)
    say(fmt::format(
        "done: {} steps ({:.2f} epochs) in {}, {:.0f} images/s; test accuracy {:.2f}% "
        "on {} examples{}",
        sum_.steps, sum_.epochs, format_duration(sum_.wall_seconds), sum_.train_images_per_sec,
        100.0 * sum_.test_accuracy, ev.examples, eval_note()));
  if (!sum_.interrupted && !chief_)
    say(fmt::format("done: worker {} at step {} in {}, {:.0f} images/s of this worker's towers",
                    rank_, sum_.steps, format_duration(sum_.wall_seconds),
                    sum_.train_images_per_sec * c_.towers / ec_.total_towers()));
  if (!sum_.lost_workers.empty())
    say(fmt::format("the shards lost worker(s) {} during the run (no call within "
                    "--heartbeat-timeout {} s); the run went on without them",
                    fmt::join(sum_.lost_workers, ", "), c_.heartbeat_timeout));
  if (c_.towers > 1 && !c_.quiet) {
    std::string towers_line =
        fmt::format("towers: max staleness {}, dropped gradients {};",
                    group_->stats().max_staleness(), group_->stats().dropped_total());
    for (const auto& t : sum_.tower_stats["towers"])
      towers_line += fmt::format(" [{}: {} steps, {:.0f} ms p50, {:.0f} ms p99]",
                                 t["tower"].get<int>(), t["steps"].get<int64_t>(),
                                 t["step_ms_p50"].get<double>(), t["step_ms_p99"].get<double>());
    say(towers_line);
  }
  if (placed_ && !c_.quiet) {
    // Per part over every tower: its busy and idle time per step (idle: the pipeline bubble).
    std::string pipe = fmt::format("pipeline, {} micro-batch{}:", c_.micro_batches,
                                   c_.micro_batches > 1 ? "es" : "");
    const auto& towers = sum_.pipeline["towers"];
    for (size_t p = 0; p < placed_->parts.size(); ++p) {
      double busy = 0.0, idle = 0.0, step = 0.0;
      int64_t steps = 0;
      for (const auto& t : towers) {
        busy += t["parts"][p]["busy_seconds"].get<double>();
        idle += t["parts"][p]["idle_seconds"].get<double>();
        step += t["step_seconds"].get<double>();
        steps += t["steps"].get<int64_t>();
      }
      pipe += fmt::format(" [part {} {} on {}: busy {:.0f} ms, idle {:.0f} ms per step ({:.0f}%)]",
                          p, placed_->parts[p].layer_names(*graph_),
                          placed_->parts[p].device_name(),
                          1e3 * busy / std::max<int64_t>(steps, 1),
                          1e3 * idle / std::max<int64_t>(steps, 1),
                          100.0 * idle / std::max(step, 1e-12));
    }
    say(pipe);
  }
  return sum_;
}

nlohmann::json Run::pipeline_summary() {
  nlohmann::json towers = nlohmann::json::array();
  for (int i = 0; i < c_.towers; ++i) {
    nlohmann::json t = static_cast<PlacedTower&>(group_->tower(i)).pipeline_stats().to_json();
    t["tower"] = i;
    towers.push_back(std::move(t));
  }
  return {{"placement", c_.placement}, {"micro_batches", c_.micro_batches}, {"towers", towers}};
}

}  // namespace

TrainSummary train(const TrainConfig& c) {
  Run run(c);   // setup: every input checked, memory in hand; nothing written yet
  run.open();   // the metrics file and the config line
  run.loop();   // the towers step; evaluations and checkpoints as they fall due
  return run.summary();
}

namespace {
void check_eval_device(const std::string& device) {
  TOWERS_REQUIRE(device == "cpu" || device == "cuda",
                 "--device: unknown device '{}' (known: cpu, cuda)", device);
  if (device == "cuda") {
    const GpuList found = list_gpus();
    TOWERS_REQUIRE(!found.gpus.empty(), "--device cuda: no GPU available: {}", found.why_none);
  }
}
}  // namespace

EvalSummary evaluate_params(const std::string& model, int64_t step, const nlohmann::json& cfg,
                            const float* params, int64_t count, const EvalOptions& o,
                            const std::string& origin) {
  check_eval_device(o.device);
  auto graph = build_model(model);
  TOWERS_REQUIRE(count == graph->layout().total(),
                 "{}: {} parameters, but model {} has {}", origin, count, model,
                 graph->layout().total());
  // The run's configuration, as far as eval needs it; a field of the wrong type is the
  // source's fault.
  auto recorded = [&](const char* key, auto fallback) {
    if (!cfg.is_object() || !cfg.contains(key)) return fallback;
    try {
      return cfg.at(key).get<decltype(fallback)>();
    } catch (const nlohmann::json::exception&) {
      TOWERS_BAD_INPUT("{}: its config records '{}' as {}, which is not valid", origin, key,
                       cfg.at(key).dump());
    }
  };
  const std::string tta = !o.tta.empty() ? o.tta : recorded("tta", std::string("none"));
  check_tta(tta, o.tta.empty() ? origin + ": its config's 'tta'" : std::string("--tta"));
  const std::string ds =
      !o.dataset.empty() ? o.dataset : recorded("dataset", std::string("fashion-mnist"));
  const std::string dir = !o.data_dir.empty() || !o.dataset.empty()
                              ? o.data_dir
                              : recorded("data_dir", std::string());
  data::DataSplit data = data::load_dataset(dataset_request(
      ds, dir, graph->input_shape(), recorded("synthetic_size", int64_t{10000}),
      recorded("seed", uint64_t{1})));
  check_classes(*graph, data, model, ds);
  data::Transforms tf = data::transforms_for("none", ds, graph->input_shape(), data.test, model);
  TowerPlacement p;
  p.kind = o.device == "cuda" ? DeviceKind::Cuda : DeviceKind::Cpu;
  p.threads = o.threads > 0 ? o.threads : hardware_threads();
  std::unique_ptr<Tower> tower = make_tower(*graph, 256, p);
  tower->load_params(params);
  EvalResult ev = evaluate(*tower, data.test, tf.eval, tta);
  EvalSummary s;
  s.model = model;
  s.step = step;
  s.examples = ev.examples;
  s.test_accuracy = ev.accuracy;
  s.test_loss = ev.loss;
  s.tta = tta;
  return s;
}

EvalSummary evaluate_checkpoint(const std::string& path, const EvalOptions& o) {
  check_eval_device(o.device);
  TOWERS_REQUIRE(std::filesystem::exists(path), "--checkpoint: no such file '{}'", path);
  io::CheckpointMeta meta = io::read_checkpoint_meta(path);
  auto graph = build_model(meta.model);
  // A run with --ema (whose checkpoints hold the slot "ema") is evaluated with its averaged
  // weights, as it evaluated itself, once they have averaged an update; a model pulled from
  // shards holds the trained weights only.
  const bool ema = meta.step > 0 &&
                   std::find(meta.slots.begin(), meta.slots.end(), "ema") != meta.slots.end();
  io::Checkpoint ck = io::load_checkpoint(path, graph->layout(),
                                          ema ? std::vector<std::string>{"ema"}
                                              : std::vector<std::string>{});
  EvalSummary s = evaluate_params(meta.model, meta.step, ck.meta.config,
                                  ema ? ck.slots.front().second.data() : ck.params.data(),
                                  graph->layout().total(), o,
                                  fmt::format("checkpoint '{}'", path));
  s.ema = ema;
  return s;
}

}  // namespace towers
