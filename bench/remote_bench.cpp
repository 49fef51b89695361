// remote_bench — the transport of remote tower groups (towers/remote/), each case validated
// before it is timed, next to its physical yardsticks measured in the same run:
//   BM_Push/BYTES/SHARDS   one sync push of a BYTES gradient to SHARDS shards (1 worker: the
//                          round is applied as it arrives), through RemoteParameterStore: the
//                          gradient lent to gRPC in pieces on PushStreams (wire.h; in the
//                          default stripes, 4 streams a shard on connections of their own), the
//                          shard's one copy of each piece out of the received slices and its
//                          apply (sgd) while the next piece is on the wire, the reply
//   BM_Pull/BYTES/SHARDS   what a tower's pull reads: every shard's range, streamed in pieces
//                          (PullStreams, in the default stripes), each copied into the
//                          worker's array as it arrives
//   BM_TcpLoopback/BYTES/WRITE/READ
//                          the raw yardstick: BYTES over one 127.0.0.1 TCP connection and a
//                          1-byte reply, the same round trip as a unary call, written in
//                          write() calls of WRITE bytes and read in read() calls of READ (0:
//                          the whole message in one call). How a socket is driven moves its
//                          rate by up to 2x on some kernels (one 4 MiB read() can hold the
//                          socket while the sender waits), so there are several variants, and
//                          raw TCP is the best of them (bench/run-remote.sh)
//   BM_GrpcUnary/BYTES     gRPC's own floor: one unary call of BYTES on one channel, sent from
//                          the caller's memory without a copy (wire.h), to a server that
//                          replies at once without reading it: what any design on gRPC pays
//   BM_GrpcStream/BYTES    the same floor for the streamed push: BYTES in 1 MiB messages on one
//                          PushStream, drained unread by the server
//   BM_GrpcPullStream/BYTES
//                          the floor of the streamed pull: 1 MiB messages sent by the server
//                          from its memory, received and dropped unread
//   BM_GrpcStreamToProcess/BYTES, BM_GrpcPullStreamFromProcess/BYTES
//                          the two stream floors with the server in a process of its own (this
//                          binary, `remote_bench --ack-server PORT PULL_BYTES`), as a shard is
//   BM_GrpcStripesToProcess/BYTES/STRIPES
//                          the push stream's floor in stripes: STRIPES streams at once, each on
//                          a TCP connection of its own, each carrying its share of the pieces
//   BM_GrpcSessionsToProcess/BYTES/STRIPES
//                          the same on sessions: streams opened once, before the timing, every
//                          piece acknowledged on them; the difference is what a call per push
//                          and stripe costs
//   BM_Memcpy/BYTES        memory bandwidth over the same bytes
//   BM_SyncRoundsToProcesses/BYTES/SHARDS/WORKERS/ADAM
//                          plain sync rounds: WORKERS workers (stores of this process, a thread
//                          each) push BYTES each to shard processes, with sgd (ADAM 0) or adam;
//                          with 2 workers the shards also keep each round's starting values
//                          (decision 79)
//   BM_PushToProcesses/BYTES/SHARDS/STRIPES/PIECE_KIB/SESSIONS,
//   BM_PullFromProcesses/BYTES/SHARDS/STRIPES/PIECE_KIB/SESSIONS
//                          the same push and pull (in STRIPES streams a shard, each on a
//                          connection of its own, in pieces of PIECE_KIB; on sessions kept
//                          open, SESSIONS 1, or on a call each, 0) to shards that are
//                          `towers ps` processes
//                          (the towers binary beside this one's bench/ directory), as in a
//                          real cluster: each process has gRPC threads of its own, and every
//                          hand-off between client and shard crosses processes; their counters
//                          say how busy each side's threads were (timed_loop)
// Elsewhere the shards run as threads of this process on 127.0.0.1: they share the cores with
// the client, as separate processes would, and also gRPC's callback threads, which lets one
// thread serve both sides of a hand-off. bytes_per_second is the message size over the time
// of one call. OpenBLAS, which towers drives single-threaded, starts a helper thread that
// spins for a while after the library loads; run with OPENBLAS_NUM_THREADS=1 (run-remote.sh
// does, and the shard processes get it) so that it does not take a core from the first cases.
#include <arpa/inet.h>
#include <csignal>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <ctime>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <benchmark/benchmark.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <grpcpp/generic/async_generic_service.h>

#include "core/check.h"
#include "core/device.h"
#include "optim/optimizer.h"
#include "towers/remote/remote_store.h"
#include "towers/remote/shard_server.h"
#include "towers/remote/towers.grpc.pb.h"
#include "towers/remote/wire.h"

namespace {

using namespace towers;

int free_port() { return remote::free_loopback_ports(1)[0]; }

extern "C" char** environ;

// argv[0] started as a child process with `env` added to (and replacing the same names of)
// this process's environment; it ends when this process does. -1 if it cannot be started.
pid_t start_child(std::vector<std::string> argv, std::vector<std::string> env) {
  if (access(argv[0].c_str(), X_OK) != 0) return -1;
  for (char** e = environ; *e; ++e) {
    const std::string_view var(*e);
    if (std::none_of(env.begin(), env.end(), [&](const std::string& x) {
          return var.substr(0, var.find('=') + 1) == x.substr(0, x.find('=') + 1);
        }))
      env.push_back(*e);
  }
  std::vector<char*> a, e;
  for (std::string& x : argv) a.push_back(x.data());
  for (std::string& x : env) e.push_back(x.data());
  a.push_back(nullptr);
  e.push_back(nullptr);
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGTERM);  // a bench that dies takes its children with it
    if (getppid() != parent) _exit(1);
    execve(a[0], a.data(), e.data());
    _exit(127);
  }
  return pid;
}

// The token of every call (long enough that the shards do not warn of it).
constexpr const char* kBenchToken = "remote-bench-token";

std::filesystem::path this_binary() { return std::filesystem::read_symlink("/proc/self/exe"); }

// `towers ps --cluster FILE --task ps:I --quiet` (the towers binary beside bench/) as a child
// process, with the bench's token.
pid_t start_shard_process(const std::string& cluster_file, int index) {
  const std::string bin = (this_binary().parent_path().parent_path() / "towers").string();
  return start_child(
      {bin, "ps", "--cluster", cluster_file, "--task", fmt::format("ps:{}", index), "--quiet"},
      {fmt::format("TOWERS_TOKEN={}", kBenchToken), "OPENBLAS_NUM_THREADS=1"});
}

// Child processes of a case, and a scratch folder: on destruction each child is given
// `grace` seconds to end by itself (a shard ends once its workers are done), then SIGTERM,
// then SIGKILL, and is reaped; the folder is removed.
struct Children {
  std::vector<pid_t> pids;
  std::string dir;
  double grace = 0.0;
  Children() = default;
  Children(const Children&) = delete;
  Children& operator=(const Children&) = delete;
  ~Children() {
    auto reap_all = [&](double seconds) {
      const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
      for (;;) {
        std::erase_if(pids, [](pid_t p) { return waitpid(p, nullptr, WNOHANG) != 0; });
        if (pids.empty() || std::chrono::steady_clock::now() >= until) return;
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    };
    reap_all(grace);
    for (pid_t p : pids) kill(p, SIGTERM);
    reap_all(2.0);
    for (pid_t p : pids) kill(p, SIGKILL);
    for (pid_t p : pids) waitpid(p, nullptr, 0);
    if (!dir.empty()) {
      std::error_code ec;
      std::filesystem::remove_all(dir, ec);
    }
  }
};

// Waits until child `pid` accepts connections on 127.0.0.1:port; throws at once if it has
// ended, or after 30 s.
void wait_listening(pid_t pid, int port, const std::string& what) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  for (;;) {
    int status = 0;
    TOWERS_REQUIRE(waitpid(pid, &status, WNOHANG) == 0, "{} ended before it listened ({} {})",
                   what, WIFEXITED(status) ? "exit" : "signal",
                   WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(port));
    const bool up = connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
    close(fd);
    if (up) return;
    TOWERS_REQUIRE(std::chrono::steady_clock::now() < until, "{} did not listen on port {} in 30 s",
                   what, port);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

// CPU time of some processes, read before and after a case's timed loop: each process's
// total (clock_getcpuclockid, which counts its threads that have ended too) and each of its
// threads' (/proc/PID/task/TID/schedstat: nanoseconds on a CPU). What it gives, as counters of
// the case: the cores each side kept busy on average over the loop's wall time, and the share
// of that time its busiest thread ran. A side whose busiest thread runs close to 100% is bound
// by that thread, whatever the machine's core count; one whose threads all idle part of the
// time waits for the other side, or for the wire.
struct ThreadTimes {
  std::map<pid_t, int64_t> process;                   // process -> CPU time, ns
  std::map<std::pair<pid_t, pid_t>, int64_t> thread;  // (process, thread) -> time on a CPU, ns

  static ThreadTimes read(const std::vector<pid_t>& pids) {
    ThreadTimes t;
    for (pid_t pid : pids) {
      clockid_t clock;
      timespec ts{};
      if (clock_getcpuclockid(pid, &clock) == 0 && clock_gettime(clock, &ts) == 0)
        t.process[pid] = int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
      std::error_code ec;
      for (const auto& e :
           std::filesystem::directory_iterator(fmt::format("/proc/{}/task", pid), ec)) {
        std::ifstream f(e.path() / "schedstat");
        int64_t on_cpu = 0;
        if (f >> on_cpu)
          t.thread[{pid, static_cast<pid_t>(std::stol(e.path().filename()))}] = on_cpu;
      }
    }
    return t;
  }
  // (cores busy on average, the busiest thread's share) of `pids` from `before` to this
  // reading, over `wall` seconds; nullopt where a process could not be read both times.
  std::optional<std::pair<double, double>> since(const ThreadTimes& before,
                                                 const std::vector<pid_t>& pids,
                                                 double wall) const {
    double sum = 0, top = 0;
    for (pid_t pid : pids) {
      const auto a = before.process.find(pid), b = process.find(pid);
      if (a == before.process.end() || b == process.end()) return std::nullopt;
      sum += 1e-9 * static_cast<double>(b->second - a->second);
    }
    for (const auto& [key, now] : thread) {
      if (std::find(pids.begin(), pids.end(), key.first) == pids.end()) continue;
      const auto was = before.thread.find(key);
      const int64_t d = now - (was == before.thread.end() ? 0 : was->second);
      top = std::max(top, 1e-9 * static_cast<double>(std::max<int64_t>(d, 0)));
    }
    return std::make_pair(sum / wall, top / wall);
  }
};

// Runs a case's timed loop (`one` per iteration) and, for a cluster of shard processes, sets
// the counters of ThreadTimes: client_cores and client_top for this process (the worker),
// shard_cores and shard_top for the shard processes together (shard_top: the busiest thread
// of any of them). A side that could not be read gets no counters.
template <class One>
void timed_loop(benchmark::State& state, const std::vector<pid_t>& shards, One one) {
  const pid_t self = getpid();
  std::vector<pid_t> all = shards;
  all.push_back(self);
  const ThreadTimes before = ThreadTimes::read(all);
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) one();
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (shards.empty() || wall <= 0) return;
  const ThreadTimes after = ThreadTimes::read(all);
  if (const auto c = after.since(before, {self}, wall)) {
    state.counters["client_cores"] = c->first;
    state.counters["client_top"] = c->second;
  }
  if (const auto c = after.since(before, shards, wall)) {
    state.counters["shard_cores"] = c->first;
    state.counters["shard_top"] = c->second;
  }
}

// S shards serving one variable of n floats, and a worker's store connected to them. The
// shards are threads of this process, or (processes) `towers ps` processes.
struct Cluster {
  Children children;  // first: the last member destroyed
  std::vector<remote::ShardOptions> opts;
  std::vector<std::thread> servers;
  std::unique_ptr<ParameterLayout> layout;
  std::vector<float> params, grads;
  std::unique_ptr<Optimizer> opt;
  std::unique_ptr<remote::RemoteParameterStore> store;
  remote::RemoteConfig cfg;
  // Workers 1.. of the run (store is worker 0's, the chief's), each with its own host copy.
  struct Worker {
    std::vector<float> params;
    std::unique_ptr<Optimizer> opt;
    std::unique_ptr<remote::RemoteParameterStore> store;
  };
  std::vector<Worker> others;

  Cluster(int64_t n, int shards, bool in_processes = false, int stripes = 0,
          int64_t piece_floats = 0, bool sessions = true, int workers = 1,
          const std::string& optimizer = "sgd") {
    try {
      if (stripes > 0) cfg.stripes = stripes;
      cfg.sessions = sessions;
      cfg.piece_floats = piece_floats;
      start(n, shards, in_processes, workers, optimizer);
    } catch (...) {
      stop();
      throw;
    }
  }
  ~Cluster() { stop(); }

  void start(int64_t n, int shards, bool in_processes, int workers, const std::string& optimizer) {
    remote::Cluster c;
    for (int w = 0; w < workers; ++w) c.worker.push_back(fmt::format("127.0.0.1:{}", w + 1));
    const std::vector<int> ports = remote::free_loopback_ports(shards);
    for (int port : ports) c.ps.push_back(fmt::format("127.0.0.1:{}", port));
    cfg.cluster = c;
    if (in_processes) {
      char tmpl[] = "/tmp/remote_bench.XXXXXX";
      TOWERS_REQUIRE(mkdtemp(tmpl) != nullptr, "cannot make a directory in /tmp");
      children.dir = tmpl;
      const std::string file = children.dir + "/cluster.json";
      std::ofstream f(file);
      f << fmt::format(R"({{"cluster": {{"worker": ["{}"], "ps": ["{}"]}}}})",
                       fmt::join(c.worker, "\", \""), fmt::join(c.ps, "\", \""))
        << "\n";
      f.close();
      TOWERS_REQUIRE(f.good(), "cannot write {}", file);
      for (int i = 0; i < shards; ++i) {
        const pid_t pid = start_shard_process(file, i);
        TOWERS_REQUIRE(pid > 0, "cannot start {}/../towers ps",
                       this_binary().parent_path().string());
        children.pids.push_back(pid);
      }
      for (int i = 0; i < shards; ++i)
        wait_listening(children.pids[i], ports[i], fmt::format("towers ps (ps:{})", i));
    } else {
      opts.resize(shards);
      for (int i = 0; i < shards; ++i) {
        opts[i].cluster = c;
        opts[i].index = i;
        opts[i].token = kBenchToken;
        opts[i].quiet = true;
        servers.emplace_back([o = &opts[i]] { remote::run_shard(*o); });
      }
    }
    layout = std::make_unique<ParameterLayout>(
        std::vector<ParamSpec>{{"v/w", {n}, Init::constant(0.5f)}});
    params.assign(layout->total(), 0.5f);
    grads.assign(layout->total(), 1.0f);
    opt = std::make_unique<Optimizer>(*layout, OptimizerConfig{optimizer});
    cfg.token = kBenchToken;
    cfg.rpc_timeout = 60;
    cfg.mode = "sync";
    cfg.run_id = "bench";
    store = std::make_unique<remote::RemoteParameterStore>(cfg, *layout, params.data(), *opt,
                                                           UpdateAccess::Exclusive);
    store->initialize_shards(0);
    store->join();
    others.resize(workers - 1);
    for (int w = 1; w < workers; ++w) {
      Worker& o = others[w - 1];
      o.params.assign(layout->total(), 0.5f);
      o.opt = std::make_unique<Optimizer>(*layout, OptimizerConfig{optimizer});
      remote::RemoteConfig wc = cfg;
      wc.rank = w;
      o.store = std::make_unique<remote::RemoteParameterStore>(wc, *layout, o.params.data(), *o.opt,
                                                               UpdateAccess::Exclusive);
      o.store->join();
    }
  }
  // The store says it is done, the shards are told to shut down, and their threads joined; a
  // shard process has a few seconds to end by itself (Children).
  void stop() {
    others.clear();
    store.reset();
    for (const std::string& a : cfg.cluster.ps) {
      auto stub = remote::Shard::NewStub(remote::open_channel(a, {}));
      remote::ShutdownRequest req;
      remote::ShutdownReply rep;
      auto ctx = remote::call_context(kBenchToken, 5);
      stub->Shutdown(ctx.get(), req, &rep);
    }
    for (auto& t : servers) t.join();
    servers.clear();
    children.grace = 5.0;
  }
};

// What a case runs against (a Cluster, an AckServer), made from args, or null with the case
// skipped, saying why it could not be set up.
template <class T, class... Args>
std::unique_ptr<T> make_or_skip(benchmark::State& state, Args&&... args) {
  try {
    return std::make_unique<T>(std::forward<Args>(args)...);
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
    return nullptr;
  }
}

// The cluster of a case (BYTES, SHARDS, and for shard processes STRIPES, PIECE_KIB and
// SESSIONS), or null
// with the case skipped.
std::unique_ptr<Cluster> start_cluster(benchmark::State& state, bool in_processes) {
  const int stripes = in_processes ? static_cast<int>(state.range(2)) : 0;
  const int64_t piece_floats = in_processes ? state.range(3) * 1024 / 4 : 0;
  const bool sessions = !in_processes || state.range(4) != 0;
  return make_or_skip<Cluster>(state, state.range(0) / 4, static_cast<int>(state.range(1)),
                               in_processes, stripes, piece_floats, sessions);
}

void push_case(benchmark::State& state, bool in_processes) {
  const int64_t bytes = state.range(0);
  const std::unique_ptr<Cluster> cluster = start_cluster(state, in_processes);
  if (!cluster) return;
  Cluster& c = *cluster;
  CpuDevice host(1);
  HostUpdate on(host);
  UpdateRecord rec;
  rec.lr = 0.001f;
  // Validate: one push is one applied round, and the parameters moved by lr * grad.
  const int64_t v = c.store->push(c.grads.data(), rec, on);
  const float* p = c.store->host_params();
  if (v != 1 || rec.skipped || p[0] != 0.5f - 0.001f || p[bytes / 4 - 1] != 0.5f - 0.001f) {
    state.SkipWithError("push failed validation");
    return;
  }
  timed_loop(state, c.children.pids, [&] { c.store->push(c.grads.data(), rec, on); });
  state.SetBytesProcessed(state.iterations() * bytes);
}
void BM_Push(benchmark::State& state) { push_case(state, false); }
void BM_PushToProcesses(benchmark::State& state) { push_case(state, true); }

// Plain sync rounds from several workers (each a store of this process, on a thread of its
// own, pushing the whole gradient) to shard processes: a round is applied once every worker's
// gradient of it has arrived, piece by piece, and each worker's push ends with it. With more
// than one worker a shard also keeps each round's starting values, its parameters' and its
// optimizer slots' (README, decision 79). bytes_per_second counts every worker's gradient.
void BM_SyncRoundsToProcesses(benchmark::State& state) {
  const int64_t bytes = state.range(0);
  const int workers = static_cast<int>(state.range(2));
  const std::unique_ptr<Cluster> cluster =
      make_or_skip<Cluster>(state, bytes / 4, static_cast<int>(state.range(1)), true, 0, 0, true,
                            workers, state.range(3) != 0 ? "adam" : "sgd");
  if (!cluster) return;
  Cluster& c = *cluster;
  // Worker w's push of the next round (rank 0: the chief's store); its error, if it failed.
  auto push = [&](int w, HostUpdate& on) -> std::string {
    remote::RemoteParameterStore& s = w == 0 ? *c.store : *c.others[w - 1].store;
    UpdateRecord rec;
    rec.lr = 0.001f;
    try {
      s.push(c.grads.data(), rec, on);
    } catch (const std::exception& e) {
      return e.what();
    }
    return rec.skipped ? "a round was skipped" : "";
  };
  std::vector<std::string> errors(workers);  // each written by its worker's thread only
  // Workers 1.., a thread each: each round the chief starts, they push once; the last of them
  // done says so. Destroyed first: ends and joins them, however the case ends.
  struct Crew {
    std::mutex mu;
    std::condition_variable cv;
    int64_t started = 0;  // rounds started
    int finished = 0;     // workers 1.. done with the round started last
    bool over = false;
    std::vector<std::thread> threads;
    ~Crew() {
      {
        std::lock_guard<std::mutex> l(mu);
        over = true;
      }
      cv.notify_all();
      for (std::thread& t : threads) t.join();
    }
  } crew;
  for (int w = 1; w < workers; ++w)
    crew.threads.emplace_back([&, w] {
      CpuDevice host(1);
      HostUpdate on(host);
      for (int64_t seen = 0;;) {
        {
          std::unique_lock<std::mutex> l(crew.mu);
          crew.cv.wait(l, [&] { return crew.over || crew.started > seen; });
          if (crew.over) return;
          seen = crew.started;
        }
        if (errors[w].empty()) errors[w] = push(w, on);
        {
          std::lock_guard<std::mutex> l(crew.mu);
          ++crew.finished;
        }
        crew.cv.notify_all();
      }
    });
  CpuDevice host(1);
  HostUpdate on(host);
  // One round: every worker's push, ended; false (the case skipped, naming the worker) once one
  // has failed.
  auto round = [&] {
    {
      std::lock_guard<std::mutex> l(crew.mu);
      ++crew.started;
      crew.finished = 0;
    }
    crew.cv.notify_all();
    if (errors[0].empty()) errors[0] = push(0, on);
    std::unique_lock<std::mutex> l(crew.mu);
    crew.cv.wait(l, [&] { return crew.finished == workers - 1; });
    for (int w = 0; w < workers; ++w)
      if (!errors[w].empty()) {
        state.SkipWithError(fmt::format("worker {}: {}", w, errors[w]).c_str());
        return false;
      }
    return true;
  };
  // Validate: the first round was applied once (the optimizer's count), and it moved every
  // parameter alike (they start alike, and every gradient is ones).
  if (!round()) return;
  try {
    const float* p = c.store->host_params();
    bool alike = p[0] < 0.5f;
    for (int64_t i = 1; i < bytes / 4 && alike; ++i) alike = p[i] == p[0];
    if (c.store->version() != 1 || c.opt->updates() != 1 || !alike) {
      state.SkipWithError("the first round was not applied once to every parameter");
      return;
    }
  } catch (const std::exception& e) {
    state.SkipWithError(
        fmt::format("the chief's read after the first round: {}", e.what()).c_str());
    return;
  }
  timed_loop(state, c.children.pids, [&] { round(); });
  state.SetBytesProcessed(state.iterations() * bytes * workers);
}

void pull_case(benchmark::State& state, bool in_processes) {
  const int64_t bytes = state.range(0);
  const std::unique_ptr<Cluster> cluster = start_cluster(state, in_processes);
  if (!cluster) return;
  Cluster& c = *cluster;
  std::vector<float> dst(bytes / 4, -1.0f);  // the pull must overwrite every element
  c.store->pull_into(dst.data());
  for (int64_t i = 0; i < bytes / 4; ++i)
    if (dst[i] != 0.5f) {
      state.SkipWithError("pull failed validation");
      return;
    }
  timed_loop(state, c.children.pids, [&] { c.store->pull_into(dst.data()); });
  state.SetBytesProcessed(state.iterations() * bytes);
}
void BM_Pull(benchmark::State& state) { pull_case(state, false); }
void BM_PullFromProcesses(benchmark::State& state) { pull_case(state, true); }

void BM_TcpLoopback(benchmark::State& state) {
  const int64_t bytes = state.range(0);
  const int64_t write_size = state.range(1) > 0 ? std::min(state.range(1), bytes) : bytes;
  const int64_t read_size = state.range(2) > 0 ? std::min(state.range(2), bytes) : bytes;
  const int lfd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  bind(lfd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  getsockname(lfd, reinterpret_cast<sockaddr*>(&a), &len);
  listen(lfd, 1);
  const int cfd = socket(AF_INET, SOCK_STREAM, 0);
  connect(cfd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  const int sfd = accept(lfd, nullptr, nullptr);
  int one = 1;
  setsockopt(cfd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  setsockopt(sfd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  std::vector<char> out(bytes, 7);
  // The receiver: reads each message whole, checks its last byte, replies with one byte.
  std::atomic<bool> ok{true};
  std::thread receiver([&] {
    std::vector<char> in(bytes);
    for (;;) {
      int64_t got = 0;
      while (got < bytes) {
        const ssize_t r = read(sfd, in.data() + got, std::min(read_size, bytes - got));
        if (r <= 0) return;
        got += r;
      }
      if (in[bytes - 1] != 7) ok.store(false);
      const char ack = 1;
      if (write(sfd, &ack, 1) != 1) return;
    }
  });
  auto send_one = [&] {
    int64_t sent = 0;
    while (sent < bytes) {
      const ssize_t w = write(cfd, out.data() + sent, std::min(write_size, bytes - sent));
      if (w <= 0) return false;
      sent += w;
    }
    char ack = 0;
    return read(cfd, &ack, 1) == 1 && ack == 1;
  };
  if (!send_one() || !ok.load()) state.SkipWithError("loopback failed validation");
  for (auto _ : state)
    if (!send_one()) break;
  shutdown(cfd, SHUT_RDWR);
  receiver.join();
  close(cfd), close(sfd), close(lfd);
  state.SetBytesProcessed(state.iterations() * bytes);
}

// Acknowledges every Push, and every PushStream once its last message has arrived, without
// reading them.
class AckService final
    : public remote::Shard::WithRawCallbackMethod_Push<remote::Shard::WithRawCallbackMethod_PushStream<
          remote::Shard::WithRawCallbackMethod_PullStream<remote::Shard::Service>>> {
 public:
  // PullStream: `source` in pieces, sent from its memory without a copy.
  std::vector<char> source;
  class Send final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
   public:
    explicit Send(const std::vector<char>& src) {
      const size_t piece = remote::kDefaultPieceFloats * 4;
      for (size_t at = 0; at < src.size(); at += piece) {
        grpc::Slice s(const_cast<char*>(src.data()) + at, std::min(piece, src.size() - at),
                      grpc::Slice::STATIC_SLICE);
        out_.emplace_back(&s, 1);
      }
      StartWrite(&out_[next_++]);
    }
    void OnWriteDone(bool ok) override {
      if (ok && next_ < out_.size()) StartWrite(&out_[next_++]);
      else Finish(grpc::Status::OK);
    }
    void OnDone() override { delete this; }

   private:
    std::vector<grpc::ByteBuffer> out_;
    size_t next_ = 0;
  };
  grpc::ServerWriteReactor<grpc::ByteBuffer>* PullStream(grpc::CallbackServerContext*,
                                                         const grpc::ByteBuffer*) override {
    return new Send(source);
  }

  class Drain final : public grpc::ServerReadReactor<grpc::ByteBuffer> {
   public:
    explicit Drain(grpc::ByteBuffer* reply) : reply_(reply) { StartRead(&in_); }
    void OnReadDone(bool ok) override {
      if (ok) {
        bytes_ += static_cast<int64_t>(in_.Length());
        in_.Clear();
        StartRead(&in_);
        return;
      }
      remote::PushReply rep;
      rep.set_version(bytes_);
      *reply_ = remote::encode(rep);
      Finish(grpc::Status::OK);
    }
    void OnDone() override { delete this; }

   private:
    grpc::ByteBuffer* reply_;
    grpc::ByteBuffer in_;
    int64_t bytes_ = 0;
  };
  grpc::ServerReadReactor<grpc::ByteBuffer>* PushStream(grpc::CallbackServerContext*,
                                                        grpc::ByteBuffer* reply) override {
    return new Drain(reply);
  }
  grpc::ServerUnaryReactor* Push(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* in,
                                 grpc::ByteBuffer* out) override {
    remote::PushReply rep;
    rep.set_version(static_cast<int64_t>(in->Length()));
    *out = remote::encode(rep);
    grpc::ServerUnaryReactor* r = ctx->DefaultReactor();
    r->Finish(grpc::Status::OK);
    return r;
  }
};

// The method of a session (BM_GrpcSessionsToProcess): a bidi stream, not part of towers.proto,
// that stays open across pushes. The server acknowledges every message as it reads it, with a
// PushReply whose version is the message's length.
inline constexpr const char* kSessionMethod = "/towers.bench/Session";
class SessionService final : public grpc::CallbackGenericService {
 public:
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* ctx) override {
    if (ctx->method() != kSessionMethod) {
      class Refuse final : public grpc::ServerGenericBidiReactor {
       public:
        Refuse() { Finish(grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "")); }
        void OnDone() override { delete this; }
      };
      return new Refuse;
    }
    return new Acks;
  }

 private:
  class Acks final : public grpc::ServerGenericBidiReactor {
   public:
    Acks() { StartRead(&in_); }
    void OnReadDone(bool ok) override {
      std::lock_guard<std::mutex> l(mu_);
      if (finished_) return;
      if (!ok) {
        reads_done_ = true;
        if (!writing_) finish_locked();
        return;
      }
      due_.push_back(static_cast<int64_t>(in_.Length()));
      in_.Clear();
      if (!writing_) write_locked();
      StartRead(&in_);
    }
    void OnWriteDone(bool ok) override {
      std::lock_guard<std::mutex> l(mu_);
      writing_ = false;
      if (finished_) return;
      if (ok && !due_.empty())
        write_locked();
      else if (reads_done_ || !ok)
        finish_locked();
    }
    void OnDone() override { delete this; }

   private:
    // Once: a failed write (the client has gone) or the end of the client's messages.
    void finish_locked() {
      finished_ = true;
      Finish(grpc::Status::OK);
    }
    void write_locked() {
      remote::PushReply rep;
      rep.set_version(due_.front());
      due_.pop_front();
      out_ = remote::encode(rep);
      writing_ = true;
      StartWrite(&out_);
    }
    std::mutex mu_;
    grpc::ByteBuffer in_, out_;
    std::deque<int64_t> due_;  // lengths read, not yet acknowledged
    bool writing_ = false, reads_done_ = false, finished_ = false;
  };
};

// Validates one call, then times calls of BYTES each.
template <class Call>
void time_calls(benchmark::State& state, Call call, const char* failed) {
  if (!call()) state.SkipWithError(failed);
  for (auto _ : state)
    if (!call()) break;
  state.SetBytesProcessed(state.iterations() * state.range(0));
}

// An AckService (pull streams of `pull_bytes`) on 127.0.0.1:port (0: a free one), tuned as a
// shard is; returns its port.
int serve_acks(AckService& service, std::unique_ptr<grpc::Server>& server, int port,
               int64_t pull_bytes, SessionService* sessions = nullptr) {
  remote::keep_message_buffers();  // as every shard and worker process does
  service.source.assign(static_cast<size_t>(pull_bytes), 7);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(fmt::format("127.0.0.1:{}", port), grpc::InsecureServerCredentials(),
                           &port);
  builder.SetMaxReceiveMessageSize(remote::kMaxMessageBytes);
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);  // as a shard: one server a port
  remote::tune(builder);
  builder.RegisterService(&service);
  // (a generic service serves one server: only the ack server's own process has sessions)
  if (sessions != nullptr) builder.RegisterCallbackGenericService(sessions);
  server = builder.BuildAndStart();
  return server ? port : -1;
}

// `remote_bench --ack-server PORT PULL_BYTES`: an AckService in a process of its own, until
// it is killed (or the bench that started it ends).
int run_ack_server(int port, int64_t pull_bytes) {
  AckService service;
  SessionService sessions;
  std::unique_ptr<grpc::Server> server;
  if (serve_acks(service, server, port, pull_bytes, &sessions) != port) return 1;
  server->Wait();
  return 0;
}

// An AckService, as threads of this process or (in_process false) as a child process of this
// binary, and a channel to it.
struct AckServer {
  Children children;  // first: the last member destroyed
  AckService service;
  std::unique_ptr<grpc::Server> server;
  int port = 0;
  std::unique_ptr<grpc::GenericStub> stub_;
  grpc::GenericStub& stub;
  explicit AckServer(int64_t pull_bytes = 0, bool in_process = true)
      : stub_(start(pull_bytes, in_process)), stub(*stub_) {}
  std::unique_ptr<grpc::GenericStub> start(int64_t pull_bytes, bool in_process) {
    remote::keep_message_buffers();  // the client's side, as a worker process's
    if (in_process) {
      port = serve_acks(service, server, 0, pull_bytes);
      TOWERS_REQUIRE(port > 0, "the ack server did not start");
    } else {
      port = free_port();
      const pid_t child = start_child({this_binary().string(), "--ack-server",
                                       std::to_string(port), std::to_string(pull_bytes)},
                                      {"OPENBLAS_NUM_THREADS=1"});
      TOWERS_REQUIRE(child > 0, "cannot start {} --ack-server", this_binary().string());
      children.pids.push_back(child);
      wait_listening(child, port, "the ack server");
    }
    auto channel = remote::open_channel(fmt::format("127.0.0.1:{}", port), {});
    TOWERS_REQUIRE(channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(30)),
                   "the ack server on port {} did not answer in 30 s", port);
    return std::make_unique<grpc::GenericStub>(channel);
  }
  ~AckServer() {
    if (server) server->Shutdown(std::chrono::system_clock::now());
  }
};

void BM_GrpcUnary(benchmark::State& state) {
  const int64_t bytes = state.range(0);
  AckServer ack;
  grpc::GenericStub& stub = ack.stub;
  std::vector<char> data(bytes, 7);
  auto call = [&] {
    remote::Lender lender;
    const grpc::Slice lent = lender.lend(data.data(), data.size());
    const grpc::ByteBuffer out(&lent, 1);
    grpc::ByteBuffer in;
    grpc::ClientContext ctx;
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    grpc::Status status;
    stub.UnaryCall(&ctx, remote::kPushMethod, grpc::StubOptions(), &out, &in, [&](grpc::Status s) {
      std::lock_guard<std::mutex> l(mu);
      status = std::move(s);
      done = true;
      cv.notify_all();
    });
    std::unique_lock<std::mutex> l(mu);
    cv.wait(l, [&] { return done; });
    remote::PushReply rep;
    std::string error;
    return status.ok() && remote::decode(in, rep, &error) && rep.version() == bytes;
  };
  time_calls(state, call, "gRPC call failed validation");
}

// A client stream whose end the benchmark waits for.
struct Streaming : grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  grpc::Status status;
  void OnDone(const grpc::Status& s) override {
    std::lock_guard<std::mutex> l(mu);
    status = s;
    done = true;
    cv.notify_all();
  }
  void wait() {
    std::unique_lock<std::mutex> l(mu);
    cv.wait(l, [&] { return done; });
  }
};

// The floor of the streamed push: BYTES in messages of one piece (kDefaultPieceFloats floats)
// on one PushStream, from the caller's memory, to a server that drains them unread; with
// stripes > 1, to a server process on that many PushStreams at once, each on a TCP connection
// of its own and carrying its run of the pieces.
void grpc_stream_case(benchmark::State& state, bool in_process, int stripes = 1) {
  const int64_t bytes = state.range(0);
  std::unique_ptr<AckServer> ack_server = make_or_skip<AckServer>(state, 0, in_process);
  if (!ack_server) return;
  std::vector<std::unique_ptr<grpc::GenericStub>> more;  // stripes 1.. (0 is the server's stub)
  for (int k = 1; k < stripes; ++k) {
    auto channel = remote::open_channel(fmt::format("127.0.0.1:{}", ack_server->port), {}, k);
    TOWERS_REQUIRE(
        channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(30)),
        "the ack server on port {} did not answer in 30 s", ack_server->port);
    more.push_back(std::make_unique<grpc::GenericStub>(channel));
  }
  std::vector<char> data(bytes, 7);
  const int64_t piece = remote::kDefaultPieceFloats * 4;
  const int64_t pieces = (bytes + piece - 1) / piece;
  struct Writer final : Streaming {
    std::vector<grpc::ByteBuffer> out;
    size_t next = 0;
    grpc::ByteBuffer in;
    int64_t bytes = 0;
    void write_next() {
      const size_t i = next++;
      if (next < out.size())
        StartWrite(&out[i]);
      else
        StartWriteLast(&out[i], grpc::WriteOptions());
    }
    void OnWriteDone(bool ok) override {
      if (ok && next < out.size()) write_next();
    }
  };
  auto call = [&] {
    remote::Lender lender;
    std::vector<Writer> w(stripes);
    std::vector<grpc::ClientContext> ctx(stripes);
    for (int k = 0; k < stripes; ++k) {
      for (int64_t p = pieces * k / stripes; p < pieces * (k + 1) / stripes; ++p) {
        const int64_t at = p * piece, n = std::min(piece, bytes - at);
        const grpc::Slice lent = lender.lend(data.data() + at, n);
        w[k].out.emplace_back(&lent, 1);
        w[k].bytes += n;
      }
      grpc::GenericStub& stub = k == 0 ? ack_server->stub : *more[k - 1];
      stub.PrepareBidiStreamingCall(&ctx[k], remote::kPushStreamMethod, grpc::StubOptions(), &w[k]);
      w[k].StartRead(&w[k].in);
      w[k].write_next();
      w[k].StartCall();
    }
    bool ok = true;
    for (Writer& s : w) {
      s.wait();
      remote::PushReply rep;
      std::string error;
      ok = ok && s.status.ok() && remote::decode(s.in, rep, &error) && rep.version() == s.bytes;
    }
    return ok;
  };
  time_calls(state, call, stripes == 1 ? "gRPC stream failed validation"
                                       : "gRPC stripes failed validation");
}
// The floor of a push on sessions: BYTES in pieces (kDefaultPieceFloats floats) on STRIPES
// bidi streams to a server process, each on a connection of its own and carrying its run of
// the pieces, as grpc_stream_case; but the streams are opened once, before the timing, and a
// push ends when every piece has been acknowledged. What a call per push costs (its set-up,
// headers, trailers and reactors on both sides) is the difference to BM_GrpcStripesToProcess.
void grpc_sessions_case(benchmark::State& state) {
  const int64_t bytes = state.range(0);
  const int stripes = static_cast<int>(state.range(1));
  std::unique_ptr<AckServer> ack_server = make_or_skip<AckServer>(state, 0, false);
  if (!ack_server) return;
  std::vector<char> data(bytes, 7);
  const int64_t piece = remote::kDefaultPieceFloats * 4;
  const int64_t pieces = (bytes + piece - 1) / piece;
  // A session holds its stream open (a hold, from open() to close()): writes start from this
  // thread, outside the reactions, and gRPC frees a stream once it is over and no hold is
  // left, before OnDone; with the hold, a stream that fails stays allocated (its reads and
  // writes fail) until close().
  struct Session final : grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
    grpc::ClientContext ctx;
    std::shared_ptr<grpc::Channel> channel;  // (stripe k's, kept while the session is)
    std::unique_ptr<grpc::GenericStub> stub;
    std::vector<grpc::ByteBuffer> out;
    size_t next = 0;
    grpc::ByteBuffer in;
    std::mutex mu;
    std::condition_variable cv;
    int64_t acks_due = 0, writes_due = 0, acked_bytes = 0;
    bool broken = false;  // a read failed: the stream is over
    bool done = false;    // OnDone has run
    void open() {
      stub->PrepareBidiStreamingCall(&ctx, kSessionMethod, grpc::StubOptions(), this);
      StartRead(&in);
      AddHold();
      StartCall();
    }
    // One push's messages (at least one); the caller then waits (wait_push) before the next.
    // False, with nothing started, once the stream is broken.
    bool push(std::vector<grpc::ByteBuffer> messages) {
      {
        std::lock_guard<std::mutex> l(mu);
        if (broken || messages.empty()) return false;
        out = std::move(messages);
        next = 1;
        acks_due = writes_due = static_cast<int64_t>(out.size());
        acked_bytes = 0;
      }
      StartWrite(&out[0]);
      return true;
    }
    void OnWriteDone(bool ok) override {
      std::lock_guard<std::mutex> l(mu);
      --writes_due;
      if (ok && next < out.size()) StartWrite(&out[next++]);
      cv.notify_all();
    }
    void OnReadDone(bool ok) override {
      if (!ok) {
        std::lock_guard<std::mutex> l(mu);
        broken = true;
        cv.notify_all();
        return;
      }
      remote::PushReply rep;
      std::string error;
      const bool parsed = remote::decode(in, rep, &error);
      {
        std::lock_guard<std::mutex> l(mu);
        --acks_due;
        acked_bytes += parsed ? rep.version() : -1;
        cv.notify_all();
      }
      StartRead(&in);
    }
    void OnDone(const grpc::Status&) override {
      std::lock_guard<std::mutex> l(mu);
      done = true;
      cv.notify_all();
    }
    // The push's acknowledged bytes, or -1 if the stream broke first.
    int64_t wait_push() {
      std::unique_lock<std::mutex> l(mu);
      cv.wait(l, [&] { return broken || (acks_due == 0 && writes_due == 0); });
      return broken ? -1 : acked_bytes;
    }
    // Half-closes the session (a broken one is cancelled), lets go of the hold and waits for
    // the end (a server that does not end it within 10 s has it cancelled).
    void close() {
      bool was_broken;
      {
        std::lock_guard<std::mutex> l(mu);
        was_broken = broken;
      }
      if (was_broken)
        ctx.TryCancel();
      else
        StartWritesDone();
      RemoveHold();
      std::unique_lock<std::mutex> l(mu);
      if (cv.wait_for(l, std::chrono::seconds(10), [&] { return done; })) return;
      l.unlock();
      ctx.TryCancel();
      l.lock();
      cv.wait(l, [&] { return done; });
    }
  };
  std::vector<std::unique_ptr<Session>> sessions;
  for (int k = 0; k < stripes; ++k) {
    auto s = std::make_unique<Session>();
    s->channel = remote::open_channel(fmt::format("127.0.0.1:{}", ack_server->port), {}, k);
    s->stub = std::make_unique<grpc::GenericStub>(s->channel);
    s->open();
    sessions.push_back(std::move(s));
  }
  auto call = [&] {
    std::vector<int64_t> want(stripes, 0);
    for (int k = 0; k < stripes; ++k) {
      std::vector<grpc::ByteBuffer> messages;
      for (int64_t p = pieces * k / stripes; p < pieces * (k + 1) / stripes; ++p) {
        const int64_t at = p * piece, n = std::min(piece, bytes - at);
        grpc::Slice slice(data.data() + at, n, grpc::Slice::STATIC_SLICE);  // data outlives it
        messages.emplace_back(&slice, 1);
        want[k] += n;
      }
      if (!sessions[k]->push(std::move(messages))) want[k] = -2;  // (never equals wait_push)
    }
    bool ok = true;
    for (int k = 0; k < stripes; ++k) ok = sessions[k]->wait_push() == want[k] && ok;
    return ok;
  };
  time_calls(state, call, "gRPC sessions failed validation");
  for (auto& s : sessions) s->close();
}
void BM_GrpcSessionsToProcess(benchmark::State& state) { grpc_sessions_case(state); }

void BM_GrpcStream(benchmark::State& state) { grpc_stream_case(state, true); }
void BM_GrpcStreamToProcess(benchmark::State& state) { grpc_stream_case(state, false); }
void BM_GrpcStripesToProcess(benchmark::State& state) {
  grpc_stream_case(state, false, static_cast<int>(state.range(1)));
}

// The floor of the streamed pull: BYTES in 1 MiB messages on one PullStream, sent by the
// server from its memory without a copy, received and dropped unread.
void grpc_pull_stream_case(benchmark::State& state, bool in_process) {
  const int64_t bytes = state.range(0);
  std::unique_ptr<AckServer> ack_server = make_or_skip<AckServer>(state, bytes, in_process);
  if (!ack_server) return;
  grpc::GenericStub& stub = ack_server->stub;
  struct Reader final : Streaming {
    grpc::ByteBuffer out, in;
    int64_t got = 0;
    void OnReadDone(bool ok) override {
      if (!ok) return;
      got += static_cast<int64_t>(in.Length());
      in.Clear();
      StartRead(&in);
    }
  };
  auto call = [&] {
    Reader r;
    r.out = remote::encode(remote::PullRequest());
    grpc::ClientContext ctx;
    stub.PrepareBidiStreamingCall(&ctx, remote::kPullStreamMethod, grpc::StubOptions(), &r);
    r.StartWriteLast(&r.out, grpc::WriteOptions());
    r.StartRead(&r.in);
    r.StartCall();
    r.wait();
    return r.status.ok() && r.got >= bytes;  // (each message's bytes and its framing)
  };
  time_calls(state, call, "gRPC pull stream failed validation");
}
void BM_GrpcPullStream(benchmark::State& state) { grpc_pull_stream_case(state, true); }
void BM_GrpcPullStreamFromProcess(benchmark::State& state) { grpc_pull_stream_case(state, false); }

void BM_Memcpy(benchmark::State& state) {
  const int64_t bytes = state.range(0);
  std::vector<char> a(bytes, 1), b(bytes, 0);
  for (auto _ : state) {
    std::memcpy(b.data(), a.data(), bytes);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * bytes);
}

void sizes(benchmark::internal::Benchmark* b, bool shards) {
  for (int64_t s : {64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20})
    if (shards)
      for (int k : {1, 2, 4}) b->Args({s, k});
    else
      b->Arg(s);
  b->UseRealTime()->MinTime(0.3);
}

// The raw TCP variants (WRITE, READ): whole-message calls, and the call sizes of a tuned
// streaming program (iperf3 writes 128 KiB by default).
void tcp_variants(benchmark::internal::Benchmark* b) {
  for (int64_t s : {64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20})
    for (auto [w, r] : {std::pair<int64_t, int64_t>{0, 0}, {128 << 10, 128 << 10},
                        {256 << 10, 64 << 10}, {1 << 20, 128 << 10}})
      b->Args({s, w, r});
  b->UseRealTime()->MinTime(0.3);
}

BENCHMARK(BM_Push)->Apply([](auto* b) { sizes(b, true); });
BENCHMARK(BM_Pull)->Apply([](auto* b) { sizes(b, true); });
// Shard processes: 4 MiB (the shares of raw TCP) in 1, 2 and 4 stripes a shard, and 64 MiB in
// one stream a shard and in the default stripes.
std::vector<std::vector<int64_t>> process_cases() {
  const int64_t piece = remote::kDefaultPieceFloats * 4 / 1024;
  std::vector<std::vector<int64_t>> cases;
  for (int64_t k : {1, 2, 4})
    for (int64_t stripes : {1, 2, 4}) cases.push_back({4 << 20, k, stripes, piece});
  // One shard's range in 16 pieces, 4 a stripe: each stripe's pieces are taken (copied and
  // applied, or copied into the worker's array) while the stripe's next piece is on the wire.
  cases.push_back({4 << 20, 1, 4, 256});
  for (int64_t k : {1, 2, 4}) {
    cases.push_back({64 << 20, k, 1, piece});
    cases.push_back({64 << 20, k, remote::RemoteConfig().stripes, piece});
  }
  return cases;
}
// The same on sessions (the default) and, at 4 MiB in 1 MiB pieces in 1 or 4 stripes, also on
// a call each.
void with_sessions(benchmark::internal::Benchmark* b) {
  for (std::vector<int64_t> a : process_cases()) {
    a.push_back(1);
    b->Args(a);
    if (a[0] == 4 << 20 && a[3] == remote::kDefaultPieceFloats * 4 / 1024 &&
        (a[2] == 1 || a[2] == 4)) {
      a.back() = 0;
      b->Args(a);
    }
  }
  b->UseRealTime()->MinTime(0.3);
}
BENCHMARK(BM_PushToProcesses)->Apply(with_sessions);
BENCHMARK(BM_PullFromProcesses)->Apply(with_sessions);
// 4 MiB to 1 and 2 shard processes, from 1 and 2 workers, with sgd and adam (whose two slots
// a shard keeps too).
BENCHMARK(BM_SyncRoundsToProcesses)
    ->ArgsProduct({{4 << 20}, {1, 2}, {1, 2}, {0, 1}})
    ->UseRealTime()
    ->MinTime(0.3);
BENCHMARK(BM_TcpLoopback)->Apply(tcp_variants);
BENCHMARK(BM_GrpcUnary)->Apply([](auto* b) { sizes(b, false); });
BENCHMARK(BM_GrpcStream)->Apply([](auto* b) { sizes(b, false); });
BENCHMARK(BM_GrpcPullStream)->Apply([](auto* b) { sizes(b, false); });
// The floors with the server in a process of its own, as a shard is: 4 and 64 MiB.
void process_floors(benchmark::internal::Benchmark* b) {
  b->Arg(4 << 20)->Arg(64 << 20)->UseRealTime()->MinTime(0.3);
}
BENCHMARK(BM_GrpcStreamToProcess)->Apply(process_floors);
BENCHMARK(BM_GrpcStripesToProcess)
    ->Args({4 << 20, 2})
    ->Args({4 << 20, 4})
    ->UseRealTime()
    ->MinTime(0.3);
BENCHMARK(BM_GrpcSessionsToProcess)
    ->Args({4 << 20, 1})
    ->Args({4 << 20, 2})
    ->Args({4 << 20, 4})
    ->UseRealTime()
    ->MinTime(0.3);
BENCHMARK(BM_GrpcPullStreamFromProcess)->Apply(process_floors);
BENCHMARK(BM_Memcpy)->Apply([](auto* b) { sizes(b, false); });

}  // namespace

int main(int argc, char** argv) {
  if (argc == 4 && std::string_view(argv[1]) == "--ack-server")
    return run_ack_server(std::atoi(argv[2]), std::atoll(argv[3]));
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
