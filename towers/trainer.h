// trainer.h — `towers train` and `towers eval` as library calls: a run from flags to summary.
// The trainer owns the data, the host parameters, the schedule, metrics, evaluation and
// checkpoints; a TowerGroup runs the towers in the chosen mode.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/cudnn_rules.h"
#include "optim/optimizer.h"
#include "optim/schedule.h"

namespace towers {

struct TrainConfig {
  std::string model = "fashion";
  std::string dataset = "fashion-mnist";
  std::string data_dir;             // empty: the dataset's default location
  std::string augment = "auto";     // auto | tutorial | flip | airbench | none
  int64_t synthetic_size = 10000;   // train examples of --dataset synthetic (test: a fifth)
  double epochs = 0.0;              // one of epochs / steps sets the length
  int64_t steps = 0;
  int64_t stop_at_step = 0;         // >0: end this job after that step (schedule unchanged)
  int64_t batch = 128;              // per tower
  int towers = 1;
  int threads_per_tower = 0;        // 0: cores / towers (at least 1)
  std::string placement;            // model parallelism (towers/placement.h); empty: the model
                                    // file's "placement" if it has one, else whole towers;
                                    // "none": whole towers whatever the file says
  int micro_batches = 1;            // with a placement: micro-batches per step (GPipe)
  std::string device = "cpu";       // cpu | cuda
  int gpus = 0;                     // cuda: GPUs to use (0: all); tower i on GPU i % gpus
  std::string reduce = "host";      // sync on GPUs: host | nccl
  std::string params = "host";      // where the parameters live: host | mirrored (on each GPU)
  int64_t sync_every = 0;           // mirrored, async/ssp: steps between a tower's exchanges
                                    // with the host copy (0: unset, which is 1)
  bool tf32 = false;                // cuda: TF32 tensor-core GEMMs
  bool cuda_graphs = true;          // cuda: replay each step as a CUDA graph
  bool backward_branches = false;   // cuda: weight gradients on a second stream
  CudnnRules cudnn;                 // cuda: how cuDNN's algorithms are chosen (core/cudnn_rules.h)
  std::string input = "host";       // where training batches are made: host | device (cuda)
  std::string mode = "sync";        // sync | async | ssp
  int replicas_to_aggregate = 0;    // sync: update after the first K towers (0: all)
  int64_t staleness = -1;           // ssp: the bound (required)
  bool use_locking = false;         // async/ssp: serialise the apply per variable
  bool staleness_aware_lr = false;  // lr / max(1, staleness)
  std::string on_divergence = "stop";  // stop | skip-step: what a non-finite loss or gradient does
  double clip_grad_norm = 0.0;      // >0: scale each update's gradient to at most this L2 norm
  std::string lr_scaling = "none";  // none | linear (lr x towers aggregated per update)
  std::vector<std::string> slow_towers;  // "I:MS": tower I sleeps MS ms per step
  uint64_t seed = 1;
  OptimizerConfig optimizer;         // with --ema and --lookahead, its wrappers
  ScheduleConfig schedule;
  float label_smoothing = 0.0f;      // training target (1 - e) onehot + e / classes
  bool sync_bn = false;  // BatchNorm statistics over the sync towers' global batch
  std::string conv;      // --conv: every convolution's CPU algorithm; empty: the model's own
  std::string tta = "none";          // none | flip: evaluations average each image's and its mirror's logits
  std::string metrics_path;
  std::string checkpoint_dir;
  double checkpoint_every_epochs = 1.0;  // plus one at the end
  int keep_checkpoints = 3;
  bool resume = false;
  double eval_every_epochs = 1.0;   // 0: only at the end
  double target_accuracy = 0.0;     // >0: stop at the first evaluation that reaches it
  int64_t log_every = 50;           // steps between plain progress lines (off a terminal)
  bool quiet = false;
  // A remote tower group (towers/remote/): this process is one worker of a cluster whose
  // parameters live on parameter-server shards. Empty cluster and no TF_CONFIG: one process.
  std::string cluster;              // --cluster FILE (TF_CONFIG's layout)
  std::string task;                 // --task worker:I (or the file's / TF_CONFIG's "task")
  std::string token_file;           // empty: TOWERS_TOKEN
  std::string tls_cert, tls_key, tls_ca;
  double rpc_timeout = 300.0;       // seconds: every call's deadline, barrier waits included
  double heartbeat_timeout = 10.0;  // seconds without a call before a shard counts us lost
  int64_t rpc_piece_kib = 1024;     // pushes and pulls travel in pieces of this size (the chief's;
                                    // 1 KiB .. 256 MiB, a quarter of the message limit)
  int rpc_stripes = 4;              // TCP connections a push to (pull from) a shard uses at once
  bool rpc_sessions = true;         // pushes and pulls on streams kept open from call to call
};

void validate(const TrainConfig& c);  // throws naming the bad flag
nlohmann::json to_json(const TrainConfig& c);

struct TrainSummary {
  double test_accuracy = 0.0, test_loss = 0.0;
  double train_images_per_sec = 0.0, wall_seconds = 0.0;
  int64_t steps = 0, start_step = 0;
  double epochs = 0.0, final_loss = 0.0;
  bool interrupted = false;
  std::string last_checkpoint;
  nlohmann::json tower_stats;  // staleness histogram, per-tower steps and times, dropped
  nlohmann::json pipeline;     // placed towers: per tower, each part's busy and idle time
  int64_t skipped_steps = 0;        // --on-divergence skip-step: updates not applied
  double time_to_target = -1.0;     // training seconds to --target-accuracy (-1: not reached)
  double wall_to_target = -1.0;
  std::vector<int> lost_workers;    // remote: workers the shards lost during the run
  int rollbacks = 0;                // remote sync: times the shards went back to a checkpoint
};

// Set (e.g. by SIGINT) to stop after the current step; a checkpoint is written if the run
// has a checkpoint dir.
extern std::atomic<bool> g_stop_requested;

TrainSummary train(const TrainConfig& c);

struct EvalSummary {
  std::string model;
  int64_t step = 0, examples = 0;
  double test_accuracy = 0.0, test_loss = 0.0;
  bool ema = false;  // evaluated the checkpoint's moving average of the weights (--ema)
  std::string tta;   // the test-time augmentation it used
};
// What `towers eval` may override of what the run recorded (empty: as recorded).
struct EvalOptions {
  std::string dataset, data_dir;
  int threads = 0;             // 0: all cores
  std::string device = "cpu";  // cpu or cuda (the first GPU)
  std::string tta;             // none | flip
};
// Evaluates a checkpoint on the test split of the dataset it was trained on, with the run's
// test-time augmentation, unless o overrides them.
EvalSummary evaluate_checkpoint(const std::string& path, const EvalOptions& o);
// The same test pass over parameters in memory (count floats in model's layout order), with
// what cfg (a run's configuration) records unless o overrides it; origin names where they
// came from in errors (a checkpoint, a cluster).
EvalSummary evaluate_params(const std::string& model, int64_t step, const nlohmann::json& cfg,
                            const float* params, int64_t count, const EvalOptions& o,
                            const std::string& origin);

}  // namespace towers
