// launch.h — `towers launch`: a whole remote tower group on this machine, for a first try,
// tests and benchmarks. It picks free loopback ports, writes the cluster file, a fresh token
// and a read-only one (for towers pull / eval --cluster) to --out, starts P shards (`towers ps`)
// and W workers (`towers train ... --cluster
// --task worker:I`, worker 0 the chief), forwards Ctrl-C to the workers, and exits with the
// chief's exit code. Each other process's output goes to DIR/ps-I.log or DIR/worker-I.log (the
// chief's to this terminal) and each worker's metrics to DIR/worker-I.jsonl (the chief's to
// --metrics if the training flags give one). DIR/processes.json lists the process ids. A DIR
// that holds an earlier launch's results is refused, unless the training flags continue that
// run (--resume with its chief's --checkpoint-dir): then the logs and metrics are appended to. The
// shards save their ranges to DIR/ps-checkpoints whenever the chief checkpoints; a shard killed
// mid-run can be started again by hand with its command line from DIR/processes.json ("argv").
#pragma once

#include <string>
#include <vector>

namespace towers::remote {

struct LaunchConfig {
  int ps = 1;
  int workers = 2;
  int towers_per_worker = 1;
  std::string out = "launch";
  std::string self;                     // the towers binary to start (this one)
  std::vector<std::string> train_args;  // the flags after --, without a leading "train"
  double grace_seconds = 30.0;          // after the chief ends: how long the others get
};

// Returns the chief's exit code (128 + signal when it was killed).
int run_launch(const LaunchConfig& c);

}  // namespace towers::remote
