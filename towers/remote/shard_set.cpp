#include "towers/remote/shard_set.h"

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <thread>

#include <fmt/format.h>

#include "core/check.h"
#include "core/clock.h"

namespace towers::remote {

ShardSet::ShardSet(std::vector<std::string> addresses, std::string token, const TlsFiles& tls)
    : addresses_(std::move(addresses)), token_(std::move(token)),
      unreachable_(addresses_.size()) {
  for (const std::string& a : addresses_) {
    channels_.push_back(open_channel(a, tls));
    stubs_.push_back(Shard::NewStub(channels_.back()));
    generics_.push_back(std::make_unique<grpc::GenericStub>(channels_.back()));
  }
}

void ShardSet::fail(int i, const char* what, const grpc::Status& s) const {
  std::string hint;
  if (s.error_code() == grpc::StatusCode::UNAUTHENTICATED)
    hint = "; this process's token (--token-file or TOWERS_TOKEN) is not one the shard was "
           "started with";
  if (s.error_code() == grpc::StatusCode::PERMISSION_DENIED)
    hint = "; taking part in the run needs the run's token, not the read-only one";
  if (s.error_code() == grpc::StatusCode::UNAVAILABLE ||
      s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED)
    hint = "; is the shard running at that address, and do both sides agree on TLS "
           "(--tls-cert/--tls-key/--tls-ca on every process, or on none)?";
  TOWERS_BAD_INPUT("ps:{} ({}): {} failed: {}{}", i, addresses_[i], what, describe(s), hint);
}

void ShardSet::all(const char* what, double timeout, const Start& start) {
  const auto until = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                        std::chrono::duration<double>(timeout));
  std::vector<int> todo(size());
  for (int i = 0; i < size(); ++i) todo[i] = i;
  for (;;) {
    const int n = static_cast<int>(todo.size());
    const double left = std::max(0.001, std::chrono::duration<double>(until - Clock::now()).count());
    std::vector<std::unique_ptr<grpc::ClientContext>> ctx;
    std::vector<grpc::Status> status(n);
    std::mutex mu;
    std::condition_variable cv;
    int pending = n;
    for (int k = 0; k < n; ++k) ctx.push_back(call_context(token_, left));
    for (int k = 0; k < n; ++k)
      start(todo[k], ctx[k].get(), [&, k](grpc::Status s) {
        std::lock_guard<std::mutex> l(mu);
        status[k] = std::move(s);
        if (--pending == 0) cv.notify_all();
      });
    {
      std::unique_lock<std::mutex> l(mu);
      cv.wait(l, [&] { return pending == 0; });
    }
    std::vector<int> again;
    for (int k = 0; k < n; ++k) {
      if (status[k].ok()) continue;
      const int i = todo[k];
      if (status[k].error_code() != grpc::StatusCode::UNAVAILABLE || Clock::now() >= until)
        fail(i, what, status[k]);
      if (!unreachable_[i]) {
        unreachable_[i] = true;
        fmt::print(stderr, "towers: ps:{} ({}) is unreachable ({}); calling again until the "
                   "deadline\n", i, addresses_[i], describe(status[k]));
      }
      again.push_back(i);
    }
    if (again.empty()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    todo = std::move(again);
  }
  for (int i = 0; i < size(); ++i)
    if (unreachable_[i] && std::find(todo.begin(), todo.end(), i) != todo.end()) {
      unreachable_[i] = false;
      fmt::print(stderr, "towers: ps:{} ({}) answers again\n", i, addresses_[i]);
    }
}

std::vector<ShardSet::Pulled> ShardSet::pull_all(PullRequest request, bool one_round, double timeout) {
  std::vector<Pulled> reps(size());
  for (int attempt = 0;; ++attempt) {
    const grpc::ByteBuffer out = encode(request);
    std::vector<grpc::ByteBuffer> in(size());
    all("Pull", timeout, [&](int i, grpc::ClientContext* ctx, auto done) {
      generic(i).UnaryCall(ctx, kPullMethod, grpc::StubOptions(), &out, &in[i], std::move(done));
    });
    for (int i = 0; i < size(); ++i) {
      std::string error;
      TOWERS_REQUIRE(decode(in[i], PullReply::kParamsFieldNumber, reps[i].head, reps[i].params, &error),
                     "ps:{} ({}): a pull's reply: {}", i, addresses_[i], error);
    }
    int64_t lo = reps[0].head.version(), hi = lo;
    for (const Pulled& r : reps) lo = std::min(lo, r.head.version()), hi = std::max(hi, r.head.version());
    if (!one_round || lo == hi) return reps;
    TOWERS_REQUIRE(attempt < 20, "the shards' rounds kept moving while they were read (versions "
                   "{} to {}); try again", lo, hi);
    request.set_min_version(hi);
  }
}

}  // namespace towers::remote
