#include "towers/remote/launch.h"

#include <algorithm>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "core/check.h"
#include "core/clock.h"
#include "towers/remote/cluster.h"

namespace towers::remote {

namespace {

std::atomic<int> g_signals{0};
void on_signal(int) { g_signals.fetch_add(1); }

struct Child {
  std::string task;
  pid_t pid = -1;
  int status = 0;
  bool exited = false;
};

// Starts argv with its output in `log` (appended to, or a fresh file), or on this terminal.
pid_t spawn(const std::vector<std::string>& argv, const std::string& log, bool tee_to_terminal,
            bool append) {
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  int fd = -1;
  if (!tee_to_terminal) {
    fd = open(log.c_str(), O_WRONLY | O_CREAT | (append ? O_APPEND : O_TRUNC) | O_CLOEXEC, 0644);
    TOWERS_REQUIRE(fd >= 0, "launch: cannot write '{}': {}", log, std::strerror(errno));
  }
  const pid_t parent = getpid();
  const pid_t pid = fork();
  TOWERS_REQUIRE(pid >= 0, "launch: fork failed: {}", std::strerror(errno));
  if (pid == 0) {
    setpgid(0, 0);  // Ctrl-C reaches the launcher only; it forwards it
    // A launcher that dies (kill -9 included) takes its cluster with it.
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) _exit(1);  // it died before the line above
    if (!tee_to_terminal) {
      dup2(fd, STDOUT_FILENO);
      dup2(fd, STDERR_FILENO);
    }
    execv(args[0], args.data());
    std::fprintf(stderr, "towers launch: cannot start %s: %s\n", args[0], std::strerror(errno));
    _exit(127);
  }
  if (fd >= 0) close(fd);
  setpgid(pid, pid);  // also here, so no Ctrl-C falls between fork and the child's own call
  return pid;
}

std::string describe_status(int status) {
  if (WIFEXITED(status)) return fmt::format("exit {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return fmt::format("killed by signal {} ({})", WTERMSIG(status), strsignal(WTERMSIG(status)));
  return "ended";
}

int exit_code(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

// Reaps any children that have ended; returns true if one did.
bool reap(std::vector<Child>& kids) {
  bool any = false;
  for (Child& k : kids) {
    if (k.exited) continue;
    int st = 0;
    if (waitpid(k.pid, &st, WNOHANG) == k.pid) {
      k.exited = true;
      k.status = st;
      any = true;
    }
  }
  return any;
}

void signal_all(std::vector<Child>& kids, int sig, bool workers_only) {
  for (Child& k : kids)
    if (!k.exited && (!workers_only || k.task.rfind("worker", 0) == 0)) kill(k.pid, sig);
}

// Waits up to seconds for every child to end; returns whether all did.
bool wait_all(std::vector<Child>& kids, double seconds) {
  const auto until = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                        std::chrono::duration<double>(seconds));
  for (;;) {
    reap(kids);
    bool all = true;
    for (const Child& k : kids) all = all && k.exited;
    if (all) return true;
    if (Clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

}  // namespace

int run_launch(const LaunchConfig& c) {
  TOWERS_REQUIRE(c.ps >= 1 && c.ps <= 64, "--ps must be in 1..64, got {}", c.ps);
  TOWERS_REQUIRE(c.workers >= 1 && c.workers <= 64, "--workers must be in 1..64, got {}", c.workers);
  TOWERS_REQUIRE(c.towers_per_worker >= 1, "--towers-per-worker must be at least 1, got {}",
                 c.towers_per_worker);
  // The launcher owns the cluster flags and the tower count; metrics go per worker. Whether the
  // flags continue an earlier run: --resume (or CLI11's --resume=VALUE) with --checkpoint-dir.
  std::vector<std::string> args;
  std::string metrics;
  bool resume = false, checkpoints = false;
  for (size_t i = 0; i < c.train_args.size(); ++i) {
    const std::string& a = c.train_args[i];
    if (a == "--resume") resume = true;
    if (a.rfind("--resume=", 0) == 0) {
      const std::string v = a.substr(9);
      resume = !(v == "false" || v == "0" || v == "off" || v == "no");
    }
    checkpoints = checkpoints || a == "--checkpoint-dir" || a.rfind("--checkpoint-dir=", 0) == 0;
    for (const char* owned : {"--cluster", "--task", "--token-file", "--towers"})
      TOWERS_REQUIRE(a != owned && a.rfind(std::string(owned) + "=", 0) != 0,
                     "towers launch: {} is set by the launcher{}; leave it out of the training "
                     "flags",
                     owned,
                     std::string(owned) == "--towers"
                         ? " (use --towers-per-worker for the towers of each worker)"
                         : " (it writes the cluster file and the token to --out, and gives each "
                           "process its task)");
    if (a == "--metrics" && i + 1 < c.train_args.size()) {
      metrics = c.train_args[++i];
      continue;
    }
    if (a.rfind("--metrics=", 0) == 0) {
      metrics = a.substr(10);
      continue;
    }
    args.push_back(a);
  }
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(c.out, ec);
  TOWERS_REQUIRE(fs::is_directory(c.out), "--out: '{}' is not a directory and cannot be created{}",
                 c.out, ec ? ": " + ec.message() : "");
  // An earlier launch's results in the folder (its workers' metrics, its shards' checkpoints)
  // are not overwritten by a new run, as --checkpoint-dir is refused to a new run where
  // checkpoints are; a run that continues it (--resume, from its chief's --checkpoint-dir)
  // appends to its metrics and logs. (A launch that failed before any worker wrote its metrics
  // left no results, and may be run again.)
  const bool continues = resume && checkpoints;
  std::vector<std::string> results;
  for (const auto& e : fs::directory_iterator(c.out, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("worker-", 0) == 0 && e.path().extension() == ".jsonl")
      results.push_back(e.path().string());
  }
  std::sort(results.begin(), results.end());
  const fs::path shard_checkpoints = fs::path(c.out) / "ps-checkpoints";
  if (fs::is_directory(shard_checkpoints, ec) && !fs::is_empty(shard_checkpoints, ec))
    results.push_back(shard_checkpoints.string() + "/");
  if (!continues && !results.empty())
    TOWERS_BAD_INPUT(
        "--out: '{}' holds the results of an earlier launch ({}), which this one would "
        "overwrite: give another --out, remove them (rm -r '{}'), or continue that run: add "
        "--resume to the training flags{}",
        c.out, fmt::join(results, ", "), c.out,
        checkpoints ? "" : ", with the --checkpoint-dir its chief wrote");
  // A launch is a new cluster: shard checkpoints of an earlier launch into the same folder
  // must not be restored by its shards (a resumed run re-initialises them from the chief).
  fs::remove_all(shard_checkpoints, ec);
  const std::vector<int> ports = free_loopback_ports(c.ps + c.workers);
  nlohmann::json cluster = {{"worker", nlohmann::json::array()}, {"ps", nlohmann::json::array()}};
  for (int i = 0; i < c.workers; ++i) cluster["worker"].push_back(fmt::format("127.0.0.1:{}", ports[c.ps + i]));
  for (int i = 0; i < c.ps; ++i) cluster["ps"].push_back(fmt::format("127.0.0.1:{}", ports[i]));
  const std::string cluster_file = (fs::path(c.out) / "cluster.json").string();
  const std::string token_file = (fs::path(c.out) / "token").string();
  {
    std::ofstream f(cluster_file);
    f << nlohmann::json{{"cluster", cluster}}.dump(2) << "\n";
    TOWERS_REQUIRE(f.good(), "--out: cannot write '{}'", cluster_file);
  }
  const std::string read_token_file = (fs::path(c.out) / "read-token").string();
  for (const std::string& f : {token_file, read_token_file}) {
    // The tokens are readable by this user only.
    const int fd = open(f.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    TOWERS_REQUIRE(fd >= 0, "--out: cannot write '{}': {}", f, std::strerror(errno));
    fchmod(fd, 0600);
    const std::string t = fresh_token() + "\n";
    const bool ok = write(fd, t.data(), t.size()) == static_cast<ssize_t>(t.size());
    close(fd);
    TOWERS_REQUIRE(ok, "--out: cannot write '{}'", f);
  }

  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);
  // Every role calls OpenBLAS single-threaded (gemm_init_single_threaded); told so before it
  // loads, OpenBLAS starts no helper thread, which otherwise spins on a core for the first
  // tenth of a second or so, while the cluster starts. A user's own setting is kept.
  setenv("OPENBLAS_NUM_THREADS", "1", 0);
  std::vector<Child> kids;
  nlohmann::json procs = nlohmann::json::array();
  auto start = [&](const std::string& task, std::vector<std::string> argv, bool tee) {
    const std::string log = (fs::path(c.out) / (task.substr(0, task.find(':')) + "-" +
                                                 task.substr(task.find(':') + 1) + ".log")).string();
    Child k;
    k.task = task;
    try {
      k.pid = spawn(argv, log, tee, continues);
    } catch (...) {
      signal_all(kids, SIGKILL, false);  // what was started goes too
      wait_all(kids, 5.0);
      throw;
    }
    kids.push_back(k);
    procs.push_back({{"task", task}, {"pid", k.pid}, {"log", tee ? "" : log}, {"argv", argv}});
  };
  for (int i = 0; i < c.ps; ++i)
    start(fmt::format("ps:{}", i),
          {c.self, "ps", "--cluster", cluster_file, "--task", fmt::format("ps:{}", i),
           "--token-file", token_file, "--read-token-file", read_token_file, "--checkpoint-dir",
           shard_checkpoints.string()},
          false);
  for (int i = 0; i < c.workers; ++i) {
    std::vector<std::string> argv = {c.self, "train"};
    argv.insert(argv.end(), args.begin(), args.end());
    const std::string m = i == 0 && !metrics.empty()
                              ? metrics
                              : (fs::path(c.out) / fmt::format("worker-{}.jsonl", i)).string();
    for (const std::string& a : {std::string("--towers"), std::to_string(c.towers_per_worker),
                                 std::string("--cluster"), cluster_file, std::string("--task"),
                                 fmt::format("worker:{}", i), std::string("--token-file"),
                                 token_file, std::string("--metrics"), m})
      argv.push_back(a);
    start(fmt::format("worker:{}", i), argv, i == 0);
  }
  {
    std::ofstream f((fs::path(c.out) / "processes.json").string());
    f << procs.dump(2) << "\n";
  }
  fmt::print(stderr, "towers launch: {} shard(s), {} worker(s) x {} tower(s) on 127.0.0.1; "
             "cluster {}, logs in {}\n", c.ps, c.workers, c.towers_per_worker, cluster_file, c.out);

  // Until the chief (worker 0) ends: forward Ctrl-C to the workers (a second one kills them).
  Child* chief = &kids[c.ps];
  int forwarded = 0;
  std::vector<bool> reported(kids.size(), false);
  while (!chief->exited) {
    const int got = g_signals.load();
    if (got > forwarded) {
      signal_all(kids, forwarded == 0 ? SIGINT : SIGKILL, true);
      forwarded = got;
    }
    reap(kids);
    for (size_t i = 0; i < kids.size(); ++i)
      if (kids[i].exited && !reported[i] && &kids[i] != chief) {
        reported[i] = true;
        if (!(WIFEXITED(kids[i].status) && WEXITSTATUS(kids[i].status) == 0))
          fmt::print(stderr, "towers launch: {} ended while the chief runs: {}\n", kids[i].task,
                     describe_status(kids[i].status));
      }
    if (!chief->exited) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  // The other workers finish their last round by themselves; the shards exit once every
  // worker is done. Whatever is still running after the grace period is stopped (at once
  // when the chief failed: the others cannot finish without it).
  const bool chief_ok = WIFEXITED(chief->status) && WEXITSTATUS(chief->status) == 0;
  if (!wait_all(kids, chief_ok ? c.grace_seconds : 1.0)) {
    signal_all(kids, SIGTERM, false);
    // A stopped (hung) process takes its SIGTERM only once it runs again.
    signal_all(kids, SIGCONT, false);
    if (!wait_all(kids, 5.0)) {
      signal_all(kids, SIGKILL, false);
      wait_all(kids, 5.0);
    }
  }
  for (const Child& k : kids)
    fmt::print(stderr, "towers launch: {}{}: {}\n", k.task, k.task == "worker:0" ? " (chief)" : "",
               describe_status(k.status));
  return exit_code(chief->status);
}

}  // namespace towers::remote
