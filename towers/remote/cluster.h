// cluster.h — who is who in a remote tower group: the cluster file (TF_CONFIG's layout), the
// task of this process, the run's token, and how the flat parameter array is cut into shards.
//
//   {"cluster": {"chief": ["host:port"], "worker": ["host:port", ...], "ps": ["host:port", ...]},
//    "task": {"type": "worker", "index": 0}}
//
// The training workers are the chief (if the file has a "chief" entry) followed by the
// "worker" entries; without a chief entry, worker 0 is the chief. Worker rank r runs the
// global towers r*T .. r*T+T-1 of a run of W workers x T towers. The addresses of the chief
// and workers are not dialled (workers only call the shards); they name the processes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "params/layout.h"

namespace towers::remote {

struct Cluster {
  std::vector<std::string> chief, worker, ps;  // "host:port"
  std::string origin;                          // the file, or "TF_CONFIG"
  int workers() const { return static_cast<int>(chief.size() + worker.size()); }
};

struct Task {
  std::string type;  // chief | worker | ps
  int index = 0;
  // The training rank: chief 0, worker i is i + (chief entries); -1 for a ps task.
  int rank(const Cluster& c) const;
  bool is_chief(const Cluster& c) const { return rank(c) == 0; }
  std::string name() const;  // "worker:1"
};

// "worker:1", "ps:0", "chief:0" (or "chief"); flag names the flag in errors.
Task parse_task(const std::string& text, const std::string& flag);

struct ClusterTask {
  Cluster cluster;
  Task task;
  bool task_given = false;  // the file (or TF_CONFIG) or the --task flag named one
};

// The cluster from FILE (--cluster) or, when file is empty, from the TF_CONFIG environment
// variable; task_flag (--task) overrides the file's "task". Errors name the file and field.
ClusterTask read_cluster(const std::string& file, const std::string& task_flag);
// True when a cluster is configured: a --cluster file, or TF_CONFIG set.
bool cluster_requested(const std::string& file);

// The run's shared secret: the first line of token_file, else the TOWERS_TOKEN environment
// variable. Warns (on stderr; unless !warn) of a token file that other users can read, and of
// a token shorter than kShortToken characters.
// env: the variable to read when there is no file; optional: "" instead of an error when
// neither is given (the read-only token).
inline constexpr size_t kShortToken = 16;
std::string read_token(const std::string& token_file, const char* env = "TOWERS_TOKEN",
                       bool optional = false, bool warn = true);
// A fresh random token (32 bytes of /dev/urandom, as hex).
std::string fresh_token();

// The byte range of shard s: [begin, end) in floats of the flat array. Ranges are balanced by
// bytes (a big variable is split between shards), cut at 16-float (64-byte) boundaries.
struct Range {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
};
std::vector<Range> shard_ranges(int64_t total, int shards);

// n distinct free TCP ports on 127.0.0.1, as the kernel hands them out (each is bound to port
// 0 and read back; all stay bound until every one is chosen, so none is handed out twice).
// They are free when this returns; a process that binds them later may still lose one.
std::vector<int> free_loopback_ports(int n);

// A hash of the layout: every variable's name, shape, offset and trainability, and the total.
// Two processes agree on the flat array exactly when their hashes agree.
uint64_t layout_hash(const ParameterLayout& layout);

}  // namespace towers::remote
