// remote_test.cpp — remote tower groups (towers/remote/): the cluster file, the shard ranges,
// the optimizer of a range, and whole clusters of real processes on 127.0.0.1: bitwise sync
// equivalence with one process, a rejected token, loopback-only shards, a killed worker in
// async and in sync mode.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>

#include <fmt/format.h>
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "cli_util.h"
#include "core/check.h"
#include "io/checkpoint.h"
#include "optim/optimizer.h"
#include "towers/remote/cluster.h"
#include "towers/remote/reader.h"
#include "towers/remote/remote_store.h"
#include "towers/remote/shard_server.h"
#include "towers/remote/shard_set.h"
#include "towers/remote/towers.grpc.pb.h"
#include "towers/remote/wire.h"

namespace towers {
namespace {

using testutil::live_metrics_events;
using testutil::metrics_events;
using testutil::run_towers;
using testutil::test_path;
using testutil::towers_binary;

std::string write_file(const std::string& name, const std::string& text) {
  const std::string p = test_path(name);
  std::ofstream(p) << text;
  return p;
}

// ---- the cluster file -----------------------------------------------------------------------

TEST(RemoteCluster, ReadsTheTfConfigLayout) {
  const std::string f = write_file("c.json", R"({"cluster": {"chief": ["a:1"], "worker": ["b:2", "c:3"],
      "ps": ["d:4", "e:5"]}, "task": {"type": "worker", "index": 1}})");
  const remote::ClusterTask ct = remote::read_cluster(f, "");
  EXPECT_EQ(ct.cluster.workers(), 3);
  EXPECT_EQ(ct.cluster.ps.size(), 2u);
  ASSERT_TRUE(ct.task_given);
  EXPECT_EQ(ct.task.rank(ct.cluster), 2);  // the chief is rank 0, worker i is i + 1
  EXPECT_FALSE(ct.task.is_chief(ct.cluster));
  // --task overrides the file's task.
  EXPECT_EQ(remote::read_cluster(f, "chief").task.rank(ct.cluster), 0);
  // Without a chief entry, worker 0 is the chief.
  const std::string g = write_file("g.json", R"({"cluster": {"worker": ["b:2"], "ps": ["d:4"]}})");
  const remote::ClusterTask w = remote::read_cluster(g, "worker:0");
  EXPECT_TRUE(w.task.is_chief(w.cluster));
}

TEST(RemoteCluster, TfConfigEnvironmentWorksInPlaceOfTheFile) {
  ::setenv("TF_CONFIG", R"({"cluster": {"worker": ["h:1", "h:2"], "ps": ["h:3"]}, "task": {"type": "ps", "index": 0}})", 1);
  EXPECT_TRUE(remote::cluster_requested(""));
  const remote::ClusterTask ct = remote::read_cluster("", "");
  ::unsetenv("TF_CONFIG");
  EXPECT_EQ(ct.cluster.origin, "TF_CONFIG");
  EXPECT_EQ(ct.task.type, "ps");
  EXPECT_EQ(ct.task.rank(ct.cluster), -1);
  EXPECT_FALSE(remote::cluster_requested(""));
}

// Each bad cluster file gets an error naming the file and what is wrong.
TEST(RemoteCluster, BadFilesAreNamed) {
  struct Case {
    const char* text;
    const char* task;
    const char* says;
  } cases[] = {
      {"{", "", "not valid JSON"},
      {R"({"worker": ["a:1"]})", "", "no \"cluster\" object"},
      {R"({"cluster": {"worker": ["a:1"]}})", "", "cluster.ps is empty"},
      {R"({"cluster": {"ps": ["a:1"]}})", "", "no chief and no worker"},
      {R"({"cluster": {"worker": ["a:1"], "ps": ["b"]}})", "", "cluster.ps[0] is 'b', not host:port"},
      {R"({"cluster": {"worker": ["a:1"], "ps": ["b:70000"]}})", "", "not host:port"},
      {R"({"cluster": {"worker": [1], "ps": ["b:1"]}})", "", "cluster.worker[0] must be"},
      {R"({"cluster": {"workers": ["a:1"], "ps": ["b:1"]}})", "", "unknown role cluster.workers"},
      {R"({"cluster": {"worker": ["a:1"], "ps": ["b:1"]}})", "worker:3", "has 1 worker entry"},
      {R"({"cluster": {"worker": ["a:1"], "ps": ["b:1"]}})", "boss:0", "must be chief, worker or ps"},
      {R"({"cluster": {"worker": ["a:1"], "ps": ["b:1"]}})", "worker:x", "must be a number"},
  };
  for (const Case& c : cases) {
    const std::string f = write_file("bad.json", c.text);
    try {
      remote::read_cluster(f, c.task);
      ADD_FAILURE() << "accepted: " << c.text;
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(c.says), std::string::npos) << msg;
      if (std::string(c.task).empty()) EXPECT_NE(msg.find(f), std::string::npos) << msg;
    }
  }
  EXPECT_THROW(remote::read_cluster(test_path("missing.json"), ""), Error);
}

TEST(RemoteCluster, TokenComesFromTheFileOrTheEnvironment) {
  const std::string f = write_file("token", "s3cret\n");
  EXPECT_EQ(remote::read_token(f), "s3cret");
  ::setenv("TOWERS_TOKEN", "fromenv", 1);
  EXPECT_EQ(remote::read_token(""), "fromenv");
  ::unsetenv("TOWERS_TOKEN");
  EXPECT_THROW(remote::read_token(""), Error);
  EXPECT_THROW(remote::read_token(write_file("empty", "\n")), Error);
  const std::string a = remote::fresh_token(), b = remote::fresh_token();
  EXPECT_EQ(a.size(), 64u);
  EXPECT_NE(a, b);
}

// A token file that others can read, and a short token, are taken, with a warning that says
// what to do; a private file of a long token gets none.
TEST(RemoteCluster, AReadableTokenFileOrAShortTokenIsWarnedOf) {
  const std::string token(64, 'a');
  const std::string f = write_file("token", token + "\n");
  ASSERT_EQ(::chmod(f.c_str(), 0600), 0);
  testing::internal::CaptureStderr();
  EXPECT_EQ(remote::read_token(f), token);
  std::string said = testing::internal::GetCapturedStderr();
  EXPECT_EQ(said.find("warning"), std::string::npos) << said;
  ASSERT_EQ(::chmod(f.c_str(), 0620), 0);  // (others may write it, not read it)
  testing::internal::CaptureStderr();
  EXPECT_EQ(remote::read_token(f), token);
  said = testing::internal::GetCapturedStderr();
  EXPECT_EQ(said.find("warning"), std::string::npos) << said;
  ASSERT_EQ(::chmod(f.c_str(), 0644), 0);
  testing::internal::CaptureStderr();
  EXPECT_EQ(remote::read_token(f), token);
  said = testing::internal::GetCapturedStderr();
  EXPECT_NE(said.find("the token file '" + f + "' can be read by other users"), std::string::npos)
      << said;
  EXPECT_NE(said.find("(mode 0644)"), std::string::npos) << said;
  EXPECT_NE(said.find("chmod 600"), std::string::npos) << said;
  EXPECT_EQ(said.find("few enough to guess"), std::string::npos) << said;
  ::setenv("TOWERS_TOKEN", "short", 1);
  testing::internal::CaptureStderr();
  EXPECT_EQ(remote::read_token(""), "short");
  said = testing::internal::GetCapturedStderr();
  ::unsetenv("TOWERS_TOKEN");
  EXPECT_NE(said.find("the token (TOWERS_TOKEN) has 5 characters, few enough to guess"),
            std::string::npos)
      << said;
}

// Ranges cover the array in order, cut at 16-float boundaries, and differ by at most one block.
TEST(RemoteCluster, ShardRangesAreBalancedByBytes) {
  for (int64_t total : {int64_t{0}, int64_t{16}, int64_t{1000}, int64_t{1384592}})
    for (int shards : {1, 2, 3, 4, 7}) {
      const auto r = remote::shard_ranges(total, shards);
      ASSERT_EQ(static_cast<int>(r.size()), shards);
      EXPECT_EQ(r.front().begin, 0);
      EXPECT_EQ(r.back().end, total);
      int64_t lo = total, hi = 0;
      for (int s = 0; s < shards; ++s) {
        if (s > 0) EXPECT_EQ(r[s].begin, r[s - 1].end);
        if (r[s].end < total) EXPECT_EQ(r[s].end % 16, 0);
        lo = std::min(lo, r[s].size()), hi = std::max(hi, r[s].size());
      }
      EXPECT_LE(hi - lo, 16) << total << " over " << shards;
    }
}

TEST(RemoteCluster, LayoutHashNamesTheLayout) {
  const ParameterLayout a({{"l/w", {4, 3}, Init::constant(0)}, {"l/b", {4}, Init::constant(0)}});
  const ParameterLayout b({{"l/w", {3, 4}, Init::constant(0)}, {"l/b", {4}, Init::constant(0)}});
  const ParameterLayout c({{"l/w", {4, 3}, Init::constant(0)}, {"l/c", {4}, Init::constant(0)}});
  EXPECT_EQ(remote::layout_hash(a), remote::layout_hash(a));
  EXPECT_NE(remote::layout_hash(a), remote::layout_hash(b));
  EXPECT_NE(remote::layout_hash(a), remote::layout_hash(c));
}

// A shard's optimizer applies the rule to its range only, cutting variables where the range
// does: the ranges together give bitwise the update of the whole array.
TEST(RemoteOptimizer, RangesTogetherEqualTheWholeArray) {
  const ParameterLayout layout({{"a/w", {37, 29}, Init::constant(0), 0.01f},
                                {"a/b", {37}, Init::constant(0)},
                                {"s/mean", {5}, Init::constant(0), 0.0f, false},
                                {"b/w", {300}, Init::constant(0), 0.002f}});
  for (const char* name : {"momentum", "adam", "rmsprop", "adagrad"}) {
    std::mt19937 rng(7);
    std::normal_distribution<float> n(0.0f, 1.0f);
    std::vector<float> p(layout.total()), g(layout.total());
    for (auto& x : p) x = n(rng);
    Optimizer whole(layout, {name});
    std::vector<float> expect = p;
    for (int step = 0; step < 3; ++step) {
      for (auto& x : g) x = n(rng);
      whole.apply(expect.data(), g.data(), 0.05f);
    }
    // Again, range by range, with the same gradients.
    std::mt19937 rng2(7);
    std::normal_distribution<float> n2(0.0f, 1.0f);
    for (auto& x : p) x = n2(rng2);
    std::vector<float> got = p;
    const auto ranges = remote::shard_ranges(layout.total(), 3);
    std::vector<std::unique_ptr<Optimizer>> parts;
    for (const auto& r : ranges) parts.push_back(std::make_unique<Optimizer>(layout, OptimizerConfig{name}, r.begin, r.end));
    for (int step = 0; step < 3; ++step) {
      for (auto& x : g) x = n2(rng2);
      for (size_t s = 0; s < ranges.size(); ++s)
        parts[s]->apply(got.data() + ranges[s].begin, g.data() + ranges[s].begin, 0.05f);
    }
    EXPECT_EQ(0, std::memcmp(got.data(), expect.data(), sizeof(float) * got.size())) << name;
  }
}

// A sync shard applies a round piece by piece as the gradient arrives (Optimizer::apply_piece):
// pieces in any order, cutting variables anywhere, give bitwise apply()'s update, with the
// running averages of state variables and both wrappers (EMA, Lookahead) included.
TEST(RemoteOptimizer, PiecesInAnyOrderEqualOneApply) {
  const ParameterLayout layout({{"a/w", {37, 29}, Init::constant(0), 0.01f},
                                {"a/b", {37}, Init::constant(0)},
                                {"s/mean", {5}, Init::constant(0), 0.0f, false, 0.1f},
                                {"b/w", {300}, Init::constant(0), 0.002f}});
  const auto ranges = remote::shard_ranges(layout.total(), 2);
  const remote::Range r = ranges[1];  // a range that starts inside a variable
  for (const char* name : {"sgd", "momentum", "adam", "rmsprop", "adagrad"}) {
    OptimizerConfig c{name};
    c.ema = 0.9;
    c.lookahead_k = 2;
    std::mt19937 rng(11);
    std::normal_distribution<float> n(0.0f, 1.0f);
    std::vector<float> p(r.size());
    for (auto& x : p) x = n(rng);
    std::vector<float> got = p;
    Optimizer whole(layout, c, r.begin, r.end), pieced(layout, c, r.begin, r.end);
    std::vector<float> g(r.size());
    for (int step = 0; step < 4; ++step) {
      for (auto& x : g) x = n(rng);
      whole.apply(p.data(), g.data(), 0.05f);
      const int64_t t = pieced.begin_pieces();
      // Pieces of 97 floats, last to first.
      for (int64_t hi = r.size(); hi > 0; hi = std::max<int64_t>(0, hi - 97)) {
        const int64_t lo = std::max<int64_t>(0, hi - 97);
        pieced.apply_piece(got.data(), g.data() + lo, lo, hi, 0.05f, t);
      }
    }
    EXPECT_EQ(0, std::memcmp(got.data(), p.data(), sizeof(float) * p.size())) << name;
    EXPECT_EQ(pieced.updates(), whole.updates());
    for (size_t s = 0; s < whole.slots().size(); ++s)
      EXPECT_EQ(0, std::memcmp(whole.slots()[s].second, pieced.slots()[s].second,
                               sizeof(float) * p.size())) << name << " slot " << whole.slots()[s].first;
  }
}

// ---- one shard in this process: what its Push and PushStream refuse ---------------------------

// A sync shard of one worker serving one variable of n floats in pieces of `piece`, and the
// worker's store, joined.
// The error of a PushStream of these messages to the shard at `address` (empty: it
// succeeded, and its reply is in *reply if asked for).
std::string push_stream(const std::string& address, const std::string& token,
                        std::vector<grpc::ByteBuffer> messages, double timeout,
                        remote::PushReply* reply = nullptr) {
  remote::ShardSet shards({address}, token, {});
  std::vector<remote::PushReply> reps;
  try {
    shards.push_streams({std::move(messages)}, reps, timeout);
  } catch (const std::exception& e) {
    return e.what();
  }
  if (reply) *reply = reps.at(0);
  return "";
}

struct OneShard {
  // One a shard (ps:i), each on a thread of its own; running[i]: that thread has not
  // returned yet.
  std::vector<remote::ShardOptions> opts;
  std::vector<std::thread> servers;
  std::unique_ptr<std::atomic<bool>[]> running;
  ParameterLayout layout;
  std::vector<float> params;
  Optimizer opt;
  std::unique_ptr<remote::RemoteParameterStore> store;
  remote::RemoteConfig cfg;

  // workers: the run's (this store is worker 0; the others call only where a test does).
  // shards: ps:0 holds the whole range unless there are more.
  OneShard(int64_t n, int64_t piece, const std::string& checkpoint_dir = "",
           const std::string& mode = "sync", int stripes = 1, bool sessions = true, int workers = 1,
           double rpc_timeout = 30, const std::string& optimizer = "sgd",
           double heartbeat_timeout = 10, int shards = 1)
      : running(new std::atomic<bool>[shards]),
        layout({{"v/w", {n}, Init::constant(0.5f)}}),
        params(layout.total(), 0.5f),
        opt(layout, OptimizerConfig{optimizer}) {
    remote::Cluster c;
    for (int w = 0; w < workers; ++w) c.worker.push_back(fmt::format("127.0.0.1:{}", w + 1));
    for (int port : remote::free_loopback_ports(shards))
      c.ps.push_back(fmt::format("127.0.0.1:{}", port));
    opts.resize(shards);
    for (int i = 0; i < shards; ++i) {
      opts[i].cluster = c;
      opts[i].index = i;
      opts[i].token = "t";
      opts[i].quiet = true;
      opts[i].checkpoint_dir = checkpoint_dir;
    }
    cfg.cluster = c;
    cfg.token = "t";
    cfg.rpc_timeout = rpc_timeout;
    cfg.heartbeat_timeout = heartbeat_timeout;
    cfg.run_id = "test";
    cfg.piece_floats = piece;
    cfg.mode = mode;
    cfg.stripes = stripes;
    cfg.sessions = sessions;
    start();
    try {
      store = std::make_unique<remote::RemoteParameterStore>(
          cfg, layout, params.data(), opt,
          mode == "sync" ? UpdateAccess::Exclusive : UpdateAccess::Concurrent);
      store->initialize_shards(0);
      store->join();
    } catch (...) {  // (the shards' threads are joined before the fixture is abandoned)
      store.reset();
      shut_down();
      throw;
    }
  }
  ~OneShard() {
    store.reset();
    shut_down();
  }
  // The shards, each on a thread of its own (again, after shut_down).
  void start() {
    servers.clear();
    for (size_t i = 0; i < opts.size(); ++i) {
      running[i] = true;
      servers.emplace_back([this, i] {
        remote::run_shard(opts[i]);
        running[i] = false;
      });
    }
  }
  // Asks each shard to exit, unless it has already (every worker done), and waits until it
  // has. A shard whose thread has just started may not listen yet: the call is made again
  // until it is taken.
  void shut_down() {
    for (size_t i = 0; i < opts.size(); ++i) {
      auto stub = remote::Shard::NewStub(remote::open_channel(cfg.cluster.ps[i], {}));
      while (running[i]) {
        remote::ShutdownRequest req;
        remote::ShutdownReply rep;
        auto ctx = remote::call_context("t", 5);
        if (stub->Shutdown(ctx.get(), req, &rep).ok()) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
      servers[i].join();
    }
  }
  // A Restore call (towers.proto) to the shard.
  grpc::Status restore(int64_t version, int64_t generation, remote::RestoreReply* rep,
                       double timeout = 10) {
    remote::ShardSet shards(cfg.cluster.ps, "t", {});
    remote::RestoreRequest req;
    req.set_layout_hash(remote::layout_hash(layout));
    req.set_version(version);
    req.set_generation(generation);
    auto ctx = remote::call_context("t", timeout);
    ctx->set_wait_for_ready(true);
    return shards.stub(0).Restore(ctx.get(), req, rep);
  }
  // This worker's push of a gradient of ones at lr 1 (sgd: every parameter goes down by 1).
  int64_t push_ones() {
    const std::vector<float> g(layout.total(), 1.0f);
    CpuDevice host(1);
    HostUpdate on(host);
    UpdateRecord rec;
    rec.lr = 1.0f;
    rec.examples = 1;
    rec.contributors = 1;
    return store->push(g.data(), rec, on);
  }
  // The shard stopped and started again with the same options: it restores its latest
  // checkpoint.
  void restart() {
    shut_down();
    start();
  }
  // The small fields of this worker's push of round 0.
  remote::PushRequest head() const {
    remote::PushRequest r;
    r.set_layout_hash(remote::layout_hash(layout));
    r.set_round(0);
    r.set_lr(1.0f);
    r.set_examples(1);
    r.set_towers(1);
    return r;
  }
  // The error of a PushStream of these messages to ps:shard (empty: it succeeded).
  std::string push(std::vector<grpc::ByteBuffer> messages, int shard = 0) {
    return push_stream(cfg.cluster.ps[shard], "t", std::move(messages), 10);
  }
};

grpc::ByteBuffer piece(remote::PushRequest head, int64_t offset, const std::vector<float>& g,
                       int64_t lo, int64_t hi) {
  head.set_offset(offset);
  const grpc::Slice s(g.data() + lo, sizeof(float) * static_cast<size_t>(hi - lo));
  return remote::encode(head, remote::PushRequest::kGradsFieldNumber, &s);
}

// A PushStream must send whole pieces, in order, within the range; a unary Push the whole
// range. A message that does not is refused before any of its floats is taken: as the first
// message of a push, the parameters stay as they were. The pieces a stream delivered before it
// broke off stay counted in the round, so the same push sent again completes the round, with
// each piece applied once.
TEST(RemoteShard, PushesOffTheRangeOrItsPiecesAreRefusedNotApplied) {
  OneShard s(1024, 300);  // pieces [0, 300) [300, 600) [600, 900) [900, 1024)
  ASSERT_EQ(s.layout.total(), 1024);
  ASSERT_EQ(s.store->piece_floats(), 300);
  const std::vector<float> g(1400, 1.0f);
  const remote::PushRequest h = s.head();
  auto unchanged = [&] {
    const float* p = s.store->host_params();
    for (int i = 0; i < 1024; ++i)
      if (p[i] != 0.5f) return false;
    return s.store->version() == 0;
  };
  // Beyond the range, a piece cut short, not starting at float 0, another layout.
  EXPECT_NE(s.push({piece(h, 0, g, 0, 1400)}).find("refused, not applied"), std::string::npos);
  EXPECT_NE(s.push({piece(h, 0, g, 0, 200)}).find("pieces of 300"), std::string::npos);
  EXPECT_NE(s.push({piece(h, 300, g, 0, 300)}).find("from float 0"), std::string::npos);
  remote::PushRequest other = h;
  other.set_layout_hash(h.layout_hash() + 1);
  EXPECT_NE(s.push({piece(other, 0, g, 0, 300)}).find("layout hash"), std::string::npos);
  EXPECT_TRUE(unchanged());
  // A unary Push of the wrong size.
  {
    remote::ShardSet shards(s.cfg.cluster.ps, "t", {});
    remote::PushRequest r = h;
    r.set_grads(std::string(4 * 1023, '\0'));
    remote::PushReply rep;
    auto ctx = remote::call_context("t", 10);
    const grpc::Status st = shards.stub(0).Push(ctx.get(), r, &rep);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(st.error_message().find("refused, not applied"), std::string::npos) << st.error_message();
  }
  EXPECT_TRUE(unchanged());
  // A stream that skips a piece: refused at the second message.
  EXPECT_NE(s.push({piece(h, 0, g, 0, 300), piece(h, 600, g, 0, 300)}).find("from float 300"),
            std::string::npos);
  // A message that is not a PushRequest at all (a field of wire type 7) is refused in its
  // turn: after the messages before it were taken, and after their refusals. The shard reads
  // on while it takes the messages, so the junk is received while the piece before it may
  // still be being taken; the error must still be the stream's first.
  {
    const std::string junk = "\x0f\xff\xff\xff";
    const grpc::Slice js(junk.data(), junk.size());
    for (int i = 0; i < 20; ++i) {
      std::string e = s.push({piece(h, 0, g, 0, 300), grpc::ByteBuffer(&js, 1)});
      EXPECT_NE(e.find("PushStream: not a towers.remote.PushRequest"), std::string::npos) << e;
      e = s.push({piece(h, 0, g, 0, 300), piece(h, 600, g, 0, 300), grpc::ByteBuffer(&js, 1)});
      EXPECT_NE(e.find("from float 300"), std::string::npos) << e;
    }
  }
  // The whole gradient again, in pieces of one and two: the round is applied once (sgd, lr 1).
  EXPECT_EQ(s.push({piece(h, 0, g, 0, 300), piece(h, 300, g, 0, 600), piece(h, 900, g, 0, 124)}),
            "");
  const float* p = s.store->host_params();
  for (int i = 0; i < 1024; ++i) ASSERT_EQ(p[i], -0.5f) << i;
  EXPECT_EQ(s.store->version(), 1);
}

// A striped push (wire.h, kStripeKey): each stripe must say which it is, carry its own run of
// pieces and only those, and come once; the stripe that ends last ends the push, the others
// reply `partial`. A stripe that fails fails its push, whose other stripes then fail too; the
// pieces taken stay counted in the round, as a broken stream's do, so the push sent again
// completes it with every piece applied once.
TEST(RemoteShard, StripesOfAPushAreCheckedAndEndTogether) {
  OneShard s(1024, 300);  // pieces [0, 300) [300, 600) [600, 900) [900, 1024)
  const std::vector<float> g(1024, 1.0f);
  remote::PushRequest h = s.head();
  // One stripe's PushStream through the generated stub: its status, and its reply.
  auto stripe = [&](const std::string& meta, std::vector<std::pair<int64_t, int64_t>> pieces) {
    remote::ShardSet shards(s.cfg.cluster.ps, "t", {});
    auto ctx = remote::call_context("t", 10);
    ctx->AddMetadata(remote::kStripeKey, meta);
    remote::PushReply rep;
    auto w = shards.stub(0).PushStream(ctx.get(), &rep);
    for (auto [lo, hi] : pieces) {
      remote::PushRequest m = h;
      m.set_offset(lo);
      m.set_grads(std::string(reinterpret_cast<const char*>(g.data() + lo),
                              sizeof(float) * static_cast<size_t>(hi - lo)));
      if (!w->Write(m)) break;
    }
    w->WritesDone();
    const grpc::Status st = w->Finish();
    return std::make_pair(st, rep);
  };
  auto refused = [](const std::pair<grpc::Status, remote::PushReply>& r, const std::string& says) {
    return r.first.error_code() == grpc::StatusCode::INVALID_ARGUMENT &&
           r.first.error_message().find(says) != std::string::npos;
  };
  const std::pair<int64_t, int64_t> p0{0, 300}, p1{300, 600}, p2{600, 900}, p3{900, 1024};
  auto r = stripe("7 zero 2", {p0, p1});
  EXPECT_TRUE(refused(r, "metadata 'towers-stripe': '7 zero 2' is not")) << r.first.error_message();
  r = stripe("17 0 5", {p0});
  EXPECT_TRUE(refused(r, "5 stripes of a range of 4 piece(s)")) << r.first.error_message();
  r = stripe("27 2 2", {p0});
  EXPECT_TRUE(refused(r, "is not \"ID K S\" with 0 <= K < S")) << r.first.error_message();
  // Stripe 0 of 2 carries [0, 600); stripe 1 [600, 1024). (Refused at its first message:
  // nothing of it is taken.)
  r = stripe("37 0 2", {p1});
  EXPECT_TRUE(refused(r, "from float 0 to 600 (stripe 0 of 2)")) << r.first.error_message();
  // A unary Push is not a stripe.
  {
    remote::ShardSet shards(s.cfg.cluster.ps, "t", {});
    auto ctx = remote::call_context("t", 10);
    ctx->AddMetadata(remote::kStripeKey, "5 0 2");
    remote::PushRequest whole = h;
    whole.set_grads(std::string(reinterpret_cast<const char*>(g.data()), sizeof(float) * 1024));
    remote::PushReply rep;
    const grpc::Status st = shards.stub(0).Push(ctx.get(), whole, &rep);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(st.error_message().find("only a PushStream is a stripe"), std::string::npos)
        << st.error_message();
  }
  // A push in two stripes: the first to end replies partial, the last ends the push.
  r = stripe("8 1 2", {p2, p3});
  ASSERT_TRUE(r.first.ok()) << r.first.error_message();
  EXPECT_TRUE(r.second.partial());
  r = stripe("8 1 2", {p2, p3});
  EXPECT_TRUE(refused(r, "stripe 1 of 2 of push 8 does not match")) << r.first.error_message();
  EXPECT_TRUE(refused(r, "that stripe came before")) << r.first.error_message();
  r = stripe("8 0 2", {p0, p1});
  ASSERT_TRUE(r.first.ok()) << r.first.error_message();
  EXPECT_FALSE(r.second.partial());
  EXPECT_EQ(r.second.version(), 1);
  EXPECT_TRUE(r.second.applied());
  const float* p = s.store->host_params();
  for (int i = 0; i < 1024; ++i) ASSERT_EQ(p[i], -0.5f) << i;
  // Round 1. A stripe that carries more than its run is refused at the piece beyond it, after
  // the pieces before it were taken (they stay in the round, as a broken stream's do).
  h.set_round(1);
  r = stripe("47 0 2", {p0, p1, p2});
  EXPECT_TRUE(refused(r, "from float 600 to 600 (stripe 0 of 2)")) << r.first.error_message();
  // Stripe 0 ends short, which fails the push; stripe 1 then fails with it.
  r = stripe("9 0 2", {p0});
  EXPECT_TRUE(refused(r, "stripe 0 of 2 of round 1 ended after 300 of its floats [0, 600)"))
      << r.first.error_message();
  r = stripe("9 1 2", {p2, p3});
  EXPECT_FALSE(r.first.ok());
  EXPECT_NE(r.first.error_message().find("another stripe of worker 0's push of round 1 failed"),
            std::string::npos)
      << r.first.error_message();
  // Sent again whole, as a new push: every piece applied once.
  r = stripe("10 1 2", {p2, p3});
  ASSERT_TRUE(r.first.ok()) << r.first.error_message();
  r = stripe("10 0 2", {p0, p1});
  ASSERT_TRUE(r.first.ok()) << r.first.error_message();
  EXPECT_EQ(r.second.version(), 2);
  p = s.store->host_params();
  for (int i = 0; i < 1024; ++i) ASSERT_EQ(p[i], -1.5f) << i;
}

// A PushSession carries a worker's pushes one after another, each ended by its message with
// `ends` and answered on the session; in stripes too, each stripe on a session of its own. A
// push that is refused ends its session with the refusal, and a session that ends inside a
// push fails it (its pieces stay in the round, as a broken PushStream's do).
TEST(RemoteShard, SessionsCarryPushAfterPushAndEndOnARefusal) {
  OneShard s(1024, 300);  // pieces [0, 300) [300, 600) [600, 900) [900, 1024)
  const std::vector<float> g(1024, 1.0f);
  remote::ShardSet shards(s.cfg.cluster.ps, "t", {});
  struct Session {
    std::unique_ptr<grpc::ClientContext> ctx;
    std::unique_ptr<grpc::ClientReaderWriter<remote::PushRequest, remote::PushReply>> rw;
  };
  auto open = [&](const std::string& stripe_metadata = "") {
    Session o{remote::call_context("t", 30), nullptr};
    if (!stripe_metadata.empty()) o.ctx->AddMetadata(remote::kStripeKey, stripe_metadata);
    o.rw = shards.stub(0).PushSession(o.ctx.get());
    return o;
  };
  using Pieces = std::vector<std::pair<int64_t, int64_t>>;
  // Push `id` of round `round`, stripe k of n: its pieces, the last one with `ends`.
  auto send = [&](Session& o, int64_t round, uint64_t id, int k, int n, const Pieces& pieces,
                  int64_t timeout_ms = 10000, bool ends = true) {
    for (size_t j = 0; j < pieces.size(); ++j) {
      remote::PushRequest m = s.head();
      m.set_round(round);
      m.set_push(id);
      m.set_stripe(k);
      m.set_stripes(n);
      m.set_timeout_ms(timeout_ms);
      m.set_offset(pieces[j].first);
      m.set_grads(
          std::string(reinterpret_cast<const char*>(g.data() + pieces[j].first),
                      sizeof(float) * static_cast<size_t>(pieces[j].second - pieces[j].first)));
      m.set_ends(ends && j + 1 == pieces.size());
      if (!o.rw->Write(m)) return;
    }
  };
  auto reply = [](Session& o) {
    remote::PushReply r;
    return o.rw->Read(&r) ? std::optional<remote::PushReply>(r) : std::nullopt;
  };
  // The session's status, once every reply on it is read.
  auto ended = [](Session& o) {
    remote::PushReply r;
    while (o.rw->Read(&r)) {
    }
    return o.rw->Finish();
  };
  auto refused = [](const grpc::Status& st, const std::string& says) {
    return st.error_code() == grpc::StatusCode::INVALID_ARGUMENT &&
           st.error_message().find(says) != std::string::npos;
  };
  const std::pair<int64_t, int64_t> p0{0, 300}, p1{300, 600}, p2{600, 900}, p3{900, 1024};
  // Rounds 0 and 1 on one session.
  Session a = open();
  send(a, 0, 1, 0, 1, {p0, p1, p2, p3});
  auto r = reply(a);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->version(), 1);
  EXPECT_TRUE(r->applied());
  EXPECT_FALSE(r->partial());
  send(a, 1, 2, 0, 1, {p0, p1, p2, p3});
  r = reply(a);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->version(), 2);
  // Rounds 2 and 3 in two stripes on two sessions: the stripe that ends first replies partial,
  // the other ends the push.
  Session b = open();
  for (int64_t round : {2, 3}) {
    const uint64_t id = 10 + round;
    send(a, round, id, 0, 2, {p0, p1});
    r = reply(a);
    ASSERT_TRUE(r);
    EXPECT_TRUE(r->partial());
    send(b, round, id, 1, 2, {p2, p3});
    r = reply(b);
    ASSERT_TRUE(r);
    EXPECT_FALSE(r->partial());
    EXPECT_EQ(r->version(), round + 1);
  }
  std::vector<float> got(1024);
  EXPECT_EQ(s.store->pull_into(got.data()), 4);
  for (int i = 0; i < 1024; ++i) ASSERT_EQ(got[i], -3.5f) << i;  // 0.5 - 4 pushes of 1
  // Closed between pushes, a session ends OK.
  a.rw->WritesDone();
  EXPECT_TRUE(ended(a).ok());
  b.rw->WritesDone();
  EXPECT_TRUE(ended(b).ok());
  // Refused, each ending its session: a push that gives its answer no time, a stripe beyond
  // the push's stripes, and a session that says a stripe in its metadata.
  Session c = open();
  send(c, 4, 20, 0, 1, {p0, p1, p2, p3}, 0);
  grpc::Status st = ended(c);
  EXPECT_TRUE(refused(st, "gives no time for its answer (timeout_ms 0)")) << st.error_message();
  Session d = open();
  send(d, 4, 21, 2, 2, {p0, p1});
  st = ended(d);
  EXPECT_TRUE(refused(st, "stripe 2 of 2 (a range of 4 piece(s), at most 16 stripes)"))
      << st.error_message();
  Session e = open("22 0 1");
  send(e, 4, 22, 0, 1, {p0, p1, p2, p3});
  st = ended(e);
  EXPECT_TRUE(refused(st, "a session's pushes say their stripes in their messages"))
      << st.error_message();
  EXPECT_EQ(s.store->pull_into(got.data()), 4);  // nothing of them applied
  for (int i = 0; i < 1024; ++i) ASSERT_EQ(got[i], -3.5f) << i;
  // A session closed inside a push fails it; the piece it carried stays in the round, and the
  // push sent again whole is applied once.
  Session f = open();
  send(f, 4, 23, 0, 1, {p0}, 10000, false);
  f.rw->WritesDone();
  st = ended(f);
  EXPECT_TRUE(refused(st, "PushSession ended inside its push of round 4")) << st.error_message();
  Session h = open();
  send(h, 4, 24, 0, 1, {p0, p1, p2, p3});
  r = reply(h);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->version(), 5);
  h.rw->WritesDone();
  EXPECT_TRUE(ended(h).ok());
  EXPECT_EQ(s.store->pull_into(got.data()), 5);
  for (int i = 0; i < 1024; ++i) ASSERT_EQ(got[i], -4.5f) << i;
}

// A PullSession carries a worker's pulls one after another, each a request answered by its
// pieces (the worker counts its floats); a refused pull ends the session with the refusal.
TEST(RemoteShard, PullSessionsCarryPullAfterPullAndEndOnARefusal) {
  OneShard s(1024, 300);  // 4 pieces
  s.push_ones();          // version 1: every parameter -0.5
  remote::ShardSet shards(s.cfg.cluster.ps, "t", {});
  struct Session {
    std::unique_ptr<grpc::ClientContext> ctx;
    std::unique_ptr<grpc::ClientReaderWriter<remote::PullRequest, remote::PullReply>> rw;
  };
  auto open = [&](const std::string& stripe_metadata = "") {
    Session o{remote::call_context("t", 30), nullptr};
    if (!stripe_metadata.empty()) o.ctx->AddMetadata(remote::kStripeKey, stripe_metadata);
    o.rw = shards.stub(0).PullSession(o.ctx.get());
    return o;
  };
  auto request = [&](int k, int n, int64_t timeout_ms = 10000) {
    remote::PullRequest r;
    r.set_layout_hash(remote::layout_hash(s.layout));
    r.set_worker(0);
    r.set_min_version(1);
    r.set_stripe(k);
    r.set_stripes(n);
    r.set_timeout_ms(timeout_ms);
    return r;
  };
  // Reads a pull's pieces until floats [a, b) are in; the floats read.
  auto pieces = [](Session& o, int64_t a, int64_t b) {
    std::vector<float> got;
    remote::PullReply rep;
    while (a + static_cast<int64_t>(got.size()) < b && o.rw->Read(&rep)) {
      EXPECT_EQ(rep.offset(), a + static_cast<int64_t>(got.size()));
      EXPECT_EQ(rep.version(), 1);
      const auto* f = reinterpret_cast<const float*>(rep.params().data());
      got.insert(got.end(), f, f + rep.params().size() / sizeof(float));
    }
    return got;
  };
  auto ended = [](Session& o) {
    remote::PullReply r;
    while (o.rw->Read(&r)) {
    }
    return o.rw->Finish();
  };
  // Two whole pulls, then stripe 1 of 2 ([600, 1024)), on one session.
  Session a = open();
  for (int pull = 0; pull < 2; ++pull) {
    ASSERT_TRUE(a.rw->Write(request(0, 1)));
    const std::vector<float> got = pieces(a, 0, 1024);
    ASSERT_EQ(got.size(), 1024u);
    for (float v : got) ASSERT_EQ(v, -0.5f);
  }
  ASSERT_TRUE(a.rw->Write(request(1, 2)));
  EXPECT_EQ(pieces(a, 600, 1024).size(), 424u);
  a.rw->WritesDone();
  grpc::Status st = ended(a);
  EXPECT_TRUE(st.ok()) << st.error_message();
  // Refused, each ending its session.
  auto refused = [](const grpc::Status& st, const std::string& says) {
    return st.error_code() == grpc::StatusCode::INVALID_ARGUMENT &&
           st.error_message().find(says) != std::string::npos;
  };
  Session b = open();
  b.rw->Write(request(0, 1, 0));
  st = ended(b);
  EXPECT_TRUE(refused(st, "pull on a session gives no time for its answer")) << st.error_message();
  Session c = open();
  c.rw->Write(request(2, 2));
  st = ended(c);
  EXPECT_TRUE(refused(st, "stripe 2 of 2 (a range of 4 piece(s), at most 16 stripes)"))
      << st.error_message();
  Session d = open("0 0 1");
  d.rw->Write(request(0, 1));
  st = ended(d);
  EXPECT_TRUE(refused(st, "a session's pulls say their stripes in their requests"))
      << st.error_message();
}

// Worker `worker`'s heartbeats to one shard, every 200 ms from construction until stop() (from
// any thread); the destructor stops them and waits for the last.
class Heartbeats {
 public:
  Heartbeats(const std::string& shard, int worker, const std::string& token = "t")
      : thread_([this, shard, worker, token] {
          remote::ShardSet shards({shard}, token, {});
          while (beating_) {
            remote::HeartbeatRequest req;
            req.set_worker(worker);
            remote::HeartbeatReply rep;
            auto ctx = remote::call_context(token, 2);
            (void)shards.stub(0).Heartbeat(ctx.get(), req, &rep);
            std::this_thread::sleep_for(std::chrono::milliseconds(200));
          }
        }) {}
  ~Heartbeats() {
    stop();
    thread_.join();
  }
  void stop() { beating_ = false; }

 private:
  std::atomic<bool> beating_{true};
  std::thread thread_;  // (after beating_: it reads it)
};

// Worker 1 of a OneShard's two: pushes of its gradient (not the store's), by hand, in the
// fixture's pieces of 300 floats.
struct SecondWorker {
  OneShard& s;
  const std::vector<remote::Range> ranges;  // each shard's
  std::vector<float> g;
  remote::PushRequest h;
  explicit SecondWorker(OneShard& shard)
      : s(shard),
        ranges(remote::shard_ranges(shard.layout.total(), static_cast<int>(shard.opts.size()))),
        g(shard.layout.total()),
        h(shard.head()) {
    for (size_t i = 0; i < g.size(); ++i) g[i] = 0.25f + 0.001f * static_cast<float>(i);
    h.set_worker(1);
  }
  // Its whole push of round r to ps:shard, or the first n pieces.
  std::vector<grpc::ByteBuffer> pieces(int64_t r, int n = 1 << 30, int shard = 0) {
    h.set_round(r);
    std::vector<grpc::ByteBuffer> out;
    const remote::Range& rg = ranges[shard];
    for (int64_t lo = 0; lo < rg.size() && static_cast<int>(out.size()) < n; lo += 300)
      out.push_back(piece(h, lo, g, rg.begin + lo, std::min(rg.begin + lo + 300, rg.end)));
    return out;
  }
  // The parameters and momentum slot that the store (the chief) reads now, and its update count.
  std::vector<float> params, slot;
  int64_t updates = 0;
  void keep() {
    const float* p = s.store->host_params();
    params.assign(p, p + g.size());
    slot.assign(s.opt.slot("momentum"), s.opt.slot("momentum") + g.size());
    updates = s.opt.updates();
  }
  // What the store reads now is bitwise what keep() read.
  void expect_kept() {
    const float* p = s.store->host_params();
    EXPECT_EQ(s.opt.updates(), updates);
    EXPECT_EQ(0, std::memcmp(p, params.data(), sizeof(float) * params.size()));
    EXPECT_EQ(0, std::memcmp(s.opt.slot("momentum"), slot.data(), sizeof(float) * slot.size()));
  }
  // The store's push of ones (worker 0's); its error, if it failed.
  std::string chief_push(int64_t r) {
    try {
      EXPECT_EQ(s.push_ones(), r + 1);
    } catch (const std::exception& e) {
      return e.what();
    }
    return "";
  }
  // Round r, whole, from both workers, to every shard.
  void round(int64_t r) {
    std::vector<std::string> errors(ranges.size());
    std::thread t([&] {
      for (size_t i = 0; i < ranges.size(); ++i)
        errors[i] = s.push(pieces(r, 1 << 30, static_cast<int>(i)), static_cast<int>(i));
    });
    const std::string error = chief_push(r);
    t.join();
    EXPECT_EQ(error, "");
    for (const std::string& e : errors) EXPECT_EQ(e, "");
  }
};

// Plain sync: a worker lost in the middle of its push leaves its round applied in part (the
// pieces of which every worker's copy had arrived). The shard takes those pieces back, their
// parameters, optimizer slots and the optimizer's count, so that the chief reads (and saves)
// the last complete round, bitwise; it refuses the round from then on. Before, every read was
// refused while the round stood in part ("round 1 cannot complete"), and the chief could not
// write its checkpoint of the last complete round.
TEST(RemoteShard, ARoundThatALostWorkerLeftInPartIsTakenBack) {
  // 4 pieces; momentum, for a slot; worker 1 is lost after 3 s without a call.
  OneShard s(1024, 300, "", "sync", 1, true, /*workers=*/2, 30, "momentum", 3.0);
  SecondWorker one(s);
  one.round(0);
  one.keep();
  ASSERT_EQ(one.updates, 1);
  ASSERT_NE(one.params[0], 0.5f);
  // Round 1: worker 1 sends its first two pieces, then is heard of no more. The store's push
  // (worker 0) completes those two, which are applied, and waits for the rest.
  EXPECT_NE(s.push(one.pieces(1, 2)), "");
  std::string error0;
  try {
    s.push_ones();
  } catch (const std::exception& e) {
    error0 = e.what();
  }
  EXPECT_NE(error0.find("round 1 cannot complete: worker(s) 1 lost"), std::string::npos) << error0;
  // The chief's read: round 1's start, every float and slot as round 0 left them.
  one.expect_kept();
  EXPECT_EQ(s.store->version(), 1);
  // Worker 1, back with the rest of round 1: refused, saying why.
  const std::string late = s.push(one.pieces(1));
  EXPECT_NE(late.find("the 2 of its 4 pieces applied here were taken back, and this shard "
                      "holds round 1 again: refused"),
            std::string::npos)
      << late;
}

// Plain sync: a worker lost in the middle of its push may have completed its round on one shard
// and not on another. The chief, stopping, asks every shard to hold its last complete round
// again (TakeBack): the shard that completed the next round takes it back, from the values it
// keeps until a later round's first piece is applied. It does so only once a lost worker
// stops the run, and only for the round it keeps.
TEST(RemoteShard, ARoundCompletedOnOneShardIsTakenBackForTheChief) {
  OneShard s(1024, 300, "", "sync", 1, true, /*workers=*/2, 30, "momentum", 3.0);
  SecondWorker one(s);
  one.round(0);
  one.keep();
  one.round(1);
  auto take_back = [&](int64_t v) -> std::string {
    try {
      s.store->take_back(v);
    } catch (const std::exception& e) {
      return e.what();
    }
    return "";
  };
  // While worker 1 lives (its heartbeats), the shard refuses to go back, after waiting a
  // heartbeat timeout and 2 s for it to be lost.
  {
    Heartbeats heart(s.cfg.cluster.ps[0], 1);
    EXPECT_NE(take_back(1).find("ps:0 cannot go back to round 1: the run can go on"),
              std::string::npos);
  }
  // Once it is silent, the chief's one call waits for the shard to count it lost (3 s), and
  // the shard goes back; asked again, it answers at once.
  EXPECT_EQ(take_back(1), "");
  EXPECT_EQ(take_back(1), "");
  one.expect_kept();
  // It kept round 1 only.
  EXPECT_NE(take_back(0).find("ps:0 cannot go back to round 0: it is at round 1, and keeps no "
                              "earlier one"),
            std::string::npos);
  // Worker 1's round 1, sent again: refused, saying why.
  EXPECT_NE(
      s.push(one.pieces(1))
          .find("round 1 was taken back (4 pieces): it had completed here but not on every shard"),
      std::string::npos);
}

// Plain sync over two shards, the case of a worker lost in the middle of its push that one
// shard alone cannot mend: worker 1 sends its whole round 1 to ps:0 and the first two pieces of
// it to ps:1, then is heard of no more. ps:0 completes round 1; ps:1 applies the two pieces
// and takes them back once the worker is lost; the chief's push fails naming the worker. The
// call that the chief's failure path makes before it writes the checkpoint of its last round
// (trainer.cpp: take_back, then write_checkpoint) brings ps:0 back too: the chief then reads
// round 1's start from both shards, bitwise, and a late push of the round is refused by both,
// each saying why.
TEST(RemoteShard, TheChiefBringsTwoShardsBackToTheLastRoundCompleteOnBoth) {
  OneShard s(2048, 300, "", "sync", 1, true, /*workers=*/2, 30, "momentum",
             /*heartbeat_timeout=*/3.0, /*shards=*/2);
  SecondWorker one(s);
  ASSERT_EQ(one.pieces(0, 1 << 30, 1).size(), 4u);  // (so that 2 of them are a round in part)
  one.round(0);
  // Worker 1 lives for ps:1 (its heartbeats) until its part of round 1 is sent there, however
  // long the rest takes on a loaded machine; it is counted lost 3 s after.
  Heartbeats heart(s.cfg.cluster.ps[1], 1);
  one.keep();
  ASSERT_EQ(one.updates, 1);
  // Round 1: worker 1's whole push to ps:0 (it completes there once the chief's arrives), two
  // of its four pieces to ps:1.
  std::string late0;
  std::thread t([&] {
    late0 = s.push(one.pieces(1, 1 << 30, 0), 0);
    EXPECT_NE(s.push(one.pieces(1, 2, 1), 1), "");  // (a stream cut short: its round is not whole)
    heart.stop();
  });
  const std::string error = one.chief_push(1);
  t.join();
  EXPECT_EQ(late0, "");
  EXPECT_NE(error.find("round 1 cannot complete: worker(s) 1 lost"), std::string::npos) << error;
  // The chief's failure path: every shard holds round 1 again (asked again, each answers).
  // What it reads: ps:0's count, which had gone to 2, and both shards' floats and slots.
  s.store->take_back(1);
  s.store->take_back(1);
  one.expect_kept();
  // Worker 1, back with round 1: refused by each shard, saying why.
  const std::string again0 = s.push(one.pieces(1, 1 << 30, 0), 0);
  EXPECT_NE(again0.find("ps:0: round 1 was taken back (4 pieces): it had completed here but not "
                        "on every shard"),
            std::string::npos)
      << again0;
  const std::string again1 = s.push(one.pieces(1, 1 << 30, 1), 1);
  EXPECT_NE(again1.find("the 2 of its 4 pieces applied here were taken back, and this shard "
                        "holds round 1 again: refused"),
            std::string::npos)
      << again1;
}

// A push on a session keeps its own deadline: at a sync barrier that never completes (the
// other worker never pushes), the shard answers before the deadline (2 s; the heartbeat
// timeout that would count the other worker lost is 10 s), saying what it waited for, and the
// worker's error says so.
TEST(RemoteShard, APushOnASessionEndsAtItsDeadlineSayingWhatItWaitedFor) {
  OneShard s(1024, 300, "", "sync", 2, true, 2, 2.0);
  try {
    s.push_ones();
    ADD_FAILURE() << "the push did not fail";
  } catch (const std::exception& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("DEADLINE_EXCEEDED"), std::string::npos) << what;
    EXPECT_NE(what.find("the call's deadline passed while waiting for the other workers' "
                        "gradients of round 0"),
              std::string::npos)
        << what;
  }
}

// A shard that exits while a push waits at its barrier fails the push as unavailable (the
// worker calls again until its deadline), not as a cancelled call, though the shard ends its
// sessions as it exits. (The barrier's wait answers first, saying the shard is shutting down;
// the worker also counts a session that the shard cancels under a push as unavailable, for a
// cancel that comes while the push's pieces are still arriving: the next test. Should the shutdown
// come before the push reaches the shard, the push finds no shard: unavailable too.)
TEST(RemoteShard, AShardThatExitsUnderAPushOnASessionIsUnavailable) {
  OneShard s(1024, 300, "", "sync", 2, true, 2, 3.0);
  std::string error;
  std::thread pusher([&] {
    try {
      s.push_ones();
    } catch (const std::exception& e) {
      error = e.what();
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // (at the barrier, likely)
  s.shut_down();
  pusher.join();
  EXPECT_NE(error.find("Push failed: UNAVAILABLE"), std::string::npos) << error;
  EXPECT_EQ(error.find("CANCELLED"), std::string::npos) << error;
  s.start();  // (for ~OneShard's shut_down)
}

// A shard that stops answering in the middle of a run (here: it exits) is named, and the
// error says that it answered before, instead of asking whether it runs at that address and
// whether TLS is agreed, which is the question for a shard that never answered.
TEST(RemoteShard, AShardThatStopsAnsweringIsSaidToHaveAnsweredBefore) {
  OneShard s(1024, 300, "", "sync", 1, true, 1, 2.0);
  ASSERT_EQ(s.push_ones(), 1);
  s.shut_down();
  std::string error;
  try {
    s.push_ones();
  } catch (const std::exception& e) {
    error = e.what();
  }
  EXPECT_NE(error.find("ps:0 (" + s.cfg.cluster.ps[0] + "): Push failed: UNAVAILABLE"),
            std::string::npos)
      << error;
  EXPECT_NE(error.find("it answered this process's earlier calls, so it has stopped answering"),
            std::string::npos)
      << error;
  EXPECT_EQ(error.find("agree on TLS"), std::string::npos) << error;
  s.start();  // (for ~OneShard's shut_down)
}

// A session that its shard ends with CANCELLED while a push's pieces are arriving (what a
// shard's exit does to its sessions, end_sessions) fails the push as unavailable: the worker
// calls again, each time on a new session (an ended one is never reused), until the push's
// deadline, then names the shard and what ended the session. The shard here is a stand-in
// that ends every PushSession as soon as its first message arrives.
TEST(RemoteShard, ASessionTheShardCancelsUnderAPushIsUnavailableAndNotReused) {
  class CancellingShard final : public grpc::CallbackGenericService {
   public:
    std::atomic<int> sessions{0};
    grpc::ServerGenericBidiReactor* CreateReactor(
        grpc::GenericCallbackServerContext* ctx) override {
      class Reactor final : public grpc::ServerGenericBidiReactor {
       public:
        explicit Reactor(bool session) {
          if (session)
            StartRead(&in_);
          else
            Finish(grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "not a PushSession"));
        }
        void OnReadDone(bool) override {
          Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the shard is exiting"));
        }
        void OnDone() override { delete this; }

       private:
        grpc::ByteBuffer in_;
      };
      const bool session = ctx->method() == remote::kPushSessionMethod;
      if (session) ++sessions;
      return new Reactor(session);
    }
  } service;
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterCallbackGenericService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_TRUE(server != nullptr && port > 0);
  std::string error;
  {
    remote::ShardSet shards({fmt::format("127.0.0.1:{}", port)}, "t", {}, 1, true);
    std::vector<float> grads(8, 1.0f);
    std::vector<remote::ShardSet::PushOut> out(1);
    out[0].head.set_round(0);
    out[0].pieces.push_back({0, grpc::Slice(grads.data(), sizeof(float) * grads.size())});
    std::vector<remote::PushReply> replies(1);
    try {
      shards.push(out, replies, 1.5);
    } catch (const std::exception& e) {
      error = e.what();
    }
    EXPECT_EQ(shards.sessions_opened(), service.sessions.load());
  }
  server->Shutdown();
  EXPECT_NE(error.find("Push failed: UNAVAILABLE: the shard ended the session: the shard is "
                       "exiting"),
            std::string::npos)
      << error;
  EXPECT_GE(service.sessions.load(), 2) << "the push was not called again on a new session";
}

// Pushes of a worker's store in stripes land every float where it belongs, once, and its pulls
// in stripes read every float: sync and async shards, a range split unevenly (5 pieces in 3
// stripes) and evenly, pushes on sessions kept open and on a call each.
TEST(RemoteShard, StripedPushesAndPullsLandEveryFloatOnce) {
  for (const std::string mode : {"sync", "async"})
    for (int stripes : {3, 5})
      for (bool sessions : {true, false}) {
        SCOPED_TRACE(fmt::format("{}, stripes {}, sessions {}", mode, stripes, sessions));
        OneShard s(1400, 300, "", mode, stripes, sessions);
        const int64_t n = s.layout.total();  // 1400, or a little more: the layout's alignment
        ASSERT_EQ((n + 299) / 300, 5);       // 5 pieces
        std::vector<float> g(n);
        for (int64_t i = 0; i < n; ++i) g[i] = static_cast<float>(i % 64) / 8.0f;
        CpuDevice host(1);
        HostUpdate on(host);
        s.store->attach({nullptr});  // one tower's pushes (async: the rounds it read)
        for (int push = 1; push <= 2; ++push) {
          UpdateRecord rec;
          rec.lr = 1.0f;
          rec.examples = 1;
          rec.contributors = 1;
          EXPECT_EQ(s.store->push(g.data(), rec, on), push);
        }
        const float* p = s.store->host_params();
        for (int64_t i = 0; i < 1400; ++i)
          ASSERT_EQ(p[i], 0.5f - 2.0f * g[i]) << i;  // (not the padding)
        std::vector<float> pulled(n, -7.0f);
        EXPECT_EQ(s.store->pull_into(pulled.data()), 2);
        for (int64_t i = 0; i < n; ++i) ASSERT_EQ(pulled[i], p[i]) << i;
        // The two pushes and the pull each went as min(stripes, 5 pieces) streams; on sessions,
        // the pushes' and the pull's streams were opened once.
        EXPECT_EQ(s.store->timing()["streams"].get<int64_t>(), 3 * std::min(stripes, 5));
        EXPECT_EQ(s.store->timing()["sessions"].get<int64_t>(),
                  sessions ? 2 * std::min(stripes, 5) : 0);
      }
  // A pull's stripe metadata is checked as a push's.
  OneShard s(1024, 300);
  remote::ShardSet shards(s.cfg.cluster.ps, "t", {});
  for (const auto& [meta, says] : std::vector<std::pair<std::string, std::string>>{
           {"0 0 5", "5 stripes of a range of 4 piece(s)"}, {"0 1", "'0 1' is not \"ID K S\""}}) {
    auto ctx = remote::call_context("t", 10);
    ctx->AddMetadata(remote::kStripeKey, meta);
    remote::PullRequest req;
    req.set_layout_hash(remote::layout_hash(s.layout));
    auto r = shards.stub(0).PullStream(ctx.get(), req);
    remote::PullReply rep;
    while (r->Read(&rep)) {
    }
    const grpc::Status st = r->Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << meta;
    EXPECT_NE(st.error_message().find(says), std::string::npos) << st.error_message();
  }
}

// A client of the generated protobuf stubs pushes with the unary Push (the whole range in one
// message) and pulls with Pull; the shard serves it the same as the streams.
TEST(RemoteShard, ProtobufClientsPushAndPullWhole) {
  OneShard s(1024, 300);
  remote::ShardSet shards(s.cfg.cluster.ps, "t", {});
  remote::PushRequest r = s.head();
  r.set_grads(std::string(4 * 1024, '\0'));
  for (int i = 0; i < 1024; ++i) reinterpret_cast<float*>(r.mutable_grads()->data())[i] = 0.25f * (i % 4);
  remote::PushReply rep;
  auto ctx = remote::call_context("t", 10);
  ASSERT_TRUE(shards.stub(0).Push(ctx.get(), r, &rep).ok());
  EXPECT_EQ(rep.version(), 1);
  EXPECT_TRUE(rep.applied());
  remote::PullRequest q;
  q.set_layout_hash(remote::layout_hash(s.layout));
  q.set_worker(-1);
  remote::PullReply got;
  auto ctx2 = remote::call_context("t", 10);
  ASSERT_TRUE(shards.stub(0).Pull(ctx2.get(), q, &got).ok());
  ASSERT_EQ(got.params().size(), 4096u);
  std::vector<float> streamed(1024, -9.0f);
  EXPECT_EQ(s.store->pull_into(streamed.data()), 1);
  for (int i = 0; i < 1024; ++i) {
    const float expect = 0.5f - 0.25f * static_cast<float>(i % 4);
    EXPECT_EQ(reinterpret_cast<const float*>(got.params().data())[i], expect) << i;
    EXPECT_EQ(streamed[i], expect) << i;
  }
}

// SSP: a pull waits while the puller is too far ahead of the slowest worker as the shard knows
// it. A shard learns a worker's clock from its pushes and pulls, and from its heartbeats: a
// restarted shard (clocks 0) may get no push or pull from a worker whose towers all wait at
// other shards, and without the heartbeats' clocks both would wait until their deadlines.
TEST(RemoteShard, SspShardsLearnAWorkersClockFromItsHeartbeats) {
  OneShard s(1024, 300, "", "ssp", 1, true, /*workers=*/2);
  remote::ShardSet shards(s.cfg.cluster.ps, "t", {});
  auto pull = [&](double timeout) {
    remote::PullRequest q;
    q.set_layout_hash(remote::layout_hash(s.layout));
    q.set_worker(0);
    q.set_clock(3);
    q.set_worker_clock(3);
    remote::PullReply got;
    auto ctx = remote::call_context("t", timeout);
    return shards.stub(0).Pull(ctx.get(), q, &got);
  };
  const grpc::Status waited = pull(1.5);  // worker 1's clock is 0, the bound (staleness) 0
  EXPECT_FALSE(waited.ok());
  EXPECT_NE(waited.error_message().find("the slowest worker (clock 3 is more than 0 ahead)"),
            std::string::npos)
      << waited.error_message();
  remote::HeartbeatRequest beat;
  beat.set_worker(1);
  beat.set_worker_clock(3);
  remote::HeartbeatReply rep;
  auto ctx = remote::call_context("t", 10);
  ASSERT_TRUE(shards.stub(0).Heartbeat(ctx.get(), beat, &rep).ok());
  const grpc::Status after = pull(10);
  EXPECT_TRUE(after.ok()) << after.error_message();
}

// A shard asked to roll back to a round it has no checkpoint of, with earlier ones (backup
// workers: rounds go on while the chief checkpoints, so shards save rounds apart), answers
// with a rollback to the latest earlier round it saved, one generation on; asked for that
// one, it loads it.
TEST(RemoteShard, ARestoreOfARoundNotSavedHereOffersTheLatestEarlierOne) {
  const std::string dir = test_path("ps-ck");
  OneShard s(1024, 300, dir);
  ASSERT_EQ(s.push_ones(), 1);
  ASSERT_EQ(s.store->save_shards(1).at(0), dir + "/ps-0-0000000001.ckpt");
  ASSERT_EQ(s.push_ones(), 2);
  ASSERT_EQ(s.push_ones(), 3);
  ASSERT_EQ(s.store->save_shards(3).at(0), dir + "/ps-0-0000000003.ckpt");
  remote::RestoreReply rep;
  grpc::Status st = s.restore(2, 1, &rep);
  const auto offered = remote::rollback_of(st);
  ASSERT_TRUE(offered.has_value()) << st.error_message();
  EXPECT_EQ(offered->version, 1);
  EXPECT_EQ(offered->generation, 2);
  EXPECT_NE(st.error_message().find("no checkpoint of round 2"), std::string::npos)
      << st.error_message();
  st = s.restore(1, 2, &rep);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(rep.version(), 1);
  EXPECT_EQ(rep.path(), dir + "/ps-0-0000000001.ckpt");
  std::vector<float> got(1024, -9.0f);
  EXPECT_THROW(s.store->pull_into(got.data()), remote::RollbackError);  // its generation is 0
  s.store->pull_into(got.data());
  EXPECT_EQ(got[0], -0.5f);  // round 1: 0.5 - 1
  EXPECT_EQ(got[1023], -0.5f);
}

// A shard restarted from a checkpoint saved before a rollback that the run then took starts at
// that rollback's generation (its checkpoint's, plus one). A Restore of that generation, from
// a worker that takes the earlier rollback late, is not the restarted shard's: it answers with
// its own rollback one generation on, which every worker then takes. (Before, it took that
// Restore as its own rollback adopted, and the workers that had gone on past it never came
// back: a backup-worker run then waited at the shard until the deadline.)
TEST(RemoteShard, ARestartedShardsRollbackIsNotTakenForAnEarlierOneOfTheSameGeneration) {
  const std::string dir = test_path("ps-ck");
  OneShard s(1024, 300, dir);
  ASSERT_EQ(s.push_ones(), 1);
  ASSERT_EQ(s.store->save_shards(1).at(0), dir + "/ps-0-0000000001.ckpt");  // generation 0
  ASSERT_EQ(s.push_ones(), 2);
  remote::RestoreReply rep;
  ASSERT_TRUE(s.restore(1, 1, &rep).ok());      // the run's rollback to round 1, generation 1
  s.restart();                                  // from round 1, saved at generation 0
  grpc::Status st = s.restore(1, 1, &rep, 30);  // the earlier rollback, taken late
  const auto own = remote::rollback_of(st);
  ASSERT_TRUE(own.has_value()) << st.error_message();
  EXPECT_EQ(own->version, 1);
  EXPECT_EQ(own->generation, 2);
  EXPECT_NE(st.error_message().find("was restarted and restored round 1"), std::string::npos)
      << st.error_message();
  st = s.restore(1, 2, &rep);
  EXPECT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(rep.version(), 1);
}

// Restore: a sync shard goes back to a round it saved, from its own checkpoint of it, at a new
// rollback generation; a worker's calls of the earlier generation are refused with the
// rollback, and the worker's store, once it has asked every shard for it, goes on from that
// round. A round the shard has no checkpoint of, nor of any round before it, is refused with
// the file named, and nothing changes; a Restore of an earlier generation is answered with the
// later rollback.
TEST(RemoteShard, RestoreGoesBackToASavedRoundAtANewGeneration) {
  const std::string dir = test_path("ps-ck");
  OneShard s(1024, 300, dir);
  const std::vector<float> g(1024, 1.0f);
  auto push = [&] { return s.push_ones(); };
  auto params_are = [&](float want) {
    std::vector<float> got(1024, -9.0f);
    s.store->pull_into(got.data());
    for (float v : got)
      if (v != want) return false;
    return true;
  };
  auto restore = [&](int64_t v, int64_t generation, remote::RestoreReply* r) {
    return s.restore(v, generation, r);
  };
  remote::RestoreReply rep;
  // The shard saved the run's start when it was initialised (decision 78); that file lost,
  // it has no checkpoint of round 1 nor of any before it.
  ASSERT_TRUE(std::filesystem::remove(dir + "/ps-0-0000000000.ckpt"));
  ASSERT_EQ(push(), 1);  // sgd, lr 1: 0.5 - 1
  // Refused, naming the file; the shard goes on as it was.
  grpc::Status st = restore(1, 1, &rep);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(st.error_message().find("ps-0-0000000001.ckpt"), std::string::npos)
      << st.error_message();
  EXPECT_NE(st.error_message().find("--resume"), std::string::npos) << st.error_message();
  EXPECT_TRUE(params_are(-0.5f));
  ASSERT_EQ(s.store->save_shards(1).at(0), dir + "/ps-0-0000000001.ckpt");
  ASSERT_EQ(push(), 2);
  ASSERT_EQ(s.store->save_shards(2).at(0), dir + "/ps-0-0000000002.ckpt");
  ASSERT_EQ(push(), 3);
  ASSERT_TRUE(params_are(-2.5f));

  // Back to round 1, generation 1.
  st = restore(1, 1, &rep);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(rep.version(), 1);
  EXPECT_EQ(rep.path(), dir + "/ps-0-0000000001.ckpt");
  EXPECT_FALSE(std::filesystem::exists(dir + "/ps-0-0000000002.ckpt"));  // a round given up
  // The same rollback again: answered at once; an earlier generation: the later rollback.
  st = restore(1, 1, &rep);
  EXPECT_TRUE(st.ok()) << st.error_message();
  EXPECT_TRUE(rep.path().empty());
  st = restore(2, 0, &rep);
  const auto later = remote::rollback_of(st);
  ASSERT_TRUE(later.has_value()) << st.error_message();
  EXPECT_EQ(later->version, 1);
  EXPECT_EQ(later->generation, 1);

  // The worker's store is at generation 0: its next call is refused with the rollback, which it
  // adopts (and says so) before it goes on from round 1.
  EXPECT_EQ(s.store->generation(), 0);
  try {
    push();
    ADD_FAILURE() << "a push of generation 0 was taken";
  } catch (const remote::RollbackError& e) {
    EXPECT_EQ(e.rollback.version, 1);
    EXPECT_EQ(e.rollback.generation, 1);
    EXPECT_NE(std::string(e.what()).find("every shard went back to round 1"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(s.store->generation(), 1);
  EXPECT_EQ(s.store->version(), 1);
  EXPECT_TRUE(params_are(-0.5f));
  EXPECT_EQ(push(), 2);
  EXPECT_TRUE(params_are(-1.5f));
  // A stream of generation 0 is refused, not applied.
  remote::PushRequest h = s.head();
  h.set_round(2);
  EXPECT_NE(s.push({piece(h, 0, g, 0, 300), piece(h, 300, g, 300, 600), piece(h, 600, g, 600, 900),
                    piece(h, 900, g, 900, 1024)})
                .find("roll back to it"),
            std::string::npos);
  EXPECT_TRUE(params_are(-1.5f));
}

// A pull (a PullStream's, or a PullSession's: `method`) of `request` that reads its first
// piece and then nothing, on a channel whose windows hold far less than a large range: the
// shard's writes of the other pieces wait, as they do for a worker that has stopped.
struct StuckPull final : grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
  grpc::GenericStub stub;
  grpc::ByteBuffer out, in;
  std::mutex mu;
  std::condition_variable cv;
  bool first = false, done = false, reading_on = false;
  bool held = true;  // the test's thread only
  grpc::Status status;
  static std::shared_ptr<grpc::Channel> narrow_channel(const std::string& address) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 64 << 10);
    args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
    args.SetMaxReceiveMessageSize(-1);
    return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
  }
  // A hold keeps the call (and this reactor's part in it) until read_on or release, so that a
  // read can still be started once the shard has ended the call.
  StuckPull(const std::string& address, const char* method, grpc::ByteBuffer request,
            grpc::ClientContext* ctx)
      : stub(narrow_channel(address)), out(std::move(request)), ctx_(ctx) {
    stub.PrepareBidiStreamingCall(ctx, method, grpc::StubOptions(), this);
    AddHold();
    if (std::string(method) == remote::kPullSessionMethod)
      StartWrite(&out);  // (not the session's last message: it stays open)
    else
      StartWriteLast(&out, grpc::WriteOptions());
    StartRead(&in);
    StartCall();
  }
  void OnReadDone(bool ok) override {  // reads the first piece, then nothing until read_on
    std::unique_lock<std::mutex> l(mu);
    first = first || ok;
    cv.notify_all();
    const bool on = ok && reading_on;
    l.unlock();
    if (on) StartRead(&in);
  }
  // Reads whatever comes until the call ends. (gRPC tells a client that the server ended its
  // call only once the pieces that came before that end are read.)
  void read_on() {
    {
      std::lock_guard<std::mutex> l(mu);
      reading_on = true;
    }
    StartRead(&in);
    release();
  }
  void release() {
    if (std::exchange(held, false)) RemoveHold();
  }
  ~StuckPull() override {  // (a test that stopped early: the call ends before this goes)
    if (held) ctx_->TryCancel();
    release();
    std::unique_lock<std::mutex> l(mu);
    cv.wait(l, [&] { return done; });
  }
  void OnDone(const grpc::Status& st) override {
    std::lock_guard<std::mutex> l(mu);
    status = st;
    done = true;
    cv.notify_all();
  }
  bool wait(bool StuckPull::*what) {
    std::unique_lock<std::mutex> l(mu);
    return cv.wait_for(l, std::chrono::seconds(30), [&] { return this->*what || done; }) &&
           this->*what;
  }

 private:
  grpc::ClientContext* ctx_;
};

// A rollback waits for the calls of the rounds it gives up to let go of the parameters, but not
// past its deadline. A worker's pull whose client reads nothing after its first piece keeps
// the parameters lent to gRPC (the client's 64 KiB window lets no more through): a Restore
// then ends with DEADLINE_EXCEEDED, saying what it waited for, and the shard takes no call of
// the old generation. Once the pull is cancelled the same Restore goes through, and the worker
// goes on from the restored round.
TEST(RemoteShard, ARestoreThatCannotTakeTheParametersEndsAtItsDeadline) {
  const std::string dir = test_path("ps-ck-deadline");
  const int64_t n = 8 << 20;  // 32 MiB in 1 MiB pieces: far more than the stuck pull's window
  OneShard s(n, 1 << 18, dir);
  ASSERT_EQ(s.push_ones(), 1);  // sgd, lr 1: 0.5 - 1
  ASSERT_EQ(s.store->save_shards(1).at(0), dir + "/ps-0-0000000001.ckpt");
  ASSERT_EQ(s.push_ones(), 2);

  remote::PullRequest req;
  req.set_layout_hash(remote::layout_hash(s.layout));
  req.set_worker(0);
  req.set_min_version(2);
  auto ctx = remote::call_context("t", 60);
  StuckPull stuck(s.cfg.cluster.ps[0], remote::kPullStreamMethod, remote::encode(req), ctx.get());
  // The first piece is here: the shard holds the parameters for this pull.
  ASSERT_TRUE(stuck.wait(&StuckPull::first)) << stuck.status.error_message();

  remote::RestoreReply rep;
  grpc::Status st = s.restore(1, 1, &rep, 2);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << st.error_message();
  EXPECT_NE(st.error_message().find("did not let go of the parameters before the rollback's "
                                    "deadline"),
            std::string::npos)
      << st.error_message();
  // The shard is at generation 1 now, waiting to load round 1: a worker's call of generation 0
  // is refused with that rollback.
  {
    remote::ShardSet shards(s.cfg.cluster.ps, "t", {});
    std::vector<float> dst(n);
    try {
      shards.pull_streams(req, remote::shard_ranges(n, 1), 1 << 18, dst.data(), 10);
      ADD_FAILURE() << "a pull of generation 0 was served";
    } catch (const remote::RollbackError& e) {
      EXPECT_EQ(e.rollback.version, 1);
      EXPECT_EQ(e.rollback.generation, 1);
    }
  }

  ctx->TryCancel();
  stuck.release();
  ASSERT_TRUE(stuck.wait(&StuckPull::done));
  // gRPC lets go of the lent pieces as the call ends (the shard's lease comes back a moment
  // later): the same Restore goes through.
  bool restored = false;
  for (int attempt = 0; attempt < 50 && !restored; ++attempt) {
    st = s.restore(1, 1, &rep, 10);
    restored = st.ok();
    if (!restored) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_TRUE(restored) << st.error_message();
  EXPECT_EQ(rep.version(), 1);
  try {  // the worker adopts the rollback, as in the test above
    s.push_ones();
    ADD_FAILURE() << "a push of generation 0 was taken";
  } catch (const remote::RollbackError& e) {
    EXPECT_EQ(e.rollback.version, 1);
  }
  std::vector<float> got(n, -9.0f);
  s.store->pull_into(got.data());
  EXPECT_EQ(got[0], -0.5f);
  EXPECT_EQ(got[n - 1], -0.5f);
  EXPECT_EQ(s.store->version(), 1);
  EXPECT_EQ(s.push_ones(), 2);
}

// A worker that stops reading in the middle of a pull on a session (a stopped process) does
// not hold the lent parameters for as long as its connection lasts: the shard ends the session
// a few seconds (kSessionOverdue) after the pull's own deadline, as gRPC ends a PullStream at
// the call's. The call's own deadline here is far later (60 s), and the client never cancels.
TEST(RemoteShard, AStalledPullOnASessionIsEndedAfterItsDeadlineAndLetsGoOfTheParameters) {
  const int64_t n = 8 << 20;  // 32 MiB in 1 MiB pieces: far more than the stuck pull's window
  OneShard s(n, 1 << 18, "", "sync", 1, true, 1, 60);
  ASSERT_EQ(s.push_ones(), 1);  // sgd, lr 1: 0.5 - 1
  remote::PullRequest req;
  req.set_layout_hash(remote::layout_hash(s.layout));
  req.set_worker(0);
  req.set_min_version(1);
  req.set_stripes(1);
  req.set_timeout_ms(1000);
  auto ctx = remote::call_context("t", 60);
  StuckPull stuck(s.cfg.cluster.ps[0], remote::kPullSessionMethod, remote::encode(req), ctx.get());
  ASSERT_TRUE(stuck.wait(&StuckPull::first)) << stuck.status.error_message();
  // The next round applies once the pull's hold on the parameters ends (plain sync), within
  // the push's deadline (60 s, as the session's): the shard has ended the session.
  ASSERT_EQ(s.push_ones(), 2);
  std::vector<float> got(n, -9.0f);
  s.store->pull_into(got.data());
  EXPECT_EQ(got[0], -1.5f);
  EXPECT_EQ(got[n - 1], -1.5f);
  stuck.read_on();
  ASSERT_TRUE(stuck.wait(&StuckPull::done)) << "the stalled session was not ended";
  EXPECT_EQ(stuck.status.error_code(), grpc::StatusCode::CANCELLED) << stuck.status.error_message();
}

// The same for a push whose messages stop in the middle (a worker stopped while sending):
// the shard ends its session after the push's deadline, and the pieces it took stay in the
// round, as those of a broken PushStream do, so the push sent again completes it.
TEST(RemoteShard, AStalledPushOnASessionIsEndedAfterItsDeadline) {
  OneShard s(1024, 300);  // 4 pieces
  remote::ShardSet shards(s.cfg.cluster.ps, "t", {});
  auto ctx = remote::call_context("t", 60);
  auto rw = shards.stub(0).PushSession(ctx.get());
  const std::vector<float> g(300, 1.0f);
  remote::PushRequest m = s.head();
  m.set_push(1);
  m.set_stripes(1);
  m.set_timeout_ms(1000);
  m.set_offset(0);
  m.set_grads(std::string(reinterpret_cast<const char*>(g.data()), sizeof(float) * g.size()));
  ASSERT_TRUE(rw->Write(m));  // the first of its 4 pieces, and nothing after it
  remote::PushReply r;
  EXPECT_FALSE(rw->Read(&r));  // (returns once the session has ended)
  const grpc::Status st = rw->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::CANCELLED) << st.error_message();
  ASSERT_EQ(s.push_ones(), 1);
  std::vector<float> got(1024, -9.0f);
  s.store->pull_into(got.data());
  EXPECT_EQ(got[0], -0.5f);
  EXPECT_EQ(got[1023], -0.5f);
}

// A restarted shard is at its checkpoint's round, at a new generation, until a worker adopts
// its rollback. Asked (at its generation) for an earlier round, which another restarted shard
// holds, it answers with that round one generation on, and then loads it from its checkpoint
// when asked; asked for a later round, it answers with its own.
TEST(RemoteShard, ARestartedShardLoadsTheRoundTheRunSettlesOn) {
  const std::string dir = test_path("ps-ck");
  OneShard s(1024, 300, dir);
  for (int64_t v = 1; v <= 3; ++v) {  // sgd, lr 1: round v's parameters are 0.5 - v
    ASSERT_EQ(s.push_ones(), v);
    s.store->save_shards(v);
  }
  s.restart();  // at round 3, generation 1, pending
  remote::ShardSet shards(s.cfg.cluster.ps, "t", {});
  auto restore = [&](int64_t v, int64_t generation, remote::RestoreReply* r) {
    return s.restore(v, generation, r);
  };
  auto round_params = [&] {
    remote::PullRequest q;
    q.set_layout_hash(remote::layout_hash(s.layout));
    q.set_worker(-1);
    remote::PullReply got;
    auto ctx = remote::call_context("t", 10);
    EXPECT_TRUE(shards.stub(0).Pull(ctx.get(), q, &got).ok());
    const float first = reinterpret_cast<const float*>(got.params().data())[0];
    return std::make_pair(got.version(), first);
  };
  remote::RestoreReply rep;
  // A later round than its own: back to its own, one generation after the one asked.
  grpc::Status st = restore(5, 3, &rep);
  auto r = remote::rollback_of(st);
  ASSERT_TRUE(r.has_value()) << st.error_message();
  EXPECT_EQ(r->version, 3);
  EXPECT_EQ(r->generation, 4);
  // Its own generation with an earlier round: that round, one generation on...
  st = restore(2, 4, &rep);
  r = remote::rollback_of(st);
  ASSERT_TRUE(r.has_value()) << st.error_message();
  EXPECT_EQ(r->version, 2);
  EXPECT_EQ(r->generation, 5);
  EXPECT_EQ(round_params(), std::make_pair(int64_t{3}, -2.5f));
  // ...which it loads when asked for it.
  st = restore(2, 5, &rep);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(rep.path(), dir + "/ps-0-0000000002.ckpt");
  EXPECT_EQ(round_params(), std::make_pair(int64_t{2}, -1.5f));
  EXPECT_FALSE(std::filesystem::exists(dir + "/ps-0-0000000003.ckpt"));
}

// ---- clusters of real processes -------------------------------------------------------------

// The tensor bytes of a safetensors file (everything after its header).
std::string tensor_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string all = ss.str();
  if (all.size() < 8) return {};
  uint64_t n = 0;
  std::memcpy(&n, all.data(), 8);
  return all.substr(8 + n);
}

std::string only_checkpoint(const std::string& dir) {
  std::string found;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    if (e.path().extension() == ".safetensors") found = e.path().string();
  return found;
}

// W workers x T towers in sync mode give bitwise the parameters, slots and losses of one
// process with W x T towers: the same global batches, and the same tree over the towers.
// stripes > 0: the workers' pushes and pulls travel in that many streams a shard (their ranges
// have at least that many pieces).
void expect_launch_matches_one_process(int workers, int towers_per_worker, int ps,
                                       const std::string& model = "fashion",
                                       const std::string& remote_flags = "", int stripes = 0) {
  const std::string flags =
      "--model " + model + " --dataset synthetic --synthetic-size 1500 --mode sync --steps 12 "
      "--seed 3 --batch 16 --eval-every 0 --log-every 1 --quiet --optimizer adam --lr 0.001";
  const std::string one = test_path("one"), many = test_path("many");
  std::string out;
  ASSERT_EQ(run_towers(fmt::format("train {} --towers {} --metrics {}/m.jsonl --checkpoint-dir {}",
                                   flags, workers * towers_per_worker, one, one), &out), 0) << out;
  ASSERT_EQ(run_towers(fmt::format("launch --ps {} --workers {} --towers-per-worker {} --out {} -- "
                                   "train {} {} --checkpoint-dir {}/ck", ps, workers,
                                   towers_per_worker, many, flags, remote_flags, many), &out), 0)
      << out;
  const auto a = metrics_events(one + "/m.jsonl", "step");
  const auto b = metrics_events(many + "/worker-0.jsonl", "step");
  ASSERT_EQ(a.size(), 12u);
  ASSERT_EQ(b.size(), 12u);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_NEAR(a[i]["loss"].get<double>(), b[i]["loss"].get<double>(), 1e-6) << "step " << i + 1;
    EXPECT_EQ(a[i]["contributors"], b[i]["contributors"]);
  }
  const std::string ca = tensor_bytes(only_checkpoint(one));
  const std::string cb = tensor_bytes(only_checkpoint(many + "/ck"));
  ASSERT_FALSE(ca.empty());
  EXPECT_TRUE(ca == cb) << "the parameters and slots differ from one process's";
  if (stripes > 0) {
    const auto summary = metrics_events(many + "/worker-0.jsonl", "summary");
    ASSERT_EQ(summary.size(), 1u);
    const auto& t = summary[0]["remote"];
    EXPECT_EQ(t["streams"].get<int64_t>(),
              stripes * ps * (t["pushes"].get<int64_t>() + t["pulls"].get<int64_t>()))
        << t.dump();
  }
}

TEST(RemoteCli, SyncTwoWorkersEqualTwoTowersBitwise) { expect_launch_matches_one_process(2, 1, 2); }
// Pushes and pulls in pieces of 16 KiB: dozens per range, applied piece by piece as they arrive,
// in whatever order the workers' pieces complete.
TEST(RemoteCli, SyncInSmallPiecesEqualsOneProcessBitwise) {
  expect_launch_matches_one_process(2, 1, 2, "fashion", "--rpc-piece-kib 16 --rpc-stripes 1", 1);
}
// The same pieces in stripes: 3 streams to each shard at once, each on a connection of its own.
TEST(RemoteCli, SyncInStripesEqualsOneProcessBitwise) {
  expect_launch_matches_one_process(2, 1, 2, "fashion", "--rpc-piece-kib 16 --rpc-stripes 3", 3);
}
TEST(RemoteCli, SyncTwoWorkersOfTwoTowersEqualFourTowersBitwise) {
  expect_launch_matches_one_process(2, 2, 3);
}
// With batch normalization, the running statistics (state) are updated on the shards from the
// deltas the workers push, bitwise as in one process.
TEST(RemoteCli, SyncBatchNormStatisticsEqualOneProcessBitwise) {
  const std::string file = test_path("bn.json");
  std::ofstream(file) << R"({"name": "bn", "input": [1, 28, 28], "classes": 10, "layers": [
  {"name": "conv", "type": "conv2d", "filters": 8, "kernel": 3, "stride": 2, "relu": false,
   "weight_init": {"stddev": 0.2}},
  {"name": "bn", "type": "batchnorm", "momentum": 0.8},
  {"name": "act", "type": "relu"},
  {"name": "out", "type": "dense", "units": 10, "relu": false, "weight_init": {"stddev": 0.05}}]})";
  expect_launch_matches_one_process(2, 1, 2, file);
}

// A child process of the test, with its output in a file.
struct Proc {
  pid_t pid = -1;
  std::string log;
};

Proc spawn(const std::vector<std::string>& args, const std::string& log,
           const std::vector<std::string>& env = {}) {
  Proc p;
  p.log = log;
  p.pid = fork();
  EXPECT_GE(p.pid, 0) << "fork: " << std::strerror(errno);
  if (p.pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);  // (a test binary that crashes leaves no role running)
    const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 1);
    dup2(fd, 2);
    for (const std::string& e : env) putenv(const_cast<char*>(e.c_str()));
    std::vector<char*> argv;
    const std::string bin = towers_binary();
    argv.push_back(const_cast<char*>(bin.c_str()));
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  return p;
}

// The words of a command line without quoting ("launch --ps 2 ..."), for spawn.
std::vector<std::string> words(const std::string& line) {
  std::vector<std::string> out;
  std::istringstream in(line);
  for (std::string w; in >> w;) out.push_back(w);
  return out;
}

// Waits up to seconds for p to end; returns its exit code, or -1 (then it is killed).
int wait_for(Proc& p, double seconds) {
  if (p.pid <= 0) return -1;  // (never started: there is no process to wait for or kill)
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  int st = 0;
  while (std::chrono::steady_clock::now() < until) {
    if (waitpid(p.pid, &st, WNOHANG) == p.pid)
      return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  kill(p.pid, SIGKILL);
  waitpid(p.pid, &st, 0);
  return -1;
}

std::string read_all(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Waits up to seconds until pred() holds.
template <class F>
bool eventually(double seconds, F pred) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < until) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return pred();
}

int free_port() { return remote::free_loopback_ports(1)[0]; }

// The local addresses of the listening TCP sockets on port (from /proc/net/tcp and tcp6).
std::vector<std::string> listeners(int port) {
  std::vector<std::string> out;
  for (const char* f : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(f);
    std::string line;
    std::getline(in, line);
    while (std::getline(in, line)) {
      std::istringstream ls(line);
      std::string slot, local, remote, state;
      ls >> slot >> local >> remote >> state;
      const auto colon = local.rfind(':');
      if (state == "0A" && std::stoi(local.substr(colon + 1), nullptr, 16) == port)
        out.push_back(local.substr(0, colon));
    }
  }
  return out;
}

TEST(RemoteCli, WrongTokenIsRejectedAndShardsListenOnLoopbackOnly) {
  const int port = free_port();
  const std::string cluster = write_file(
      "cluster.json", fmt::format(R"({{"cluster": {{"worker": ["127.0.0.1:1"], "ps": ["127.0.0.1:{}"]}}}})", port));
  const std::string good = write_file("good", "the-run-token\n"), bad = write_file("bad", "not-it\n");
  Proc shard = spawn({"ps", "--cluster", cluster, "--task", "ps:0", "--token-file", good},
                     test_path("ps.log"));
  ASSERT_TRUE(eventually(20, [&] { return !listeners(port).empty(); })) << read_all(shard.log);
  // 127.0.0.1 in /proc/net/tcp's byte order, or as an IPv4-mapped IPv6 address: never
  // 0.0.0.0 or ::, which would serve every interface.
  for (const std::string& a : listeners(port))
    EXPECT_TRUE(a == "0100007F" || a == "0000000000000000FFFF00000100007F") << a;
  std::string out;
  const int rc = run_towers(fmt::format("train --model mlp --dataset synthetic --synthetic-size 200 "
                                        "--steps 2 --quiet --cluster {} --task worker:0 "
                                        "--token-file {} --rpc-timeout 5", cluster, bad), &out);
  EXPECT_NE(rc, 0);
  EXPECT_NE(out.find("token"), std::string::npos) << out;
  EXPECT_NE(out.find("ps:0"), std::string::npos) << out;
  // No token at all is an error before any call.
  EXPECT_NE(run_towers(fmt::format("train --model mlp --dataset synthetic --steps 2 --cluster {} "
                                   "--task worker:0", cluster), &out), 0);
  EXPECT_NE(out.find("no token"), std::string::npos) << out;
  kill(shard.pid, SIGKILL);
  wait_for(shard, 10);
  EXPECT_NE(read_all(shard.log).find("wrong token"), std::string::npos) << read_all(shard.log);
}

TEST(RemoteCli, BadFlagsAreNamed) {
  const std::string cluster = write_file(
      "cluster.json", R"({"cluster": {"worker": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"]}})");
  const std::string token = write_file("token", "t\n");
  struct Case {
    std::string args, says;
  } cases[] = {
      {"train --model mlp --steps 1 --task worker:0", "--task worker:0 needs --cluster"},
      {"train --model mlp --steps 1 --cluster " + cluster + " --token-file " + token,
       "--task worker:I"},
      {"train --model mlp --steps 1 --cluster " + cluster + " --task ps:0 --token-file " + token,
       "towers ps"},
      {"train --model mlp --steps 1 --cluster " + cluster + " --task worker:0 --token-file " +
           token + " --clip-grad-norm 1",
       "--clip-grad-norm"},
      {"train --model mlp --steps 1 --cluster " + cluster + " --task worker:0 --token-file " +
           token + " --tls-cert " + token,
       "--tls-key"},
      {"train --model mlp --steps 1 --mode async --cluster " + cluster +
           " --task worker:0 "
           "--token-file " +
           token + " --staleness-aware-lr",
       "--staleness-aware-lr with a cluster"},
      {"train --model mlp --steps 1 --cluster " + cluster + " --task worker:0 --token-file " +
           token + " --rpc-piece-kib 0",
       "--rpc-piece-kib 0: pieces of 1 KiB to 256 MiB"},
      {"train --model mlp --steps 1 --cluster " + cluster + " --task worker:0 --token-file " +
           token + " --rpc-stripes 17",
       "--rpc-stripes 17: 1 to 16 connections a shard"},
      {"train --model mlp --steps 1 --cluster " + cluster + " --task worker:0 --token-file " +
           token + " --rpc-sessions maybe",
       "--rpc-sessions = maybe"},
      {"ps --cluster " + cluster + " --task worker:0 --token-file " + token,
       "the task must be ps:I"},
      {"launch --workers 2 -- train --model mlp --towers 2",
       "--towers is set by the launcher (use --towers-per-worker"},
      {"launch --workers 2 -- train --model mlp --cluster c.json",
       "--cluster is set by the launcher (it writes the cluster file"},
      {"launch --workers 0 -- train --model mlp", "--workers must be in 1..64"},
      {"launch --workers 2 train --model mlp", "give the training flags after --"},
  };
  for (const Case& c : cases) {
    std::string out;
    EXPECT_NE(run_towers(c.args, &out), 0) << c.args;
    EXPECT_NE(out.find(c.says), std::string::npos) << c.args << "\n" << out;
  }
}

// The processes of a launch, from its processes.json.
std::map<std::string, pid_t> launched(const std::string& dir) {
  std::map<std::string, pid_t> out;
  std::ifstream in(dir + "/processes.json");
  if (!in.good()) return out;
  try {
    for (const auto& p : nlohmann::json::parse(in)) out[p["task"]] = p["pid"].get<pid_t>();
  } catch (const nlohmann::json::exception&) {
    out.clear();  // still being written
  }
  return out;
}

// Launches 2 workers of the mlp on synthetic data with the given extra flags, waits until
// worker 1 has taken 5 steps, and kills it with kill -9 (or sends it `sig`, with the launch's
// --grace `grace`); returns the launcher, still running.
Proc launch_and_kill_worker_1(const std::string& dir, int ps, std::vector<std::string> flags,
                              int sig = SIGKILL, const std::string& grace = "30") {
  std::vector<std::string> args = {"launch", "--ps", std::to_string(ps), "--workers", "2",
                                   "--out",  dir,    "--grace",          grace,       "--"};
  for (const char* a :
       {"train", "--model", "mlp", "--dataset", "synthetic", "--synthetic-size", "2000", "--batch",
        "16", "--eval-every", "0", "--log-every", "1", "--heartbeat-timeout", "1"})
    args.push_back(a);
  args.insert(args.end(), flags.begin(), flags.end());
  Proc l = spawn(args, test_path("launch.log"));
  const bool stepping = eventually(60, [&] {
    return live_metrics_events(dir + "/worker-1.jsonl", "step").size() >= 5 &&
           launched(dir).count("worker:1");
  });
  EXPECT_TRUE(stepping) << read_all(l.log);
  if (stepping) {
    // Launched roles run OpenBLAS single-threaded and are told so before it loads (no helper
    // thread spinning at start); a value of the user's own is passed on unchanged.
    const pid_t w1 = launched(dir)["worker:1"];
    const std::string env = read_all("/proc/" + std::to_string(w1) + "/environ");
    const char* mine = std::getenv("OPENBLAS_NUM_THREADS");
    const std::string want = std::string("OPENBLAS_NUM_THREADS=") + (mine ? mine : "1");
    std::vector<std::string> vars;
    for (size_t at = 0, end; at < env.size(); at = end + 1) {
      end = env.find('\0', at);
      if (end == std::string::npos) end = env.size();
      vars.push_back(env.substr(at, end - at));
    }
    EXPECT_NE(std::find(vars.begin(), vars.end(), want), vars.end()) << want;
    EXPECT_EQ(kill(w1, sig), 0);
  }
  return l;
}

// An async run of 600 steps in which worker 1 is sent `sig` after its fifth step (the
// launch's --grace: `grace`): it finishes with exit 0, the chief's summary names worker 1 as
// lost, the launcher says that worker 1 ended by signal `ended_by`, and no role is left
// running (the launcher has reaped them all).
void expect_async_run_outlives_worker_1(int sig, const std::string& grace, int ended_by) {
  const std::string dir = test_path("launch");
  Proc l = launch_and_kill_worker_1(dir, 2,
                                    {"--mode", "async", "--lr", "0.01", "--steps", "600",
                                     "--slow-tower", "0:10", "--slow-tower", "1:10"},
                                    sig, grace);
  const int rc = wait_for(l, 120);
  const std::string out = read_all(l.log);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find(fmt::format("worker:1: killed by signal {}", ended_by)), std::string::npos)
      << out;
  EXPECT_NE(out.find("lost worker(s) 1"), std::string::npos) << out;
  const auto summary = metrics_events(dir + "/worker-0.jsonl", "summary");
  ASSERT_EQ(summary.size(), 1u);
  EXPECT_EQ(summary[0]["lost_workers"], nlohmann::json::array({1}));
  EXPECT_GE(summary[0]["steps"].get<int64_t>(), 600);
  for (const auto& [task, pid] : launched(dir))
    EXPECT_NE(kill(pid, 0), 0) << task << " is still running";
}

// An async run goes on when a worker dies: the shards count it lost, the chief finishes the
// run and says so.
TEST(RemoteCli, AsyncRunFinishesWhenAWorkerIsKilled) {
  expect_async_run_outlives_worker_1(SIGKILL, "30", SIGKILL);
}

// A worker that stops without dying (SIGSTOP: a hung process) is lost to the shards as a dead
// one is: its calls stop, the run finishes without it, and the launcher, once the others are
// done and its grace (2 s) is over, ends it with SIGTERM (and SIGCONT: a stopped process takes
// a SIGTERM only once it runs again), so that nothing is left running.
TEST(RemoteCli, AsyncRunFinishesWhenAWorkerHangs) {
  expect_async_run_outlives_worker_1(SIGSTOP, "2", SIGTERM);
}

// Async across workers: a step's staleness is what the shards saw at its apply, the other
// worker's pushes included. Worker 1's steps take 45 ms more than worker 0's, so worker 0
// pushes while every step of worker 1 runs: worker 1's pushes are stale, and its metrics say
// so, step by step and in the summary's histogram (before, each worker counted only its own
// process's updates and recorded 0). The run is long enough (400 updates, at least 6 s for
// worker 0 alone) that worker 1 joins it, however slowly it starts.
TEST(RemoteCli, AsyncWorkersRecordTheStalenessTheShardsSaw) {
  const std::string dir = test_path("launch");
  std::string out;
  ASSERT_EQ(run_towers(fmt::format("launch --ps 2 --workers 2 --out {} -- train --model mlp "
                                   "--dataset synthetic --synthetic-size 2000 --batch 16 --mode "
                                   "async --lr 0.01 --slow-tower 0:15 --slow-tower 1:60 --steps 400 "
                                   "--eval-every 0 --log-every 1", dir), &out), 0) << out;
  const auto steps = metrics_events(dir + "/worker-1.jsonl", "step");
  const auto summary = metrics_events(dir + "/worker-1.jsonl", "summary");
  ASSERT_EQ(summary.size(), 1u);
  ASSERT_FALSE(steps.empty());
  int64_t most = 0, stale = 0;
  for (const auto& s : steps) {
    most = std::max(most, s["staleness"].get<int64_t>());
    stale += s["staleness"].get<int64_t>() > 0;
  }
  EXPECT_GE(most, 1) << out;
  EXPECT_GT(stale, static_cast<int64_t>(steps.size()) / 2);
  EXPECT_EQ(summary[0]["max_staleness"].get<int64_t>(), most);
  int64_t counted = 0;
  for (const auto& [k, v] : summary[0]["staleness_histogram"].items()) counted += v.get<int64_t>();
  EXPECT_EQ(counted, static_cast<int64_t>(steps.size()));
}

// A sync push's time includes its wait at the barrier for the other workers' gradients; the
// shards count that wait and the worker's summary gives it apart (remote.push_wait_seconds).
// Worker 1's tower sleeps 60 ms a step, so worker 0, pushing first, waits at every round
// (bounded below by a quarter of the sleeps, whatever the load), and worker 1, arriving last,
// finds each round complete. Async pushes never wait.
TEST(RemoteCli, SyncPushesReportTheirWaitAtTheBarrier) {
  const std::string dir = test_path("launch"), async_dir = test_path("async");
  std::string out;
  const std::string train =
      "train --model mlp --dataset synthetic --synthetic-size 2000 "
      "--batch 16 --lr 0.01 --steps 20 --eval-every 0 --slow-tower 1:60";
  ASSERT_EQ(
      run_towers(fmt::format("launch --ps 2 --workers 2 --out {} -- {} --mode sync", dir, train),
                 &out),
      0)
      << out;
  double wait[2] = {0, 0};
  for (int w = 0; w < 2; ++w) {
    const auto summary = metrics_events(fmt::format("{}/worker-{}.jsonl", dir, w), "summary");
    ASSERT_EQ(summary.size(), 1u) << w;
    const auto& r = summary[0]["remote"];
    wait[w] = r["push_wait_seconds"].get<double>();
    EXPECT_GE(wait[w], 0.0) << w;
    EXPECT_LE(wait[w], r["push_seconds"].get<double>()) << w;
  }
  EXPECT_GE(wait[0], 0.25 * 20 * 0.060) << out;
  EXPECT_GT(wait[0], wait[1]) << out;
  ASSERT_EQ(run_towers(fmt::format("launch --ps 1 --workers 2 --out {} -- {} --mode async",
                                   async_dir, train),
                       &out),
            0)
      << out;
  for (int w = 0; w < 2; ++w) {
    const auto summary = metrics_events(fmt::format("{}/worker-{}.jsonl", async_dir, w), "summary");
    ASSERT_EQ(summary.size(), 1u) << w;
    EXPECT_EQ(summary[0]["remote"]["push_wait_seconds"].get<double>(), 0.0) << w;
  }
}

// Plain sync cannot go on without a worker: the chief stops with an error that names it.
TEST(RemoteCli, SyncStopsNamingTheLostWorker) {
  const std::string dir = test_path("launch");
  Proc l = launch_and_kill_worker_1(dir, 1, {"--mode", "sync", "--steps", "100000",
                                             "--checkpoint-dir", dir + "/ck"});
  const int rc = wait_for(l, 120);
  const std::string out = read_all(l.log);
  EXPECT_EQ(rc, 1) << out;
  EXPECT_NE(out.find("worker(s) 1 lost"), std::string::npos) << out;
  // The chief saved the last complete round before it stopped.
  EXPECT_NE(out.find("the last complete round"), std::string::npos) << out;
  EXPECT_FALSE(only_checkpoint(dir + "/ck").empty());
}

// Plain sync over two shard processes, the chief a real `towers train`, worker 1 this test
// (its pushes by hand): the two take rounds 0 to 2; then worker 1 sends its whole round 3 to
// ps:0 and the first two pieces of it to ps:1, and falls silent. ps:0 completes round 3; ps:1
// applies the two pieces (the chief's are there) and, once worker 1 is lost, its watchdog puts
// them back. The chief's failure path (trainer.cpp) brings ps:0 back to round 3 (TakeBack),
// saves round 3's start and stops with an error naming worker 1 and the file. What it saved is
// bitwise what both shards held before worker 1's round 3 (parameters, momentum, the update
// count): a worker lost between two shards' parts of a push costs no complete round.
// (SyncStopsNamingTheLostWorker and scripts/kill-shards.sh kill a worker wherever it is; this
// is the one moment, every time.)
TEST(RemoteCli, SyncChiefSavesTheRoundCompleteOnEveryShardWhenAWorkerDiesBetweenShards) {
  const std::string dir = test_path("between");
  const std::vector<int> ports = remote::free_loopback_ports(2);
  const std::vector<std::string> ps = {fmt::format("127.0.0.1:{}", ports[0]),
                                       fmt::format("127.0.0.1:{}", ports[1])};
  const std::string cluster = write_file(
      "cluster.json",
      fmt::format(
          R"({{"cluster": {{"worker": ["127.0.0.1:1", "127.0.0.1:2"], "ps": ["{}", "{}"]}}}})",
          ps[0], ps[1]));
  const std::string token = write_file("token", "run-token\n");
  std::vector<Proc> shards;
  for (int i = 0; i < 2; ++i)
    shards.push_back(spawn(
        {"ps", "--cluster", cluster, "--task", fmt::format("ps:{}", i), "--token-file", token},
        test_path(fmt::format("ps-{}.log", i))));
  Proc chief = spawn(
      words(fmt::format("train --model mlp --dataset synthetic --synthetic-size 2000 --batch 16 "
                        "--mode sync --steps 1000 --seed 4 --eval-every 0 --log-every 1 "
                        "--optimizer momentum --lr 0.05 --heartbeat-timeout 3 --rpc-piece-kib 16 "
                        "--rpc-timeout 60 --checkpoint-dir {}/ck --cluster {} --task worker:0 "
                        "--token-file {}",
                        dir, cluster, token)),
      test_path("chief.log"));
  struct Ends {  // every process of the test ends with it
    std::vector<Proc*> procs;
    ~Ends() {
      for (Proc* p : procs)
        if (p->pid > 0 && kill(p->pid, SIGKILL) == 0) wait_for(*p, 10);
    }
  } ends{{&chief, &shards[0], &shards[1]}};
  auto logs = [&] {
    return read_all(chief.log) + "\nps:0:\n" + read_all(shards[0].log) + "\nps:1:\n" +
           read_all(shards[1].log);
  };

  // Worker 1 joins once the chief has initialised both shards: their layout, ranges and pieces.
  std::vector<remote::InfoReply> info(2);
  ASSERT_TRUE(eventually(60, [&] {
    for (int i = 0; i < 2; ++i) {
      remote::ShardSet one({ps[i]}, "run-token", {});
      remote::InfoRequest req;
      auto ctx = remote::call_context("run-token", 5);
      if (!one.stub(0).Info(ctx.get(), req, &info[i]).ok() || !info[i].initialized()) return false;
    }
    return true;
  })) << logs();
  Heartbeats beat0(ps[0], 1, "run-token"), beat1(ps[1], 1, "run-token");
  std::vector<float> g(static_cast<size_t>(info[0].total()), 0.001f);
  // Worker 1's push of round r to ps:i: its first n pieces; the error, if it failed.
  auto push = [&](int64_t r, int i, int n, remote::PushReply* reply = nullptr) -> std::string {
    remote::PushRequest h;
    h.set_layout_hash(info[i].layout_hash());
    h.set_worker(1);
    h.set_round(r);
    h.set_lr(0.05f);
    h.set_examples(16);
    h.set_towers(1);
    h.set_loss_sum(16 * 2.3);
    h.set_generation(info[i].generation());
    std::vector<grpc::ByteBuffer> messages;
    const int64_t n_floats = info[i].end() - info[i].begin();
    remote::for_each_piece(n_floats, info[i].piece_floats(), [&](int64_t lo, int64_t hi) {
      messages.push_back(piece(h, lo, g, info[i].begin() + lo, info[i].begin() + hi));
      return static_cast<int>(messages.size()) < n;
    });
    return push_stream(ps[i], "run-token", std::move(messages), 30, reply);
  };
  const int kAll = 1 << 30;
  for (int64_t r = 0; r < 3; ++r)
    for (int i = 0; i < 2; ++i)
      ASSERT_EQ(push(r, i, kAll), "") << "round " << r << ", ps:" << i << "\n" << logs();

  // What both shards hold before round 3 (no piece of it can be applied without worker 1's):
  // the layout, the parameters and the momentum slot, read as a reader.
  const remote::PulledModel before =
      remote::pull_model(remote::read_cluster(cluster, "").cluster, "run-token", {}, 30);
  ASSERT_EQ(before.versions, (std::vector<int64_t>{3, 3}));
  std::vector<float> params(g.size()), momentum(g.size());
  for (int i = 0; i < 2; ++i) {
    remote::ShardSet one({ps[i]}, "run-token", {});
    remote::PullRequest req;
    req.set_layout_hash(info[i].layout_hash());
    req.set_worker(-1);
    req.set_with_slots(true);
    remote::PullReply rep;
    auto ctx = remote::call_context("run-token", 30);
    ASSERT_TRUE(one.stub(0).Pull(ctx.get(), req, &rep).ok()) << "ps:" << i;
    ASSERT_EQ(rep.version(), 3);
    ASSERT_EQ(rep.updates(), 3);
    const size_t bytes = sizeof(float) * static_cast<size_t>(info[i].end() - info[i].begin());
    ASSERT_EQ(rep.params().size(), bytes);
    ASSERT_EQ(rep.slots_size(), 1);
    std::memcpy(params.data() + info[i].begin(), rep.params().data(), bytes);
    std::memcpy(momentum.data() + info[i].begin(), rep.slots(0).data(), bytes);
  }
  ASSERT_EQ(0, std::memcmp(params.data(), before.params.data(), sizeof(float) * params.size()));

  // Round 3: whole to ps:0, where it completes (the reply comes once it is applied); silence
  // there from then on (ps:0 counts worker 1 lost first, so that it is ready for the chief's
  // TakeBack when ps:1 is); two pieces of it to ps:1 (a stream cut short: refused, the pieces
  // kept); then silence.
  ASSERT_GE(remote::messages_of(info[1].end() - info[1].begin(), info[1].piece_floats()), 4);
  remote::PushReply applied;
  ASSERT_EQ(push(3, 0, kAll, &applied), "") << logs();
  beat0.stop();
  EXPECT_EQ(applied.version(), 4);
  EXPECT_TRUE(applied.applied());
  const std::string cut = push(3, 1, 2);
  beat1.stop();
  EXPECT_NE(cut.find("worker 1's push of round 3 ended after"), std::string::npos) << cut;

  const int rc = wait_for(chief, 120);
  ends.procs.erase(ends.procs.begin());  // (reaped)
  const std::string out = read_all(chief.log);
  ASSERT_EQ(rc, 1) << logs();
  EXPECT_NE(out.find("round 3 cannot complete: worker(s) 1 lost"), std::string::npos) << out;
  const std::optional<std::string> saved = io::checkpoint_of(dir + "/ck", 3);
  ASSERT_TRUE(saved.has_value()) << logs();
  EXPECT_NE(out.find(fmt::format("the last complete round, step 3, is saved in {}", *saved)),
            std::string::npos)
      << out;
  const io::Checkpoint ck = io::load_checkpoint(*saved, *before.layout, {"momentum"});
  EXPECT_EQ(ck.meta.step, 3);
  EXPECT_EQ(ck.meta.optimizer_state.value("updates", int64_t{-1}), 3) << ck.meta.optimizer_state;
  for (const auto& v : before.layout->variables()) {
    const size_t at = static_cast<size_t>(v.offset),
                 bytes = sizeof(float) * static_cast<size_t>(v.size);
    EXPECT_EQ(0, std::memcmp(ck.params.data() + at, params.data() + at, bytes)) << v.spec.name;
    EXPECT_EQ(0, std::memcmp(ck.slots.at(0).second.data() + at, momentum.data() + at, bytes))
        << v.spec.name;
  }
  // The shards end by themselves (the chief is done, worker 1 lost), cleanly.
  for (int i = 0; i < 2; ++i) EXPECT_EQ(wait_for(shards[i], 30), 0) << "ps:" << i << "\n" << logs();
  ends.procs.clear();  // (reaped)
}

// A second launch into the folder of an earlier one is refused before it touches anything (the
// earlier run's metrics, logs, token and shard checkpoints stay as they were), unless it
// continues that run with --resume and the chief's --checkpoint-dir: then the logs and the
// workers' metrics go on. A launch that failed before any results may be run again.
TEST(RemoteCli, ALaunchDoesNotOverwriteAnEarlierLaunch) {
  namespace fs = std::filesystem;
  const std::string dir = test_path("launch");
  const std::string data =
      "--model mlp --dataset synthetic --synthetic-size 512 --batch 32 --mode sync --eval-every 0";
  const std::string flags = fmt::format("{} --checkpoint-dir {}/ck", data, dir);
  auto launch = [&](const std::string& train, std::string* out) {
    return run_towers(fmt::format("launch --ps 1 --workers 2 --out {} -- train {}", dir, train),
                      out);
  };
  std::string out;
  EXPECT_NE(launch(flags + " --steps 6 --lr -1", &out), 0) << out;  // (refused: no results)
  ASSERT_EQ(launch(flags + " --steps 6", &out), 0) << out;
  EXPECT_FALSE(fs::exists(dir + "/worker-0.log"));  // (the chief's output is on the terminal)
  auto snapshot = [&] {
    std::map<std::string, std::string> files;
    for (const auto& e : fs::recursive_directory_iterator(dir))
      if (e.is_regular_file()) files[e.path().string()] = read_all(e.path().string());
    return files;
  };
  const auto before = snapshot();
  ASSERT_GT(before.count(dir + "/worker-1.jsonl"), 0u);
  ASSERT_TRUE(fs::exists(dir + "/ps-checkpoints")) << out;
  ASSERT_FALSE(fs::is_empty(dir + "/ps-checkpoints")) << out;
  // (only the chief evaluates: the other worker's summary names no weights)
  EXPECT_TRUE(metrics_events(dir + "/worker-1.jsonl", "summary").at(0)["weights"].is_null());
  EXPECT_NE(launch(flags + " --steps 6", &out), 0) << out;
  EXPECT_NE(out.find(fmt::format("--out: '{}' holds the results of an earlier launch ({}/worker-0."
                                 "jsonl, {}/worker-1.jsonl, {}/ps-checkpoints/)",
                                 dir, dir, dir, dir)),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("add --resume to the training flags"), std::string::npos) << out;
  // --resume without the chief's checkpoints cannot continue it either.
  EXPECT_NE(launch(data + " --steps 6 --resume", &out), 0) << out;
  EXPECT_NE(out.find("with the --checkpoint-dir its chief wrote"), std::string::npos) << out;
  EXPECT_EQ(snapshot(), before) << "a refused launch changed the earlier launch's files";
  // Continuing the run: from the chief's checkpoint of step 6 to step 10, the logs and the
  // metrics appended to.
  ASSERT_EQ(launch(flags + " --steps 10 --resume", &out), 0) << out;
  const auto summary = metrics_events(dir + "/worker-0.jsonl", "summary");
  ASSERT_EQ(summary.size(), 2u);
  EXPECT_EQ(summary[1]["steps"], 10);
  EXPECT_EQ(summary[1]["start_step"], 6);
  EXPECT_EQ(metrics_events(dir + "/worker-1.jsonl", "summary").size(), 2u);
  const std::string log = read_all(dir + "/worker-1.log");
  EXPECT_EQ(log.rfind(before.at(dir + "/worker-1.log"), 0), 0u) << log;
  EXPECT_GT(log.size(), before.at(dir + "/worker-1.log").size());
}

// Backup workers: with --replicas-to-aggregate 1 of 2 workers, a round is applied with the
// first worker's gradient, the straggler's (global tower 1) arrives late and is dropped, and
// the run goes on.
TEST(RemoteCli, BackupWorkersDropTheStragglersLateGradients) {
  const std::string dir = test_path("launch");
  std::string out;
  // In 16 KiB pieces: its pushes and pulls travel in stripes, between whose reads a round may
  // be applied.
  const std::string flags =
      "--model mlp --dataset synthetic --synthetic-size 2000 --batch 16 --mode sync "
      "--replicas-to-aggregate 1 --slow-tower 0:10 --slow-tower 1:40 --steps 200 --eval-every 0 "
      "--log-every 1 --rpc-piece-kib 16";
  ASSERT_EQ(
      run_towers(fmt::format("launch --ps 2 --workers 2 --out {} -- train {}", dir, flags), &out),
      0)
      << out;
  const auto summary = metrics_events(dir + "/worker-0.jsonl", "summary");
  ASSERT_EQ(summary.size(), 1u);
  EXPECT_GE(summary[0]["steps"].get<int64_t>(), 200);
  EXPECT_GT(summary[0]["dropped_by_shards"].get<int64_t>(), 0) << out;
  for (const auto& s : metrics_events(dir + "/worker-0.jsonl", "step"))
    EXPECT_LE(s["contributors"].get<int>(), 1);
}

}  // namespace
}  // namespace towers

namespace towers {
namespace {

// Whether shard i of a launch in dir has written a checkpoint (ps-I-VERSION.ckpt).
// The version of shard i's latest checkpoint in a launch in dir, or -1 for none. A shard saves
// the run's start (the chief's Init) before the chief's first Save.
int64_t shard_saved(const std::string& dir, int i) {
  int64_t latest = -1;
  const std::string prefix = fmt::format("ps-{}-", i);
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir + "/ps-checkpoints", ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(prefix, 0) == 0 && e.path().extension() == ".ckpt")
      latest = std::max<int64_t>(latest, std::stoll(name.substr(prefix.size())));
  }
  return latest;
}

// Starts shard i of a launch in dir again with its command line (from processes.json).
Proc restart_shard(const std::string& dir, int i) {
  const std::string task = fmt::format("ps:{}", i);
  std::vector<std::string> argv;
  {
    std::ifstream in(dir + "/processes.json");
    for (const auto& p : nlohmann::json::parse(in))
      if (p["task"] == task)
        for (size_t a = 1; a < p["argv"].size(); ++a) argv.push_back(p["argv"][a]);
  }
  EXPECT_FALSE(argv.empty());
  return spawn(argv, test_path(fmt::format("ps-{}-again.log", i)));
}

// Kills shard i of a launch in dir with kill -9 and starts it again with the same command line.
Proc kill_and_restart_shard(const std::string& dir, int i) {
  std::map<std::string, pid_t> procs = launched(dir);
  EXPECT_EQ(kill(procs[fmt::format("ps:{}", i)], SIGKILL), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  return restart_shard(dir, i);
}

// A shard killed with kill -9 and started again with the same flags restores its range from
// its last checkpoint; the workers reconnect and an async run finishes. The async tests use
// lr 0.01: two interleaved Hogwild workers with momentum 0.9 at the default lr 0.1 diverge on
// this data, in one process as in two (staleness acts as extra momentum).
TEST(RemoteCli, KilledShardRestartsFromItsCheckpointAndTheRunFinishes) {
  const std::string dir = test_path("launch");
  Proc l =
      spawn({"launch", "--ps", "2", "--workers", "2", "--out", dir, "--", "train", "--model", "mlp",
             "--dataset", "synthetic", "--synthetic-size", "1000", "--batch", "16", "--mode",
             "async", "--lr", "0.01", "--steps", "700", "--eval-every", "0", "--log-every", "1",
             "--slow-tower", "0:10", "--slow-tower", "1:10", "--checkpoint-dir", dir + "/ck",
             "--checkpoint-every", "0.5", "--rpc-timeout", "60",
             // pieces of 16 KiB: the mlp's pushes and pulls travel in stripes, and the
             // killed shard's connections break under them
             "--rpc-piece-kib", "16"},
            test_path("launch.log"));
  ASSERT_TRUE(eventually(90, [&] { return shard_saved(dir, 1) > 0; })) << read_all(l.log);
  Proc again = kill_and_restart_shard(dir, 1);
  const int rc = wait_for(l, 180);
  const std::string out = read_all(l.log);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("ps:1: killed by signal 9"), std::string::npos) << out;
  EXPECT_EQ(wait_for(again, 60), 0) << read_all(again.log);
  const std::string shard_log = read_all(again.log);
  EXPECT_NE(shard_log.find("ps-1-"), std::string::npos) << shard_log;  // restored from its file
  const auto summary = metrics_events(dir + "/worker-0.jsonl", "summary");
  ASSERT_EQ(summary.size(), 1u) << out;
  EXPECT_GE(summary[0]["steps"].get<int64_t>(), 700);
}

// An async worker alone (its peer lost, or a cluster of one) reaches the run's steps though a
// shard restarted from its checkpoint lost the updates since: the run ends at the shards'
// version, and the worker's own count of updates, which reached the end first, does not end
// it early (before, it ended short by the updates lost).
TEST(RemoteCli, AnAsyncWorkerAloneReachesTheStepsAfterAShardLostUpdates) {
  const std::string dir = test_path("launch");
  Proc l = spawn(words(fmt::format(
                     "launch --ps 2 --workers 1 --out {} -- train --model mlp --dataset synthetic "
                     "--synthetic-size 1000 --batch 16 --mode async --lr 0.01 --steps 400 "
                     "--eval-every 0 --log-every 1 --slow-tower 0:10 --checkpoint-dir {}/ck "
                     "--checkpoint-every 2 --rpc-timeout 60",
                     dir, dir)),
                 test_path("launch.log"));
  // A checkpoint every 125 updates: killed at least 30 updates after the first one, before
  // the second.
  ASSERT_TRUE(eventually(90, [&] {
    const auto steps = live_metrics_events(dir + "/worker-0.jsonl", "step");
    if (steps.empty() || shard_saved(dir, 1) <= 0) return false;
    const int64_t at = steps.back()["step"].get<int64_t>();
    return at >= 160 && at < 230;
  })) << read_all(l.log);
  Proc again = kill_and_restart_shard(dir, 1);
  const int rc = wait_for(l, 180);
  const std::string out = read_all(l.log);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_EQ(wait_for(again, 60), 0) << read_all(again.log);
  EXPECT_NE(read_all(again.log).find("from version 125"), std::string::npos) << read_all(again.log);
  const auto summary = metrics_events(dir + "/worker-0.jsonl", "summary");
  ASSERT_EQ(summary.size(), 1u) << out;
  EXPECT_GE(summary[0]["steps"].get<int64_t>(), 400) << out;
}

// A shard restarted once its run is over (its workers said they were done to the incarnation
// that was killed) restores its checkpoint, hears from no worker, and exits by itself after the
// heartbeat timeout and a grace of 5 s, rather than wait for workers that are gone.
TEST(RemoteCli, AShardRestartedAfterItsRunEndedExitsByItself) {
  const std::string dir = test_path("launch");
  std::string out;
  ASSERT_EQ(run_towers(fmt::format("launch --ps 2 --workers 2 --out {} -- train --model mlp "
                                   "--dataset synthetic --synthetic-size 500 --batch 16 --mode "
                                   "async --steps 60 --checkpoint-every 0.5 --checkpoint-dir {}/ck "
                                   "--heartbeat-timeout 1 --quiet",
                                   dir, dir),
                       &out),
            0)
      << out;
  ASSERT_GT(shard_saved(dir, 0), 0) << out;
  Proc again = restart_shard(dir, 0);
  EXPECT_EQ(wait_for(again, 60), 0) << read_all(again.log);
  const std::string log = read_all(again.log);
  EXPECT_NE(log.find("initialised by"), std::string::npos) << log;  // it restored its file
  EXPECT_NE(log.find("worker 1 lost: no call since this shard restarted"), std::string::npos)
      << log;
  EXPECT_NE(log.find("no worker has called since this shard restarted"), std::string::npos) << log;
}

// A shard that does not run for longer than the heartbeat timeout (SIGSTOP here; a paused VM
// or a machine swapping alike) loses no worker: their calls of that time wait in its sockets,
// and the time it did not run does not count against them. Before, it woke to count both
// workers lost, and the sync run stopped naming one of them.
TEST(RemoteCli, AShardThatDoesNotRunForAWhileLosesNoWorker) {
  const std::string dir = test_path("launch");
  Proc l = spawn(words(fmt::format(
                     "launch --ps 2 --workers 2 --out {} -- train --model mlp --dataset synthetic "
                     "--synthetic-size 1000 --batch 16 --mode sync --steps 200 --eval-every 0 "
                     "--log-every 1 --heartbeat-timeout 1 --rpc-timeout 60 --slow-tower 0:10",
                     dir)),
                 test_path("launch.log"));
  ASSERT_TRUE(eventually(60, [&] {
    return live_metrics_events(dir + "/worker-0.jsonl", "step").size() >= 10;
  })) << read_all(l.log);
  const pid_t shard = launched(dir)["ps:0"];
  ASSERT_EQ(kill(shard, SIGSTOP), 0);
  std::this_thread::sleep_for(std::chrono::seconds(3));  // 3 heartbeat timeouts
  ASSERT_EQ(kill(shard, SIGCONT), 0);
  const int rc = wait_for(l, 120);
  const std::string out = read_all(l.log);
  EXPECT_EQ(rc, 0) << out;
  const std::string shard_log = read_all(dir + "/ps-0.log");
  EXPECT_EQ(shard_log.find("lost: no call"), std::string::npos) << shard_log;
  EXPECT_NE(shard_log.find("this shard did not run for"), std::string::npos) << shard_log;
  for (int w = 0; w < 2; ++w) {
    const auto summary = metrics_events(fmt::format("{}/worker-{}.jsonl", dir, w), "summary");
    ASSERT_EQ(summary.size(), 1u) << out;
    EXPECT_EQ(summary[0]["steps"].get<int64_t>(), 200);
  }
}

// The last checkpoint in `ck` holds bitwise the tensors (parameters and slots) of one process
// with 2 towers trained with `flags`, which writes its checkpoints to the folder `one`.
void expect_last_checkpoint_of_one_process(const std::string& flags, const std::string& ck,
                                           const std::string& one) {
  std::string ref;
  ASSERT_EQ(run_towers(fmt::format("train {} --towers 2 --quiet --metrics {}/m.jsonl "
                                   "--checkpoint-dir {}",
                                   flags, one, one),
                       &ref),
            0)
      << ref;
  const std::string a = tensor_bytes(*io::latest_checkpoint(one));
  const std::string b = tensor_bytes(*io::latest_checkpoint(ck));
  ASSERT_FALSE(a.empty());
  EXPECT_TRUE(a == b) << "the parameters and slots differ from one process's";
}

// Sync: a launch of 2 workers, whose shard ps:1 is killed and restarted while the chief is at
// a step in [kill_from, kill_to) with the shard's latest checkpoint in [saved_from, saved_to]:
// the restarted shard is rounds behind the others. Every shard goes back to its round (each
// restores its own checkpoint of it), the workers take the steps after it again, and the run
// ends bitwise where one process with the same towers ends: a kill -9 costs time, not work.
void expect_sync_rollback_ends_bitwise(const std::string& checkpoint_every, int64_t kill_from,
                                       int64_t kill_to, int64_t saved_from, int64_t saved_to) {
  const std::string flags = fmt::format(
      "--model mlp --dataset synthetic --synthetic-size 1000 --batch 16 --mode sync --steps 240 "
      "--seed 5 --eval-every 0 --log-every 1 --checkpoint-every {} --optimizer adam --lr 0.001",
      checkpoint_every);
  const std::string dir = test_path("launch"), one = test_path("one");
  std::vector<std::string> args = {"launch", "--ps", "2", "--workers", "2", "--out", dir, "--",
                                   "train", "--checkpoint-dir", dir + "/ck", "--rpc-timeout", "60",
                                   "--slow-tower", "0:15", "--slow-tower", "1:15",
                                   // in stripes: a rollback refuses every stripe of a push
                                   "--rpc-piece-kib", "16"};
  for (const std::string& w : words(flags)) args.push_back(w);
  Proc l = spawn(args, test_path("launch.log"));
  ASSERT_TRUE(eventually(90, [&] {
    const auto steps = live_metrics_events(dir + "/worker-0.jsonl", "step");
    const int64_t saved = shard_saved(dir, 1);
    if (steps.empty() || saved < saved_from || saved > saved_to) return false;
    const int64_t at = steps.back()["step"].get<int64_t>();
    return at >= kill_from && at < kill_to;
  })) << read_all(l.log);
  Proc again = kill_and_restart_shard(dir, 1);
  const int rc = wait_for(l, 180);
  const std::string out = read_all(l.log);
  ASSERT_EQ(rc, 0) << out;
  EXPECT_EQ(wait_for(again, 60), 0) << read_all(again.log);
  EXPECT_NE(read_all(again.log).find("workers will be asked to roll back"), std::string::npos)
      << read_all(again.log);
  EXPECT_NE(out.find("the run goes on from step"), std::string::npos) << out;
  for (int w = 0; w < 2; ++w) {
    const std::string metrics = fmt::format("{}/worker-{}.jsonl", dir, w);
    const auto back = metrics_events(metrics, "rollback");
    ASSERT_GE(back.size(), 1u) << "worker " << w << "\n" << out;
    // Back to a round the run had reached, and that the shard had saved.
    int64_t reached = 0;
    {
      std::ifstream in(metrics);
      for (std::string line; std::getline(in, line);) {
        const auto j = nlohmann::json::parse(line);
        if (j["event"] == "rollback") break;
        if (j["event"] == "step") reached = std::max(reached, j["step"].get<int64_t>());
      }
    }
    EXPECT_LE(back[0]["step"].get<int64_t>(), reached);
    EXPECT_GE(back[0]["step"].get<int64_t>(), std::max<int64_t>(saved_from, 0));
    EXPECT_LE(back[0]["step"].get<int64_t>(), saved_to);
    const auto summary = metrics_events(fmt::format("{}/worker-{}.jsonl", dir, w), "summary");
    ASSERT_EQ(summary.size(), 1u) << out;
    EXPECT_EQ(summary[0]["steps"].get<int64_t>(), 240);
    EXPECT_GE(summary[0]["rollbacks"].get<int>(), 1);
  }
  expect_last_checkpoint_of_one_process(flags, dir + "/ck", one);
}

// Killed well after the shard's first Save (about 16 steps in: twice an epoch of 31), so that
// the others are rounds ahead of it.
TEST(RemoteCli, SyncRunRollsBackToARestartedShardsCheckpointAndEndsBitwise) {
  expect_sync_rollback_ends_bitwise("0.5", 40, 200, 10, 200);
}

// Killed before the chief's first Save (at step 155: every 5 epochs): the shard restores the
// checkpoint it wrote of the run's start, and the run goes back to step 0. Before, the
// restarted shard had nothing to restore, and the run failed: "ps:1 has no parameters of this
// run". (The kill does not wait for that checkpoint: without it, the test shows the failure.)
TEST(RemoteCli, AShardKilledBeforeTheFirstSaveRestoresTheRunsStart) {
  expect_sync_rollback_ends_bitwise("5", 10, 100, -1, 0);
}

// A shard that cannot write its checkpoint (its folder gone, a full disk) stops the run with the
// shard's error, which names the file and why, once: the chief does not try the same
// checkpoint again on its way out. The chief's own file of that step, written before it asks
// the shards, is there for --resume.
TEST(RemoteCli, AShardThatCannotSaveStopsTheRunNamingTheFile) {
  const std::string dir = test_path("launch");
  Proc l = spawn(words(fmt::format(
                     "launch --ps 2 --workers 2 --out {} -- train --model mlp --dataset synthetic "
                     "--synthetic-size 320 --batch 16 --mode sync --steps 200 --eval-every 0 "
                     "--log-every 1 --checkpoint-every 2 --checkpoint-dir {}/ck --rpc-timeout 60 "
                     "--slow-tower 0:50",
                     dir, dir)),
                 test_path("launch.log"));
  // Both shards have saved a round of the run, not only its start (which ps:1 may still be
  // writing when ps:0 has written it: the folder's loss then refuses the Init instead).
  ASSERT_TRUE(eventually(60, [&] { return shard_saved(dir, 0) > 0 && shard_saved(dir, 1) > 0; }))
      << read_all(l.log);
  // The shards' folder becomes a file: every later write into it fails.
  const std::string folder = dir + "/ps-checkpoints";
  std::filesystem::remove_all(folder);
  { std::ofstream(folder) << "not a folder\n"; }
  const int rc = wait_for(l, 120);
  const std::string out = read_all(l.log);
  EXPECT_EQ(rc, 1) << out;
  EXPECT_NE(out.find("Save failed"), std::string::npos) << out;
  EXPECT_NE(out.find(fmt::format("cannot write '{}/ps-", folder)), std::string::npos) << out;
  EXPECT_EQ(out.find("could not be read for a checkpoint"), std::string::npos) << out;
  // The chief's latest file (it keeps the one before too): the step the shards failed to save.
  std::string chiefs;
  for (const auto& e : std::filesystem::directory_iterator(dir + "/ck"))
    if (e.path().extension() == ".safetensors") chiefs = std::max(chiefs, e.path().string());
  ASSERT_FALSE(chiefs.empty()) << out;
  EXPECT_NE(out.find("the chief's own checkpoint of that step is " + chiefs), std::string::npos)
      << out;
}

// The metrics file has a rollback event and no `event` record after it.
void expect_no_event_after_rollback(const std::string& metrics, const std::string& event) {
  bool rolled_back = false;
  std::ifstream in(metrics);
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    rolled_back = rolled_back || j["event"] == "rollback";
    EXPECT_FALSE(rolled_back && j["event"] == event) << metrics << ": " << line;
  }
  EXPECT_TRUE(rolled_back) << metrics;
}

// Sync: a run that went back to a restarted shard's round and lost a worker before that round
// completed stops naming the worker and the chief's checkpoint of that round, which holds the
// state every shard restored; the same launch with --resume then ends bitwise where one process
// ends. The chief writes no checkpoint on its way out. (The worker dies here while it
// computes. One that dies in the middle of its push leaves the round applied in part on a
// shard, which then refuses to be read: the chief, which read the shards for a new checkpoint
// of the round, then said only "the shards could not be read for a checkpoint";
// scripts/kill-shards.sh found that case.)
TEST(RemoteCli, ASyncRunThatLosesAWorkerAfterARollbackNamesTheRoundsCheckpoint) {
  const std::string flags =
      "--model mlp --dataset synthetic --synthetic-size 320 --batch 16 --mode sync --steps 30 "
      "--seed 5 --eval-every 0 --log-every 1 --checkpoint-every 0.2 --optimizer adam --lr 0.001";
  const std::string dir = test_path("launch"), one = test_path("one");
  // Worker 1's tower takes 1.5 s a step: it is killed while it computes the round after the
  // rollback (a kill that came too late for that fails the check of worker 1's steps below).
  // Checkpoints every 2 steps (an epoch is 10).
  const std::string cluster =
      fmt::format("--checkpoint-dir {}/ck --rpc-timeout 60 --heartbeat-timeout 2", dir);
  Proc l = spawn(words(fmt::format("launch --ps 2 --workers 2 --out {} -- train {} {} "
                                   "--slow-tower 1:1500",
                                   dir, flags, cluster)),
                 test_path("launch.log"));
  ASSERT_TRUE(eventually(90, [&] {
    const auto steps = live_metrics_events(dir + "/worker-0.jsonl", "step");
    return !steps.empty() && steps.back()["step"].get<int64_t>() >= 3 && shard_saved(dir, 1) == 2;
  })) << read_all(l.log);
  const pid_t worker = launched(dir)["worker:1"];
  Proc again = kill_and_restart_shard(dir, 1);
  ASSERT_TRUE(eventually(60, [&] {
    return !live_metrics_events(dir + "/worker-1.jsonl", "rollback").empty();
  })) << read_all(l.log);
  ASSERT_EQ(kill(worker, SIGKILL), 0);
  const int rc = wait_for(l, 120);
  const std::string out = read_all(l.log);
  EXPECT_EQ(rc, 1) << out;
  EXPECT_EQ(wait_for(again, 60), 0) << read_all(again.log);
  EXPECT_NE(out.find("round 2 cannot complete: worker(s) 1 lost"), std::string::npos) << out;
  EXPECT_NE(out.find(fmt::format("the last complete round, step 2, is saved in {}/ck/"
                                 "ckpt-000000002.safetensors",
                                 dir)),
            std::string::npos)
      << out;
  // Worker 1 took no step after its rollback (it died computing); the chief wrote no checkpoint.
  expect_no_event_after_rollback(dir + "/worker-1.jsonl", "step");
  expect_no_event_after_rollback(dir + "/worker-0.jsonl", "checkpoint");
  std::string resumed;
  ASSERT_EQ(run_towers(fmt::format("launch --ps 2 --workers 2 --out {} -- train {} {} --resume",
                                   dir, flags, cluster),
                       &resumed),
            0)
      << resumed;
  expect_last_checkpoint_of_one_process(flags, dir + "/ck", one);
}

}  // namespace
}  // namespace towers

namespace towers {
namespace {

// Another process reads the live parameters from the shards, with the read-only token: `towers
// pull` writes a checkpoint that `towers eval` reads, `towers eval --cluster` tests them in
// memory, and both see the same parameters. The read-only token cannot take part in the run.
// The cluster has 2 workers and only the chief runs, so the run waits at round 0 (the
// initial parameters) while the readers read.
TEST(RemoteCli, PullAndEvalReadTheLiveParametersWithTheReadOnlyToken) {
  const int port = free_port();
  const std::string cluster = write_file(
      "cluster.json", fmt::format(R"({{"cluster": {{"worker": ["127.0.0.1:1", "127.0.0.1:2"], "ps": ["127.0.0.1:{}"]}}}})", port));
  const std::string token = write_file("token", "run-token\n");
  const std::string read = write_file("read", "read-only-token\n");
  Proc shard = spawn({"ps", "--cluster", cluster, "--task", "ps:0", "--token-file", token,
                      "--read-token-file", read},
                     test_path("ps.log"));
  Proc chief = spawn({"train", "--model", "mlp", "--dataset", "fashion-mnist", "--steps", "5",
                      "--batch", "64", "--quiet", "--eval-every", "0", "--cluster", cluster,
                      "--task", "worker:0", "--token-file", token, "--rpc-timeout", "120"},
                     test_path("chief.log"));
  const std::string pulled = test_path("model.safetensors");
  std::string out;
  // Until the chief has initialised the shard, a pull says so; then it succeeds.
  ASSERT_TRUE(eventually(60, [&] {
    return run_towers(fmt::format("pull --cluster {} --token-file {} --out {}", cluster, read,
                                  pulled), &out) == 0;
  })) << out << read_all(chief.log);
  EXPECT_NE(out.find("model mlp"), std::string::npos) << out;
  std::string from_file, from_cluster;
  ASSERT_EQ(run_towers(fmt::format("eval --checkpoint {}", pulled), &from_file), 0) << from_file;
  ASSERT_EQ(run_towers(fmt::format("eval --cluster {} --token-file {}", cluster, read),
                       &from_cluster), 0) << from_cluster;
  // "...: model mlp, step 0: test accuracy A% on N examples (loss L)": the same after the source.
  auto tail = [](const std::string& s) { return s.substr(s.find(": model")); };
  EXPECT_EQ(tail(from_file), tail(from_cluster));
  EXPECT_NE(from_cluster.find("step 0:"), std::string::npos) << from_cluster;
  // The read-only token reads, but a worker that carries it is refused.
  EXPECT_NE(run_towers(fmt::format("train --model mlp --dataset fashion-mnist --steps 5 --batch 64 "
                                   "--quiet --cluster {} --task worker:1 --token-file {} "
                                   "--rpc-timeout 20", cluster, read), &out), 0);
  EXPECT_NE(out.find("read-only token"), std::string::npos) << out;
  // No token that the shard knows: refused.
  EXPECT_NE(run_towers(fmt::format("pull --cluster {} --out {}", cluster, pulled + ".2"), &out), 0);
  EXPECT_NE(out.find("no token"), std::string::npos) << out;
  kill(chief.pid, SIGKILL);
  wait_for(chief, 10);
  kill(shard.pid, SIGKILL);
  wait_for(shard, 10);
}

}  // namespace
}  // namespace towers

namespace towers {
namespace {

// Mutual TLS: a shard and a worker with certificates of one CA (made here with openssl) train;
// a worker without TLS gets no answer and says what to check.
TEST(RemoteCli, MutualTlsWorksAndAPlainWorkerIsNotServed) {
  if (std::system("openssl version > /dev/null 2>&1") != 0) GTEST_SKIP() << "no openssl to make certificates";
  const std::string d = test_path("tls");
  std::filesystem::create_directories(d);
  const std::string make = fmt::format(
      "cd {} && openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 2 "
      "-subj /CN=towers-test-ca && openssl req -newkey rsa:2048 -nodes -keyout node.key -out "
      "node.csr -subj /CN=127.0.0.1 && printf 'subjectAltName=IP:127.0.0.1\\n' > ext.cnf && "
      "openssl x509 -req -in node.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out node.pem "
      "-days 2 -extfile ext.cnf", d);
  ASSERT_EQ(std::system((make + " > /dev/null 2>&1").c_str()), 0) << make;
  const int port = free_port();
  const std::string cluster = write_file(
      "cluster.json", fmt::format(R"({{"cluster": {{"worker": ["127.0.0.1:1"], "ps": ["127.0.0.1:{}"]}}}})", port));
  const std::string token = write_file("token", "tls-run\n");
  const std::vector<std::string> tls = {"--tls-cert", d + "/node.pem", "--tls-key", d + "/node.key",
                                        "--tls-ca", d + "/ca.pem"};
  std::vector<std::string> ps = {"ps", "--cluster", cluster, "--task", "ps:0", "--token-file", token};
  ps.insert(ps.end(), tls.begin(), tls.end());
  Proc shard = spawn(ps, test_path("ps.log"));
  const std::string train = fmt::format("train --model mlp --dataset synthetic --synthetic-size 500 "
                                        "--batch 16 --steps 3 --quiet --eval-every 0 --cluster {} "
                                        "--task worker:0 --token-file {}", cluster, token);
  std::string out;
  EXPECT_NE(run_towers(train + " --rpc-timeout 3", &out), 0);
  EXPECT_NE(out.find("agree on TLS"), std::string::npos) << out;
  // In 16 KiB pieces: the pushes and pulls travel in 4 stripes, each on a TLS connection.
  EXPECT_EQ(
      run_towers(fmt::format("{} --tls-cert {}/node.pem --tls-key {}/node.key --tls-ca {}/ca.pem "
                             "--rpc-piece-kib 16 --metrics {}/m.jsonl",
                             train, d, d, d, d),
                 &out),
      0)
      << out << read_all(shard.log);
  EXPECT_EQ(wait_for(shard, 30), 0) << read_all(shard.log);
  EXPECT_NE(read_all(shard.log).find("(TLS)"), std::string::npos);
  const auto summary = metrics_events(d + "/m.jsonl", "summary");
  ASSERT_EQ(summary.size(), 1u);
  const auto& t = summary[0]["remote"];
  EXPECT_EQ(t["streams"].get<int64_t>(),
            4 * (t["pushes"].get<int64_t>() + t["pulls"].get<int64_t>()))
      << t.dump();
}

}  // namespace
}  // namespace towers

