#include "towers/remote/shard_set.h"

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <random>
#include <thread>

#include <fmt/format.h>
#include <grpcpp/support/client_callback.h>

#include "core/check.h"
#include "core/clock.h"

namespace towers::remote {

ShardSet::ShardSet(std::vector<std::string> addresses, std::string token, const TlsFiles& tls,
                   int stripes)
    : addresses_(std::move(addresses)),
      token_(std::move(token)),
      unreachable_(addresses_.size()),
      stripes_(stripes),
      next_push_(uint64_t{std::random_device()()} << 32) {
  TOWERS_REQUIRE(stripes >= 1 && stripes <= kMaxStripes, "stripes: {} is not in [1, {}]", stripes,
                 kMaxStripes);
  for (const std::string& a : addresses_) {
    channels_.emplace_back();
    generics_.emplace_back();
    for (int k = 0; k < stripes_; ++k) {
      channels_.back().push_back(open_channel(a, tls, k));
      generics_.back().push_back(std::make_unique<grpc::GenericStub>(channels_.back().back()));
    }
    stubs_.push_back(Shard::NewStub(channels_.back()[0]));
  }
}

void ShardSet::fail(int i, const char* what, const grpc::Status& s) const {
  std::string hint;
  if (s.error_code() == grpc::StatusCode::UNAUTHENTICATED)
    hint = "; this process's token (--token-file or TOWERS_TOKEN) is not one the shard was "
           "started with";
  if (s.error_code() == grpc::StatusCode::PERMISSION_DENIED)
    hint = "; taking part in the run needs the run's token, not the read-only one";
  // (A shard that waited for something answers DEADLINE_EXCEEDED itself, saying what: its
  // messages start with its name. gRPC's own deadline error means no answer came.)
  const bool shard_said = s.error_message().rfind("ps:", 0) == 0;
  if (s.error_code() == grpc::StatusCode::UNAVAILABLE ||
      (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED && !shard_said))
    hint = "; is the shard running at that address, and do both sides agree on TLS "
           "(--tls-cert/--tls-key/--tls-ca on every process, or on none)?";
  TOWERS_BAD_INPUT("ps:{} ({}): {} failed: {}{}", i, addresses_[i], what, describe(s), hint);
}

void ShardSet::all(const char* what, double timeout, const Start& start,
                   const std::vector<int>& calls) {
  const auto until = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                        std::chrono::duration<double>(timeout));
  std::vector<int> todo(size());
  for (int i = 0; i < size(); ++i) todo[i] = i;
  for (;;) {
    const int n = static_cast<int>(todo.size());
    const double left = std::max(0.001, std::chrono::duration<double>(until - Clock::now()).count());
    std::vector<std::unique_ptr<grpc::ClientContext>> ctx;  // every call's, in order
    std::vector<std::vector<grpc::ClientContext*>> of(n);   // [k]: shard todo[k]'s
    std::vector<grpc::Status> status(n);
    std::mutex mu;
    std::condition_variable cv;
    int pending = n;
    bool rolled_back = false;  // a call was refused with a rollback: the others are cancelled
    for (int k = 0; k < n; ++k)
      for (int c = 0; c < (calls.empty() ? 1 : calls[todo[k]]); ++c) {
        ctx.push_back(call_context(token_, left));
        of[k].push_back(ctx.back().get());
      }
    for (int k = 0; k < n; ++k)
      start(todo[k], of[k], [&, k](grpc::Status s) {
        std::lock_guard<std::mutex> l(mu);
        if (rollback_of(s)) rolled_back = true;
        status[k] = std::move(s);
        --pending;
        cv.notify_all();
      });
    {
      std::unique_lock<std::mutex> l(mu);
      bool cancelled = false;
      for (;;) {
        cv.wait(l, [&] { return pending == 0 || (rolled_back && !cancelled); });
        if (pending == 0) break;
        // The others' calls (a push waiting at a round's barrier) are of the round given up.
        cancelled = true;
        l.unlock();
        for (auto& c : ctx) c->TryCancel();
        l.lock();
      }
    }
    // The latest rollback any shard asks for.
    std::optional<Rollback> rollback;
    int by = -1;
    for (int k = 0; k < n; ++k)
      if (const auto r = rollback_of(status[k]);
          r && (!rollback || r->generation > rollback->generation))
        rollback = r, by = k;
    if (rollback)
      throw RollbackError(fmt::format("ps:{} ({}): {}", todo[by], addresses_[todo[by]],
                                      status[by].error_message()),
                          *rollback);
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

namespace {

// One PushStream: writes its messages in order (the last one half-closes the stream), reads
// the reply, and calls done with the call's status. It deletes itself when the call is over.
class PushWriter final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  PushWriter(std::vector<grpc::ByteBuffer> messages, grpc::ByteBuffer* reply,
             std::function<void(grpc::Status)> done)
      : messages_(std::move(messages)), reply_(reply), done_(std::move(done)) {}
  void start(grpc::GenericStub& stub, grpc::ClientContext* ctx) {
    stub.PrepareBidiStreamingCall(ctx, kPushStreamMethod, grpc::StubOptions(), this);
    StartRead(reply_);
    write_next();
    StartCall();
  }
  void OnWriteDone(bool ok) override {
    if (ok && next_ < messages_.size()) write_next();  // (not ok: the status says why)
  }
  void OnReadDone(bool) override {}
  void OnDone(const grpc::Status& s) override {
    auto done = std::move(done_);
    delete this;
    done(s);
  }

 private:
  void write_next() {
    const size_t i = next_++;
    if (next_ < messages_.size())
      StartWrite(&messages_[i]);
    else
      StartWriteLast(&messages_[i], grpc::WriteOptions());
  }
  std::vector<grpc::ByteBuffer> messages_;
  size_t next_ = 0;
  grpc::ByteBuffer* reply_;
  std::function<void(grpc::Status)> done_;
};

// The stripes of one push to a shard, or of a pull from it (wire.h, kStripeKey): each a
// PushWriter or PullReader on a connection of its own, with a context of ShardSet::all's. The
// first failure cancels the others; done gets the failure that says the most (a rollback, then
// any but a cancellation), or OK, once every stripe is over and the caller has started them
// all (started()). Deletes itself then. No context is cancelled before every stripe's call is
// started: a stripe may fail while the caller is still starting the others (a connection in
// failure fails a call at once), and cancelling the contexts of calls not yet started left, in
// our runs, a call that never ended (the killed-shard test hung in about 1 run in 15 with
// such cancels; 0 in 44 runs without them).
class StripedCall {
 public:
  // Adds each stripe's metadata to its context.
  StripedCall(ShardSet::Contexts ctx, uint64_t id, std::function<void(grpc::Status)> done)
      : ctx_(ctx), done_(std::move(done)) {
    const int s = static_cast<int>(ctx_.size());
    for (int k = 0; k < s; ++k) ctx_[k]->AddMetadata(kStripeKey, stripe_metadata({id, k, s}));
  }
  // A stripe's call is over.
  void finished(const grpc::Status& s) {
    bool cancel = false;
    {
      std::lock_guard<std::mutex> l(mu_);
      if (rank(s) > rank(status_)) {
        // The first failure, with the stripes all started and some still going (before they
        // are all started, started() cancels).
        cancel = status_.ok() && started_ && ended_ + 1 < parties();
        status_ = s;
      }
      // A party that does not cancel counts itself over here; the canceller once its cancels
      // are done, so that no cancel outlives this object.
      if (!cancel && ++ended_ < parties()) return;
    }
    if (cancel)
      cancel_all();
    else
      end();
  }
  // The caller has started every stripe's call (it counts as one more party).
  void started() {
    bool cancel = false;
    {
      std::lock_guard<std::mutex> l(mu_);
      started_ = true;
      cancel = !status_.ok();  // a stripe failed while the others were being started
      if (!cancel && ++ended_ < parties()) return;
    }
    if (cancel)
      cancel_all();
    else
      end();
  }

 private:
  int parties() const { return static_cast<int>(ctx_.size()) + 1; }
  void cancel_all() {
    for (grpc::ClientContext* c : ctx_) c->TryCancel();  // (may end a stripe on this thread)
    {
      std::lock_guard<std::mutex> l(mu_);
      if (++ended_ < parties()) return;
    }
    end();
  }
  // The party that made ended_ parties(): every other is over, and none is in here.
  void end() {
    auto done = std::move(done_);
    const grpc::Status status = status_;
    delete this;
    done(status);
  }
  static int rank(const grpc::Status& s) {
    if (s.ok()) return 0;
    if (rollback_of(s)) return 3;
    return s.error_code() == grpc::StatusCode::CANCELLED ? 1 : 2;
  }
  ShardSet::Contexts ctx_;
  std::mutex mu_;
  int ended_ = 0;
  bool started_ = false;
  grpc::Status status_;
  std::function<void(grpc::Status)> done_;
};

// One PullStream: sends the request, copies each piece of the reply into dst (the range's
// floats; the stream's are [begin, end)) as it arrives, and calls done with the call's status, or
// with what was wrong with the pieces. It deletes itself when the call is over.
class PullReader final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  // dst: the range's floats; [begin, end): the ones this stream carries (a stripe's, or all).
  PullReader(grpc::ByteBuffer request, float* dst, int64_t begin, int64_t end, int64_t* version,
             std::function<void(grpc::Status)> done)
      : request_(std::move(request)),
        dst_(dst),
        begin_(begin),
        next_(begin),
        n_(end),
        version_(version),
        done_(std::move(done)) {}
  void start(grpc::GenericStub& stub, grpc::ClientContext* ctx) {
    ctx_ = ctx;
    stub.PrepareBidiStreamingCall(ctx, kPullStreamMethod, grpc::StubOptions(), this);
    StartWriteLast(&request_, grpc::WriteOptions());
    StartRead(&in_);
    StartCall();
  }
  void OnWriteDone(bool) override {}
  void OnReadDone(bool ok) override {
    if (!ok) return;
    PullReply head;
    Bulk params;
    std::string error;
    if (!decode(in_, PullReply::kParamsFieldNumber, head, params, &error)) {
      refuse(error);
      return;
    }
    const int64_t floats = static_cast<int64_t>(params.size() / sizeof(float));
    if (params.size() % sizeof(float) != 0 || head.offset() != next_ || floats > n_ - next_ ||
        (next_ > begin_ && head.version() != *version_)) {
      refuse(fmt::format("a piece of {} bytes at float {}, version {}, where float {} of {} at "
                         "version {} was due", params.size(), head.offset(), head.version(),
                         next_, n_, *version_));
      return;
    }
    params.copy_to(dst_ + next_);
    next_ += floats;
    *version_ = head.version();
    ++pieces_;
    in_.Clear();
    StartRead(&in_);
  }
  void OnDone(const grpc::Status& s) override {
    grpc::Status status = s;
    if (!error_.empty())
      status = grpc::Status(grpc::StatusCode::DATA_LOSS, "the pull's reply: " + error_);
    else if (s.ok() && (next_ != n_ || pieces_ == 0))
      status = grpc::Status(grpc::StatusCode::DATA_LOSS,
                            fmt::format("the pull's reply ended after {} of {} floats", next_, n_));
    auto done = std::move(done_);
    delete this;
    done(status);
  }

 private:
  void refuse(std::string why) {
    error_ = std::move(why);
    ctx_->TryCancel();
  }
  grpc::ByteBuffer request_, in_;
  float* dst_;
  int64_t begin_, next_, n_;  // (n_: where the floats end)
  int pieces_ = 0;
  int64_t* version_;
  grpc::ClientContext* ctx_ = nullptr;
  std::string error_;
  std::function<void(grpc::Status)> done_;
};

}  // namespace

void ShardSet::push_streams(const std::vector<std::vector<grpc::ByteBuffer>>& messages,
                            std::vector<PushReply>& replies, double timeout) {
  // Stripe k of shard i's s: its pieces [p k / s, p (k + 1) / s), as the shard expects
  // (stripe_floats), p being its messages (one a piece).
  std::vector<int> stripes(size());
  for (int i = 0; i < size(); ++i)
    stripes[i] = std::min(stripes_, static_cast<int>(messages[i].size()));
  std::vector<std::vector<grpc::ByteBuffer>> in(size());
  all(
      "Push", timeout,
      [&](int i, Contexts ctx, std::function<void(grpc::Status)> done) {
        const int p = static_cast<int>(messages[i].size()), s = stripes[i];
        in[i].assign(s, grpc::ByteBuffer());
        streams_ += s;
        if (s == 1) {
          (new PushWriter(messages[i], &in[i][0], std::move(done)))->start(generic(i), ctx[0]);
          return;
        }
        auto* push = new StripedCall(ctx, next_push_++, std::move(done));
        for (int k = 0; k < s; ++k)
          (new PushWriter({messages[i].begin() + p * k / s, messages[i].begin() + p * (k + 1) / s},
                          &in[i][k], [push](grpc::Status st) { push->finished(st); }))
              ->start(generic(i, k), ctx[k]);
        push->started();
      },
      stripes);
  replies.assign(size(), PushReply());
  for (int i = 0; i < size(); ++i) {
    // A striped push's result is on the stripe that ended it; the others are partial.
    int whole = 0;
    for (const grpc::ByteBuffer& b : in[i]) {
      PushReply rep;
      std::string error;
      TOWERS_REQUIRE(decode(b, rep, &error), "ps:{} ({}): a push's reply: {}", i, addresses_[i],
                     error);
      if (!rep.partial()) replies[i] = std::move(rep), ++whole;
    }
    TOWERS_REQUIRE(whole == 1, "ps:{} ({}): a push in {} stripes was ended by {} of them", i,
                   addresses_[i], in[i].size(), whole);
  }
}

std::vector<int64_t> ShardSet::pull_streams(const PullRequest& request,
                                            const std::vector<Range>& ranges, int64_t piece,
                                            float* dst, double timeout) {
  const grpc::ByteBuffer out = encode(request);
  std::vector<int> stripes(size());
  for (int i = 0; i < size(); ++i) {
    const int64_t n = ranges[i].size();
    stripes[i] =
        static_cast<int>(std::min<int64_t>(stripes_, messages_of(n, piece)));
  }
  std::vector<std::vector<int64_t>> versions(size());
  all(
      "Pull", timeout,
      [&](int i, Contexts ctx, std::function<void(grpc::Status)> done) {
        const int64_t n = ranges[i].size();
        const int s = stripes[i];
        float* range = dst + ranges[i].begin;
        versions[i].assign(s, 0);
        streams_ += s;
        if (s == 1) {
          (new PullReader(out, range, 0, n, &versions[i][0], std::move(done)))
              ->start(generic(i), ctx[0]);
          return;
        }
        auto* pull = new StripedCall(ctx, 0, std::move(done));
        for (int k = 0; k < s; ++k) {
          const auto [a, b] = stripe_floats(n, piece, k, s);
          (new PullReader(out, range, a, b, &versions[i][k], [pull](grpc::Status st) {
            pull->finished(st);
          }))->start(generic(i, k), ctx[k]);
        }
        pull->started();
      },
      stripes);
  // A shard's version: the earliest its stripes were read at (sync with backup workers, or
  // async: a round may be applied between two stripes' reads, as between two shards').
  std::vector<int64_t> out_versions;
  for (const auto& v : versions) out_versions.push_back(*std::min_element(v.begin(), v.end()));
  return out_versions;
}

std::vector<ShardSet::Pulled> ShardSet::pull_all(PullRequest request, bool one_round, double timeout) {
  std::vector<Pulled> reps(size());
  for (int attempt = 0;; ++attempt) {
    const grpc::ByteBuffer out = encode(request);
    std::vector<grpc::ByteBuffer> in(size());
    all("Pull", timeout, [&](int i, Contexts ctx, auto done) {
      generic(i).UnaryCall(ctx[0], kPullMethod, grpc::StubOptions(), &out, &in[i], std::move(done));
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
