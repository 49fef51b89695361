// remote_bench — the transport of remote tower groups (towers/remote/), each case validated
// before it is timed, next to its physical yardsticks measured in the same run:
//   BM_Push/BYTES/SHARDS   one sync push of a BYTES gradient to SHARDS shards (1 worker: the
//                          round is applied when it arrives), through RemoteParameterStore:
//                          send (the gradient lent to gRPC, wire.h), the shard's one copy out
//                          of the received slices, its apply (sgd, one pass), the reply
//   BM_Pull/BYTES/SHARDS   one read of every shard's range into the host array (host_params)
//   BM_TcpLoopback/BYTES   the raw yardstick: BYTES over one 127.0.0.1 TCP connection and a
//                          1-byte reply, the same round trip as a unary call
//   BM_GrpcUnary/BYTES     gRPC's own floor: one unary call of BYTES on one channel, sent from
//                          the caller's memory without a copy (wire.h), to a server that
//                          replies at once without reading it: what any design on gRPC pays
//   BM_Memcpy/BYTES        memory bandwidth over the same bytes
// The shards run as threads of this process on 127.0.0.1 (on a 2-core machine they share the
// cores with the client, as separate processes would). bytes_per_second is the message size
// over the time of one call.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <condition_variable>
#include <cstring>
#include <mutex>
#include <map>
#include <memory>
#include <thread>
#include <vector>

#include <benchmark/benchmark.h>
#include <fmt/format.h>

#include "core/device.h"
#include "optim/optimizer.h"
#include "towers/remote/remote_store.h"
#include "towers/remote/shard_server.h"
#include "towers/remote/towers.grpc.pb.h"
#include "towers/remote/wire.h"

namespace {

using namespace towers;

int free_port() { return remote::free_loopback_ports(1)[0]; }

// S shards serving one variable of n floats, and a worker's store connected to them.
struct Cluster {
  std::vector<remote::ShardOptions> opts;
  std::vector<std::thread> servers;
  std::unique_ptr<ParameterLayout> layout;
  std::vector<float> params, grads;
  std::unique_ptr<Optimizer> opt;
  std::unique_ptr<remote::RemoteParameterStore> store;
  remote::RemoteConfig cfg;

  Cluster(int64_t n, int shards) {
    remote::Cluster c;
    c.worker = {"127.0.0.1:1"};
    for (int i = 0; i < shards; ++i) c.ps.push_back(fmt::format("127.0.0.1:{}", free_port()));
    opts.resize(shards);
    for (int i = 0; i < shards; ++i) {
      opts[i].cluster = c;
      opts[i].index = i;
      opts[i].token = "bench";
      opts[i].quiet = true;
      servers.emplace_back([o = &opts[i]] { remote::run_shard(*o); });
    }
    layout = std::make_unique<ParameterLayout>(
        std::vector<ParamSpec>{{"v/w", {n}, Init::constant(0.5f)}});
    params.assign(layout->total(), 0.5f);
    grads.assign(layout->total(), 1.0f);
    opt = std::make_unique<Optimizer>(*layout, OptimizerConfig{"sgd"});
    cfg.cluster = c;
    cfg.token = "bench";
    cfg.rpc_timeout = 60;
    cfg.mode = "sync";
    cfg.run_id = "bench";
    store = std::make_unique<remote::RemoteParameterStore>(cfg, *layout, params.data(), *opt,
                                                           UpdateAccess::Exclusive);
    store->initialize_shards(0);
    store->join();
  }
  ~Cluster() {
    store.reset();
    for (const std::string& a : cfg.cluster.ps) {
      auto stub = remote::Shard::NewStub(remote::open_channel(a, {}));
      remote::ShutdownRequest req;
      remote::ShutdownReply rep;
      auto ctx = remote::call_context("bench", 5);
      stub->Shutdown(ctx.get(), req, &rep);
    }
    for (auto& t : servers) t.join();
  }
};

void BM_Push(benchmark::State& state) {
  const int64_t bytes = state.range(0);
  Cluster c(bytes / 4, static_cast<int>(state.range(1)));
  CpuDevice host(1);
  UpdateRecord rec;
  rec.lr = 0.001f;
  // Validate: one push is one applied round, and the parameters moved by lr * grad.
  const int64_t v = c.store->push(c.grads.data(), rec, host);
  const float* p = c.store->host_params();
  if (v != 1 || rec.skipped || p[0] != 0.5f - 0.001f || p[bytes / 4 - 1] != 0.5f - 0.001f) {
    state.SkipWithError("push failed validation");
    return;
  }
  for (auto _ : state) c.store->push(c.grads.data(), rec, host);
  state.SetBytesProcessed(state.iterations() * bytes);
}

void BM_Pull(benchmark::State& state) {
  const int64_t bytes = state.range(0);
  Cluster c(bytes / 4, static_cast<int>(state.range(1)));
  c.params.assign(c.params.size(), -1.0f);  // the pull must overwrite every element
  const float* p = c.store->host_params();
  for (int64_t i = 0; i < bytes / 4; ++i)
    if (p[i] != 0.5f) {
      state.SkipWithError("pull failed validation");
      return;
    }
  for (auto _ : state) benchmark::DoNotOptimize(c.store->host_params());
  state.SetBytesProcessed(state.iterations() * bytes);
}

void BM_TcpLoopback(benchmark::State& state) {
  const int64_t bytes = state.range(0);
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
        const ssize_t r = read(sfd, in.data() + got, bytes - got);
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
      const ssize_t w = write(cfd, out.data() + sent, bytes - sent);
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

// Acknowledges every Push without reading it.
class AckService final : public remote::Shard::WithRawCallbackMethod_Push<remote::Shard::Service> {
 public:
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

void BM_GrpcUnary(benchmark::State& state) {
  const int64_t bytes = state.range(0);
  remote::keep_message_buffers();  // as every shard and worker process does
  AckService service;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.SetMaxReceiveMessageSize(remote::kMaxMessageBytes);
  remote::tune(builder);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  grpc::GenericStub stub(remote::open_channel(fmt::format("127.0.0.1:{}", port), {}));
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
  if (!call()) state.SkipWithError("gRPC call failed validation");
  for (auto _ : state)
    if (!call()) break;
  server->Shutdown();
  state.SetBytesProcessed(state.iterations() * bytes);
}

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

BENCHMARK(BM_Push)->Apply([](auto* b) { sizes(b, true); });
BENCHMARK(BM_Pull)->Apply([](auto* b) { sizes(b, true); });
BENCHMARK(BM_TcpLoopback)->Apply([](auto* b) { sizes(b, false); });
BENCHMARK(BM_GrpcUnary)->Apply([](auto* b) { sizes(b, false); });
BENCHMARK(BM_Memcpy)->Apply([](auto* b) { sizes(b, false); });

}  // namespace

BENCHMARK_MAIN();
