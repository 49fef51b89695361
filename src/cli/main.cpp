// towers — the command line: train a model, evaluate a checkpoint.
//   towers train --model fashion --dataset fashion-mnist --epochs 3
//   towers eval --checkpoint runs/ckpt-000001407.safetensors
//   towers scale --model fashion --towers 1,2 --modes sync,async --steps 200
//   towers devices
//   towers launch --ps 2 --workers 2 -- train --model fashion --mode sync --steps 50
//   towers ps --cluster cluster.json --task ps:0 --token-file token
// Every bad flag or file ends in one line naming it, and exit code 2 (flags) or 1 (runtime).
#include <algorithm>
#include <cerrno>
#include <cfloat>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>

#include <unistd.h>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/check.h"
#include "core/device.h"
#include "core/gpu.h"
#include "models/models.h"
#include "optim/optimizer.h"
#include "towers/modes/mode.h"
#include "optim/schedule.h"
#include "towers/scale.h"
#include "towers/remote/cluster.h"
#include "towers/remote/launch.h"
#include "towers/remote/reader.h"
#include "towers/remote/shard_server.h"
#include "towers/trainer.h"

namespace {

// The values of a float flag: one beyond a float's range would reach the flag's own checks as
// inf, and the error would then quote "inf" instead of what was typed.
const CLI::Validator kFloatRange(
    [](const std::string& v) {
      // (strtof rounds as the flag's parse does: FLT_MAX's shortest text is in range; a typed
      // "inf" is left to the flag's own checks, and text that is no number to the parser)
      errno = 0;
      char* end = nullptr;
      const float f = std::strtof(v.c_str(), &end);
      if (end == v.c_str() || *end != '\0' || !std::isinf(f) || errno != ERANGE)
        return std::string();
      return fmt::format("{} is beyond a float's range (magnitudes up to {:.3g})", v, FLT_MAX);
    },
    "");

// `towers devices`: what this process can train on.
int list_devices(bool as_json) {
  const towers::GpuList g = towers::list_gpus(/*with_free_memory=*/true);
  const int cores = towers::hardware_threads();
  auto version = [](int v) { return fmt::format("{}.{}", v / 1000, (v % 1000) / 10); };
  auto cudnn_text = [](int v) {
    return fmt::format("{}.{}.{}", v / 10000, v / 100 % 100, v % 100);
  };
  if (as_json) {
    nlohmann::json gpus = nlohmann::json::array();
    for (const auto& d : g.gpus)
      gpus.push_back({{"ordinal", d.ordinal}, {"name", d.name}, {"total_bytes", d.total_bytes},
                      {"free_bytes", d.free_bytes},
                      {"compute_capability", fmt::format("{}.{}", d.cc_major, d.cc_minor)},
                      {"multiprocessors", d.multiprocessors}});
    nlohmann::json j = {{"cpu_cores", cores}, {"gpus", gpus}};
    if (g.gpus.empty()) j["no_gpu_reason"] = g.why_none;
    if (g.driver_version) j["cuda_driver"] = version(g.driver_version);
    if (g.runtime_version) j["cuda_runtime"] = version(g.runtime_version);
    if (g.cudnn_version) j["cudnn"] = cudnn_text(g.cudnn_version);
    fmt::print("{}\n", j.dump());
    return 0;
  }
  fmt::print("cpu      {} cores (--device cpu)\n", cores);
  if (g.gpus.empty()) {
    fmt::print("cuda     no GPU: {}\n", g.why_none);
    return 0;
  }
  fmt::print("cuda     driver {}, runtime {}, cuDNN {} (--device cuda)\n",
             version(g.driver_version), version(g.runtime_version), cudnn_text(g.cudnn_version));
  for (const auto& d : g.gpus)
    fmt::print("cuda:{}   {}, {:.1f} GiB ({:.1f} GiB free), compute capability {}.{}, {} SMs\n",
               d.ordinal, d.name, d.total_bytes / 1073741824.0, d.free_bytes / 1073741824.0,
               d.cc_major, d.cc_minor, d.multiprocessors);
  return 0;
}

void on_interrupt(int) {
  // A second Ctrl-C falls back to the default action and ends the process at once.
  towers::g_stop_requested.store(true);
  std::signal(SIGINT, SIG_DFL);
}

// Flags of a training run; `towers scale` takes them too, less the ones it sweeps or forbids.
void add_train_flags(CLI::App& app, towers::TrainConfig& c, bool for_scale) {
  std::string model_help = "model: a built-in one (";
  for (const std::string& m : towers::model_names())
    model_help += (model_help.back() == '(' ? "" : ", ") + m;
  model_help += "), or a model file: a path that ends in .json or contains '/' (see the README)";
  app.add_option("--model", c.model, model_help)->capture_default_str();
  app.add_option("--dataset", c.dataset, "dataset: fashion-mnist, cifar10, synthetic")
      ->capture_default_str();
  app.add_option("--data", c.data_dir,
                 "dataset folder (default for fashion-mnist: /usr/share/datasets/fashion-mnist)");
  app.add_option("--augment", c.augment,
                 "training transforms: tutorial (the TF tutorial's crop, flip, brightness and "
                 "contrast), flip, airbench (flip and translate by up to 2 pixels), none; auto: "
                 "tutorial for cifar10, flip for fashion-mnist")
      ->capture_default_str();
  app.add_option("--synthetic-size", c.synthetic_size, "train examples of --dataset synthetic")
      ->capture_default_str();
  app.add_option("--epochs", c.epochs, "length of the run in epochs");
  app.add_option("--steps", c.steps, "length of the run in steps (applied updates)");
  app.add_option("--stop-at-step", c.stop_at_step,
                 "end this job after that step, with a checkpoint; the schedule still spans the "
                 "whole run (for runs split over several jobs; continue with --resume)");
  app.add_option("--batch", c.batch, "examples per tower per step")->capture_default_str();
  if (!for_scale)
    app.add_option("--towers", c.towers, "number of towers (model replicas)")->capture_default_str();
  app.add_option("--threads-per-tower,--threads", c.threads_per_tower,
                 "compute threads of each tower (0: cores / towers); on GPUs, the threads of "
                 "each tower's host-side work")->capture_default_str();
  app.add_option("--placement", c.placement,
                 "model parallelism: each tower's layers on devices, parts LAYERS@DEVICE joined "
                 "by ';', e.g. 'conv1..pool2@cpu:0;local3..softmax_linear@cpu:1' (cpu:NxT: T "
                 "threads; otherwise the tower's threads are shared out); overrides the "
                 "\"placement\" of a model file, and none trains whole towers whatever the file "
                 "says");
  app.add_option("--micro-batches", c.micro_batches,
                 "with a placement (--placement or the model file's): micro-batches per step, "
                 "flowing through the parts at once (GPipe); the update equals one of the whole "
                 "batch bit for bit")
      ->capture_default_str();
  app.add_option("--device", c.device, "cpu or cuda")->capture_default_str();
  app.add_option("--gpus", c.gpus, "cuda: GPUs to use (0: all); tower i runs on GPU i % gpus")
      ->capture_default_str();
  app.add_option("--reduce", c.reduce,
                 "sync on GPUs: average gradients on the host (host) or by NCCL all-reduce (nccl)")
      ->capture_default_str();
  app.add_option("--params", c.params,
                 "where the parameters live: host (one copy in host memory, the optimizer on the "
                 "host) or mirrored (cuda: a copy and the optimizer on each GPU)")
      ->capture_default_str();
  app.add_option("--sync-every", c.sync_every,
                 "--params mirrored with --mode async or ssp: each tower applies its own steps "
                 "to its GPU's copy and folds them into the host copy every K steps (local SGD; "
                 "default 1)");
  app.add_option("--input", c.input,
                 "where training batches are made: host (augmented by the CPU, copied in) or "
                 "device (cuda: the training set on each GPU, augmented there from the host's "
                 "draws)")
      ->capture_default_str();
  app.add_flag("--tf32", c.tf32, "cuda: TF32 tensor-core GEMMs (faster, about 1e-3 relative error)");
  app.add_flag("!--no-cuda-graphs", c.cuda_graphs,
               "cuda: launch each kernel of a step instead of replaying a captured CUDA graph");
  app.add_flag("--cudnn-nondeterministic", c.cudnn.nondeterministic,
               "cuda: let cuDNN run its fastest-ranked convolution algorithms even where they are "
               "not deterministic (backward passes that add with atomics, as PyTorch does by "
               "default): faster, but two runs with one seed no longer give the same bits");
  app.add_flag("--cudnn-benchmark", c.cudnn.benchmark,
               "cuda: time cuDNN's convolution algorithms once per shape and GPU and run the "
               "fastest that the rules allow (deterministic unless --cudnn-nondeterministic, the "
               "precision asked for, at most 1 GiB of workspace), as "
               "torch.backends.cudnn.benchmark does, instead of cuDNN's heuristic ranking: the "
               "choice, and with it the rounding, can differ from run to run");
  app.add_flag("--cudnn-gemm-only", c.cudnn.gemm_only,
               "cuda: keep cuDNN to its GEMM-family convolution algorithms (no FFT or Winograd, "
               "which cuDNN often ranks first and whose FP32 results lie about 1e-3 from a "
               "GEMM's): slower where those would be faster; in FP32 its results round like "
               "the CPU tower's GEMMs");
  app.add_flag("--backward-branches", c.backward_branches,
               "cuda: compute each layer's weight and bias gradients on a second stream, beside "
               "its input gradient (parallel branches of the step's graph; more device scratch)");
  std::string mode_help = "mode:";
  for (const towers::ModeInfo& m : towers::modes())
    mode_help += fmt::format("\n  {:<10}{}", m.name, m.summary);
  if (!for_scale) app.add_option("--mode", c.mode, mode_help)->capture_default_str();
  app.add_option("--replicas-to-aggregate", c.replicas_to_aggregate,
                 "sync: apply once the first K towers have reported; later gradients of that "
                 "step are dropped (backup towers; 0: all)");
  if (!for_scale)
    app.add_option("--staleness", c.staleness, "ssp: the most steps a tower may run ahead of the slowest");
  app.add_flag("--use-locking", c.use_locking, "async/ssp: serialise the apply per variable");
  app.add_flag("--staleness-aware-lr", c.staleness_aware_lr, "divide the lr by max(1, staleness)");
  app.add_option("--on-divergence", c.on_divergence,
                 "stop (the run ends with an error at the first non-finite loss) or skip-step "
                 "(an update whose loss or gradient is not finite is not applied; the run goes on)")
      ->capture_default_str();
  app.add_option("--clip-grad-norm", c.clip_grad_norm,
                 "scale each update's gradient to at most this global L2 norm (0: off)")
      ->capture_default_str();
  app.add_option("--lr-scaling", c.lr_scaling,
                 "none, or linear: lr x the towers whose gradients make one update")->capture_default_str();
  app.add_option(
      "--slow-tower", c.slow_towers,
      "TOWER:MS: tower TOWER sleeps MS milliseconds per step (a straggler, to study them); "
      "TOWER:late: it holds each gradient until the others can go no further without it "
      "(sync with --replicas-to-aggregate below --towers: its version is applied without it; "
      "ssp: the others wait at the bound)");
  app.add_option("--seed", c.seed, "seed of initialisation, example order and augmentation")
      // (strtoull would take a negative seed, wrapped around to a huge one)
      ->check(CLI::Validator(
          [](const std::string& v) {
            return v.find('-') != std::string::npos ? "a seed is a whole number >= 0, got " + v
                                                    : std::string();
          },
          ""))
      ->capture_default_str();
  std::string optimizer_help = "optimizer:";
  for (const towers::OptimizerDef& d : towers::optimizers())
    optimizer_help += fmt::format("\n  {:<10}{}", d.name, d.summary);
  app.add_option("--optimizer", c.optimizer.name, optimizer_help)
      ->capture_default_str();
  app.add_option("--lr", c.schedule.lr, "base learning rate")
      ->check(kFloatRange)
      ->capture_default_str();
  app.add_option("--lr-schedule", c.schedule.kind, "constant, exponential, cosine")
      ->capture_default_str();
  app.add_option("--decay-epochs", c.schedule.decay_epochs, "exponential: epochs per decay")
      ->capture_default_str();
  app.add_option("--decay-factor", c.schedule.decay_factor, "exponential: factor per decay")
      ->check(kFloatRange)
      ->capture_default_str();
  app.add_option("--warmup-epochs", c.schedule.warmup_epochs, "linear warmup")->capture_default_str();
  app.add_option("--momentum", c.optimizer.momentum,
                 "momentum and rmsprop (default 0.9 for momentum, 0 for rmsprop)")
      ->check(kFloatRange);
  app.add_flag("--nesterov", c.optimizer.nesterov, "Nesterov momentum");
  app.add_option("--label-smoothing", c.label_smoothing,
                 "train against (1 - E) x the one-hot label + E / classes (0: off; evaluations "
                 "report the plain cross-entropy)")
      ->check(kFloatRange)
      ->capture_default_str();
  app.add_flag("--sync-bn", c.sync_bn,
               "BatchNorm normalizes each training step over the global batch of the sync towers "
               "(default: each tower over its own batch, as TF's multi-GPU towers); sync towers "
               "of one process (GPU towers then run their steps without CUDA graphs)");
  app.add_option("--conv", c.conv,
                 "how convolutions are computed: auto (CPU: Winograd, F(2x2,5x5) or F(4x4,3x3), "
                 "for 5x5 and 3x3 stride-1 SAME layers of 16+ channels, else im2col; GPU: cuDNN, "
                 "with deterministic algorithms unless --cudnn-nondeterministic, ranked by "
                 "cuDNN's heuristics unless --cudnn-benchmark, wherever its symmetric padding "
                 "gives the layer's window, else im2col), im2col (CPU: im2col + GEMM; GPU: "
                 "im2col + cuBLAS), or winograd (CPU: every 3x3 and 5x5 stride-1 SAME layer; "
                 "GPU: as auto); overrides a model file's \"algorithm\"")
      ->capture_default_str();
  app.add_option("--tta", c.tta,
                 "test-time augmentation of evaluations: none, or flip (score each test image by "
                 "the mean of its and its mirror image's logits)")->capture_default_str();
  app.add_option("--ema", c.optimizer.ema,
                 "keep an exponential moving average of the weights with this decay (TF's "
                 "ExponentialMovingAverage, e.g. 0.9999; warm-up min(decay, (1+t)/(10+t))); "
                 "evaluations and checkpoints' evaluations use it (0: off)")
      ->capture_default_str();
  app.add_option("--lookahead", c.optimizer.lookahead_k,
                 "Lookahead: every K updates the slow weights move --lookahead-alpha of the way "
                 "to the fast ones, which restart there (0: off)")->capture_default_str();
  app.add_option("--lookahead-alpha", c.optimizer.lookahead_alpha, "Lookahead's step")
      ->check(kFloatRange)
      ->capture_default_str();
  if (!for_scale) {
    app.add_option("--metrics", c.metrics_path, "JSON-lines record of the run");
    app.add_option("--checkpoint-dir", c.checkpoint_dir, "write checkpoints here");
    app.add_option("--checkpoint-every", c.checkpoint_every_epochs,
                   "epochs between checkpoints (0: only at the end)")->capture_default_str();
    app.add_option("--keep-checkpoints", c.keep_checkpoints, "checkpoints kept")->capture_default_str();
    app.add_flag("--resume", c.resume, "continue from the latest checkpoint in --checkpoint-dir");
  }
  app.add_option("--target-accuracy", c.target_accuracy,
                 "stop at the first evaluation with at least this test accuracy (a fraction)");
  app.add_option("--eval-every", c.eval_every_epochs, "epochs between test evaluations (0: end only)")
      ->capture_default_str();
  app.add_option("--log-every", c.log_every,
                 "steps between plain progress lines, where the output is not a terminal (the "
                 "metrics file records every step)")
      ->capture_default_str();
  app.add_flag("--quiet", c.quiet, "no progress output");
  if (for_scale) return;
  app.add_option("--cluster", c.cluster,
                 "a remote tower group: the cluster file (TF_CONFIG's layout: {\"cluster\": "
                 "{\"chief\": [..], \"worker\": [..], \"ps\": [..]}, \"task\": {..}}); the "
                 "TF_CONFIG environment variable works too. The parameters live on the ps shards");
  app.add_option("--task", c.task, "with --cluster: this process's task, worker:I or chief");
  app.add_option("--token-file", c.token_file,
                 "with --cluster: the run's token, on the first line (default: TOWERS_TOKEN)");
  app.add_option("--tls-cert", c.tls_cert, "with --cluster: this process's certificate (PEM)");
  app.add_option("--tls-key", c.tls_key, "with --cluster: its private key (PEM)");
  app.add_option("--tls-ca", c.tls_ca, "with --cluster: the CA that signed the shards' certificates");
  app.add_option("--rpc-timeout", c.rpc_timeout,
                 "with --cluster: seconds any call to a shard may take, barrier waits included")
      ->capture_default_str();
  app.add_option("--heartbeat-timeout", c.heartbeat_timeout,
                 "with --cluster: seconds without a call after which the shards count a worker "
                 "lost")->capture_default_str();
  app.add_option("--rpc-piece-kib", c.rpc_piece_kib,
                 "with --cluster: pushes and pulls travel in pieces of this many KiB, so a shard "
                 "copies and applies one piece while the next is on the wire (the chief's value "
                 "is the run's)")->capture_default_str();
  app.add_option("--rpc-stripes", c.rpc_stripes,
                 "with --cluster: a push to a shard, and a pull from it, travel on this many TCP "
                 "connections at once, each carrying a run of its pieces (one gRPC stream is "
                 "held well below what a connection carries by the threads that drive it)")
      ->capture_default_str();
  app.add_option("--rpc-sessions", c.rpc_sessions,
                 "with --cluster: pushes and pulls go on streams to each shard (one a stripe) "
                 "that stay open from call to call, rather than on a call each (true or false)")
      ->capture_default_str();
}

// `towers launch ... -- <training flags>`: the flags after -- go to every worker.
int launch_main(int argc, char** argv, int split) {
  towers::remote::LaunchConfig lc;
  CLI::App app{"towers launch: a remote tower group on this machine (shards and workers on "
               "127.0.0.1), then its training flags after --"};
  app.add_option("--ps", lc.ps, "parameter-server shards")->capture_default_str();
  app.add_option("--workers", lc.workers, "worker processes (worker 0 is the chief)")
      ->capture_default_str();
  app.add_option("--towers-per-worker", lc.towers_per_worker, "towers of each worker")
      ->capture_default_str();
  app.add_option("--out", lc.out, "folder for the cluster file, the token, logs and metrics")
      ->capture_default_str();
  app.add_option("--grace", lc.grace_seconds,
                 "seconds the other processes get to finish after the chief has ended")
      ->capture_default_str();
  try {
    app.parse(split - 1, argv + 1);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  }
  int first = split + 1;
  if (first < argc && std::string(argv[first]) == "train") ++first;
  for (int i = first; i < argc; ++i) lc.train_args.push_back(argv[i]);
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  TOWERS_REQUIRE(n > 0, "towers launch: cannot find its own binary (/proc/self/exe)");
  lc.self.assign(self, n);
  return towers::remote::run_launch(lc);
}

}  // namespace

// A build with -march=native (TOWERS_NATIVE, the default) compiles the library for this
// machine's CPU extensions; CMake names the main ones as TOWERS_NEEDS_*. This file is built
// without -march=native, and this check runs before every other static initializer of the
// program, so that a binary carried to a CPU without them stops with an error instead of
// SIGILL. (-march=native enables rarer extensions too, VBMI2 or GFNI say, that are not
// checked; a CPU with every checked one and without such a one can still fault. x86 only.)
#if defined(__x86_64__) || defined(__i386__)
__attribute__((constructor(101))) static void towers_check_cpu_extensions() {
  __builtin_cpu_init();
  struct Extension {
    bool needed, present;
    const char* name;
  };
  const Extension extensions[] = {
      {TOWERS_NEEDS_AVX512F, __builtin_cpu_supports("avx512f") != 0, "avx512f"},
      {TOWERS_NEEDS_AVX512BW, __builtin_cpu_supports("avx512bw") != 0, "avx512bw"},
      {TOWERS_NEEDS_AVX512DQ, __builtin_cpu_supports("avx512dq") != 0, "avx512dq"},
      {TOWERS_NEEDS_AVX512VL, __builtin_cpu_supports("avx512vl") != 0, "avx512vl"},
      {TOWERS_NEEDS_AVX512CD, __builtin_cpu_supports("avx512cd") != 0, "avx512cd"},
      {TOWERS_NEEDS_AVX512VBMI, __builtin_cpu_supports("avx512vbmi") != 0, "avx512vbmi"},
      {TOWERS_NEEDS_AVX512VNNI, __builtin_cpu_supports("avx512vnni") != 0, "avx512vnni"},
      {TOWERS_NEEDS_AVX2, __builtin_cpu_supports("avx2") != 0, "avx2"},
      {TOWERS_NEEDS_FMA, __builtin_cpu_supports("fma") != 0, "fma"},
      {TOWERS_NEEDS_AVX, __builtin_cpu_supports("avx") != 0, "avx"},
      {TOWERS_NEEDS_BMI, __builtin_cpu_supports("bmi") != 0, "bmi"},
      {TOWERS_NEEDS_BMI2, __builtin_cpu_supports("bmi2") != 0, "bmi2"},
      {TOWERS_NEEDS_POPCNT, __builtin_cpu_supports("popcnt") != 0, "popcnt"},
      {TOWERS_NEEDS_F16C, __builtin_cpu_supports("f16c") != 0, "f16c"},
      {TOWERS_NEEDS_SSE4_2, __builtin_cpu_supports("sse4.2") != 0, "sse4.2"},
  };
  std::string missing;
  for (const Extension& e : extensions)
    if (e.needed && !e.present) missing += std::string(missing.empty() ? "" : ", ") + e.name;
  if (missing.empty()) return;
  std::fprintf(stderr,
               "towers: error: this binary was built with -march=native for a CPU with extensions "
               "this CPU lacks (%s); rebuild it here (scripts/build.sh), or build a portable "
               "binary with cmake -DTOWERS_NATIVE=OFF\n",
               missing.c_str());
  std::_Exit(1);
}
#endif

// The error handling every subcommand shares: a message and an exit code for each kind.
template <class F>
int guarded(F&& f) {
  try {
    return f();
  } catch (const towers::Error& e) {
    fmt::print(stderr, "towers: error: {}\n", e.what());
    return 1;
  } catch (const towers::InternalError& e) {
    fmt::print(stderr, "towers: internal error (a bug in towers): {}\n", e.what());
    return 3;
  } catch (const std::bad_alloc&) {
    fmt::print(stderr, "towers: error: out of host memory\n");
    return 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "towers: internal error (an unexpected exception): {}\n", e.what());
    return 3;
  }
}

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "launch") {
    int split = 2;
    while (split < argc && std::string(argv[split]) != "--") ++split;
    if (split == argc) {
      const bool help = argc > 2 && (std::string(argv[2]) == "--help" || std::string(argv[2]) == "-h");
      if (!help) {
        fmt::print(stderr, "towers: error: towers launch: give the training flags after --, as in "
                   "towers launch --ps 1 --workers 2 -- train --model fashion --steps 50\n");
        return 2;
      }
    }
    return guarded([&] { return launch_main(argc, argv, split); });
  }
  CLI::App app{"towers: data-parallel training of small image CNNs across towers"};
  app.require_subcommand(1);

  towers::TrainConfig train_cfg;
  CLI::App* train = app.add_subcommand("train", "train a model");
  add_train_flags(*train, train_cfg, false);

  towers::ScaleConfig scale_cfg;
  scale_cfg.plot_script = std::string(TOWERS_SOURCE_DIR) + "/bench/plot_scale.py";
  CLI::App* scale = app.add_subcommand(
      "scale", "tower-scaling experiment: train for each mode and tower count, write CSV/JSON and a plot");
  add_train_flags(*scale, scale_cfg.base, true);
  scale->add_option("--towers", scale_cfg.towers, "tower counts, e.g. 1,2,4")->delimiter(',')->capture_default_str();
  scale->add_option("--modes", scale_cfg.modes, "modes, e.g. sync,async,ssp")->delimiter(',')->capture_default_str();
  scale->add_option("--ssp-staleness", scale_cfg.ssp_staleness, "the bound of the ssp runs")->capture_default_str();
  scale->add_option("--out", scale_cfg.out_dir, "output folder")->capture_default_str();
  scale
      ->add_option("--plot-script", scale_cfg.plot_script,
                   "the script that plots the results (empty: no plot)")
      ->capture_default_str();

  std::string ckpt, eval_metrics;
  towers::EvalOptions eval_opts;
  CLI::App* eval = app.add_subcommand("eval", "test accuracy of a checkpoint");
  eval->add_option("--checkpoint", ckpt, "checkpoint file (.safetensors)");
  // A remote tower group's live parameters, read from its shards.
  std::string reader_cluster, reader_token_file;
  towers::remote::TlsFiles reader_tls;
  double reader_timeout = 60.0;
  auto add_reader_flags = [&](CLI::App* cmd) {
    cmd->add_option("--cluster", reader_cluster,
                    "a remote tower group's cluster file (default: TF_CONFIG): read the live "
                    "parameters from its shards");
    cmd->add_option("--token-file", reader_token_file,
                    "the run's token or its read-only one (default: TOWERS_TOKEN)");
    cmd->add_option("--tls-cert", reader_tls.cert, "this client's certificate (PEM)");
    cmd->add_option("--tls-key", reader_tls.key, "its private key (PEM)");
    cmd->add_option("--tls-ca", reader_tls.ca, "the CA that signed the shards' certificates");
    cmd->add_option("--rpc-timeout", reader_timeout, "seconds each call may take")
        ->capture_default_str();
  };
  add_reader_flags(eval);
  eval->add_option("--dataset", eval_opts.dataset, "override the dataset recorded in the checkpoint");
  eval->add_option("--data", eval_opts.data_dir, "override the dataset folder");
  eval->add_option("--threads", eval_opts.threads, "threads (0: all cores)");
  eval->add_option("--device", eval_opts.device, "cpu or cuda (the first GPU)")->capture_default_str();
  eval->add_option("--tta", eval_opts.tta,
                   "test-time augmentation: none, or flip (score each image by the mean of its "
                   "and its mirror image's logits); default: what the run used");
  eval->add_option("--metrics", eval_metrics, "write the result as one JSON line here");

  towers::remote::ShardOptions shard;
  std::string shard_cluster, shard_task, shard_token_file, shard_read_token_file;
  CLI::App* ps = app.add_subcommand(
      "ps", "a parameter-server shard of a remote tower group (see also towers launch)");
  ps->add_option("--cluster", shard_cluster, "the cluster file (default: TF_CONFIG)");
  ps->add_option("--task", shard_task, "ps:I (default: the file's or TF_CONFIG's task)");
  ps->add_option("--token-file", shard_token_file, "the run's token (default: TOWERS_TOKEN)");
  ps->add_option("--read-token-file", shard_read_token_file,
                 "a read-only token, for towers pull and towers eval --cluster (default: "
                 "TOWERS_READ_TOKEN; none: readers need the run's token)");
  ps->add_option("--bind", shard.bind,
                 "the address to listen on, with the cluster file's port (0.0.0.0: every "
                 "interface; the default serves this machine only)")->capture_default_str();
  ps->add_option("--tls-cert", shard.tls.cert, "this shard's certificate (PEM)");
  ps->add_option("--tls-key", shard.tls.key, "its private key (PEM)");
  ps->add_option("--tls-ca", shard.tls.ca, "the CA that signed the workers' certificates");
  ps->add_option("--checkpoint-dir", shard.checkpoint_dir,
                 "save this shard's range here when the chief checkpoints; started again with "
                 "the same flags, the shard restores it and the workers reconnect");
  ps->add_flag("--quiet", shard.quiet, "no log lines");

  std::string pull_out;
  CLI::App* pull = app.add_subcommand(
      "pull", "read a remote tower group's live parameters from its shards into a checkpoint file");
  add_reader_flags(pull);
  pull->add_option("--out", pull_out, "the file to write (.safetensors; towers eval reads it)")
      ->required();

  // `towers launch` is parsed before this app (its own flags end at --); listed for --help.
  app.add_subcommand("launch",
                     "start a remote tower group on this machine: towers launch --ps P --workers "
                     "W -- train ... (towers launch --help)");

  bool devices_json = false;
  CLI::App* devices = app.add_subcommand("devices", "list the CPU and the GPUs towers can use");
  devices->add_flag("--json", devices_json, "one JSON line");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);  // prints the message (or the help)
    return rc == 0 ? 0 : 2;
  }

  return guarded([&]() -> int {
    if (*train) {
      std::signal(SIGINT, on_interrupt);
      towers::TrainSummary s = towers::train(train_cfg);
      return s.interrupted ? 130 : 0;
    }
    if (*devices) return list_devices(devices_json);
    if (*scale) {
      std::signal(SIGINT, on_interrupt);
      towers::run_scale(scale_cfg);
      return towers::g_stop_requested.load() ? 130 : 0;
    }
    if (*ps) {
      const towers::remote::ClusterTask ct = towers::remote::read_cluster(shard_cluster, shard_task);
      TOWERS_REQUIRE(ct.task_given && ct.task.type == "ps",
                     "towers ps: the task must be ps:I (--task ps:0), got {}",
                     ct.task_given ? ct.task.name() : std::string("none"));
      shard.cluster = ct.cluster;
      shard.index = ct.task.index;
      shard.token = towers::remote::read_token(shard_token_file);
      shard.read_token = towers::remote::read_token(shard_read_token_file, "TOWERS_READ_TOKEN", true);
      TOWERS_REQUIRE(shard.read_token != shard.token,
                     "--read-token-file: the read-only token must differ from the run's token");
      towers::remote::check_tls(shard.tls);
      shard.exit_process_when_done = true;
      return towers::remote::run_shard(shard);
    }
    auto read_cluster = [&] {
      const towers::remote::ClusterTask ct = towers::remote::read_cluster(reader_cluster, "");
      towers::remote::check_tls(reader_tls);
      TOWERS_REQUIRE(reader_timeout > 0.0, "--rpc-timeout must be > 0 seconds");
      return towers::remote::pull_model(ct.cluster,
                                        towers::remote::read_token(reader_token_file),
                                        reader_tls, reader_timeout);
    };
    auto versions = [](const towers::remote::PulledModel& m) {
      std::string v;
      for (size_t i = 0; i < m.versions.size(); ++i)
        v += fmt::format("{}ps:{} at {}", i ? ", " : "", i, m.versions[i]);
      return v;
    };
    if (*pull) {
      const towers::remote::PulledModel m = read_cluster();
      towers::remote::save_pulled(m, pull_out);
      fmt::print("{}: model {} ({} mode; {})\n", pull_out, m.model, m.mode, versions(m));
      return 0;
    }
    const bool from_cluster = !reader_cluster.empty() || (ckpt.empty() && towers::remote::cluster_requested(""));
    TOWERS_REQUIRE(from_cluster != !ckpt.empty(),
                   "towers eval: give one of --checkpoint FILE and --cluster FILE");
    towers::EvalSummary s;
    std::string source = ckpt;
    if (from_cluster) {
      const towers::remote::PulledModel m = read_cluster();
      source = fmt::format("the shards of {}", reader_cluster.empty() ? "TF_CONFIG" : reader_cluster);
      s = towers::evaluate_params(m.model, *std::min_element(m.versions.begin(), m.versions.end()),
                                  m.config, m.params.data(), static_cast<int64_t>(m.params.size()),
                                  eval_opts, source);
      source += " (" + versions(m) + ")";
    } else {
      s = towers::evaluate_checkpoint(ckpt, eval_opts);
    }
    nlohmann::json j = {{"event", "eval"}, {"checkpoint", source}, {"model", s.model},
                        {"step", s.step}, {"examples", s.examples},
                        {"test_accuracy", s.test_accuracy}, {"test_loss", s.test_loss},
                        {"weights", s.ema ? "ema" : "trained"}, {"tta", s.tta}};
    if (!eval_metrics.empty()) {
      std::FILE* f = std::fopen(eval_metrics.c_str(), "w");
      TOWERS_REQUIRE(f != nullptr, "--metrics: cannot open '{}' for writing", eval_metrics);
      fmt::print(f, "{}\n", j.dump());
      std::fclose(f);
    }
    fmt::print("{}: model {}, step {}{}{}: test accuracy {:.2f}% on {} examples (loss {:.4f})\n",
               source, s.model, s.step, s.ema ? ", the weights' moving average (--ema)" : "",
               s.tta == "flip" ? ", with mirror images (--tta flip)" : "",
               100.0 * s.test_accuracy, s.examples, s.test_loss);
    return 0;
  });
}
