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

namespace {
// Calls that keep their own deadline (on sessions) are given up this long after it, so
// that a shard's own answer at its deadline (which says what it waited for) comes first.
constexpr std::chrono::seconds kOwnDeadlineMargin{1};
}  // namespace

ShardSet::ShardSet(std::vector<std::string> addresses, std::string token, const TlsFiles& tls,
                   int stripes, bool sessions)
    : addresses_(std::move(addresses)),
      token_(std::move(token)),
      unreachable_(addresses_.size()),
      answered_(addresses_.size()),
      stripes_(stripes),
      next_push_(uint64_t{std::random_device()()} << 32),
      sessions_(sessions),
      idle_(2 * addresses_.size(),
            std::vector<std::vector<std::shared_ptr<ShardSession>>>(stripes)),
      live_(std::make_shared<SessionCount>()) {
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
    hint = answered_[i]
               ? "; it answered this process's earlier calls, so it has stopped answering since "
                 "(it exited, hangs or is overloaded, or its host or the network path to it is "
                 "gone)"
               : "; is the shard running at that address, and do both sides agree on TLS "
                 "(--tls-cert/--tls-key/--tls-ca on every process, or on none)?";
  TOWERS_BAD_INPUT("ps:{} ({}): {} failed: {}{}", i, addresses_[i], what, describe(s), hint);
}

void ShardSet::all(const char* what, double timeout, const Start& start,
                   const std::vector<int>& calls, const std::function<void()>& cancel) {
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
    for (int k = 0; k < n; ++k) {
      auto done = [&, k](grpc::Status s) {
        std::lock_guard<std::mutex> l(mu);
        if (rollback_of(s)) rolled_back = true;
        status[k] = std::move(s);
        --pending;
        cv.notify_all();
      };
      // A start throws only before it has started anything (an allocation, an encoding): the
      // call fails with it, and the calls already started are still waited for below.
      try {
        start(todo[k], of[k], done);
      } catch (const std::exception& e) {
        done(grpc::Status(grpc::StatusCode::INTERNAL, e.what()));
      }
    }
    bool overdue = false;  // (cancel: the deadline and its margin passed)
    {
      std::unique_lock<std::mutex> l(mu);
      bool cancelled = false;
      for (;;) {
        auto woken = [&] { return pending == 0 || (rolled_back && !cancelled); };
        if (!cancel || cancelled)
          cv.wait(l, woken);
        else if (!cv.wait_until(l, until + kOwnDeadlineMargin, woken))
          overdue = true;  // no answer from the shards: their calls are given up
        if (pending == 0) break;
        // The others' calls (a push waiting at a round's barrier) are of the round given up.
        cancelled = true;
        l.unlock();
        for (auto& c : ctx) c->TryCancel();
        if (cancel) cancel();
        l.lock();
      }
    }
    if (overdue)
      for (grpc::Status& st : status)
        if (st.error_code() == grpc::StatusCode::CANCELLED)
          st = grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                            fmt::format("no answer within the deadline ({:.1f} s)", timeout));
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
      if (status[k].ok()) {
        answered_[todo[k]] = true;
        continue;
      }
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
  // stripes: how many; cancel: cancels every stripe's call.
  StripedCall(int stripes, std::function<void()> cancel, std::function<void(grpc::Status)> done)
      : stripes_(stripes), cancel_(std::move(cancel)), done_(std::move(done)) {}
  // The same for stripes on contexts of their own: adds each stripe's metadata to its context
  // (id: the push's).
  StripedCall(ShardSet::Contexts ctx, uint64_t id, std::function<void(grpc::Status)> done)
      : StripedCall(
            static_cast<int>(ctx.size()),
            [ctx] {
              for (grpc::ClientContext* c : ctx) c->TryCancel();
            },
            std::move(done)) {
    const int s = static_cast<int>(ctx.size());
    for (int k = 0; k < s; ++k) ctx[k]->AddMetadata(kStripeKey, stripe_metadata({id, k, s}));
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
  int parties() const { return stripes_ + 1; }
  void cancel_all() {
    cancel_();  // (may end a stripe on this thread)
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
  int stripes_;
  std::function<void()> cancel_;
  std::mutex mu_;
  int ended_ = 0;
  bool started_ = false;
  grpc::Status status_;
  std::function<void(grpc::Status)> done_;
};

// The pieces of a pull (or of its stripe), copied into dst as they arrive: a PullStream's,
// or a pull's on a session.
struct PieceReader {
  // dst: the range's floats; [begin, end): the ones this stream carries (a stripe's, or all).
  PieceReader(float* dst, int64_t begin, int64_t end, int64_t* version)
      : dst(dst), begin(begin), next(begin), end(end), version(version) {}
  // Takes a message: false, with *error saying why, for one that is not the piece due.
  bool take(const grpc::ByteBuffer& in, std::string* error) {
    PullReply head;
    Bulk params;
    if (!decode(in, PullReply::kParamsFieldNumber, head, params, error)) return false;
    const int64_t floats = static_cast<int64_t>(params.size() / sizeof(float));
    if (params.size() % sizeof(float) != 0 || head.offset() != next || floats > end - next ||
        (next > begin && head.version() != *version) || complete()) {
      *error = fmt::format(
          "a piece of {} bytes at float {}, version {}, where float {} of {} at "
          "version {} was due",
          params.size(), head.offset(), head.version(), next, end, *version);
      return false;
    }
    params.copy_to(dst + next);
    next += floats;
    *version = head.version();
    ++pieces;
    return true;
  }
  // Every float is in (an empty range: its one empty piece).
  bool complete() const { return pieces > 0 && next == end; }
  float* dst;
  int64_t begin, next, end;
  int pieces = 0;
  int64_t* version;
};

// One PullStream: sends the request, copies each piece of the reply into dst (the range's
// floats; the stream's are [begin, end)) as it arrives, and calls done with the call's status, or
// with what was wrong with the pieces. It deletes itself when the call is over.
class PullReader final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  PullReader(grpc::ByteBuffer request, float* dst, int64_t begin, int64_t end, int64_t* version,
             std::function<void(grpc::Status)> done)
      : request_(std::move(request)), pieces_(dst, begin, end, version), done_(std::move(done)) {}
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
    if (!pieces_.take(in_, &error_)) {
      ctx_->TryCancel();
      return;
    }
    in_.Clear();
    StartRead(&in_);
  }
  void OnDone(const grpc::Status& s) override {
    grpc::Status status = s;
    if (!error_.empty())
      status = grpc::Status(grpc::StatusCode::DATA_LOSS, "the pull's reply: " + error_);
    else if (s.ok() && !pieces_.complete())
      status = grpc::Status(
          grpc::StatusCode::DATA_LOSS,
          fmt::format("the pull's reply ended after {} of {} floats", pieces_.next, pieces_.end));
    auto done = std::move(done_);
    delete this;
    done(status);
  }

 private:
  grpc::ByteBuffer request_, in_;
  PieceReader pieces_;
  grpc::ClientContext* ctx_ = nullptr;
  std::string error_;
  std::function<void(grpc::Status)> done_;
};

}  // namespace

// A session (towers.proto: PushSession, PullSession): a stream to one connection of a shard
// on which a worker's calls of one kind go one after another, each a job: run() writes its
// messages (a push's, or a pull's request) and gives its replies to its take until it has them
// all; the session then waits for the next job. It is over once its call is: a job that failed
// (its status is the job's), a cancel (a deadline, a rollback, a reply take refused), the
// shard's end, or retire() between jobs. A hold (gRPC's AddHold) keeps the call from ending
// while the session waits between jobs, and one more while a job's writes are under way, so
// that no write starts on a call that is over; the session keeps itself alive until its call
// is over.
struct SessionCount {
  std::mutex mu;
  std::condition_variable cv;
  int alive = 0;
};

class ShardSession final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  // What takes a job's replies, one at a time: true once the job has all of them; an error in
  // *error refuses the reply (the session is then cancelled, and the job fails with it).
  using Take = std::function<bool(grpc::ByteBuffer& reply, grpc::Status* error)>;
  explicit ShardSession(std::shared_ptr<SessionCount> count) : counted_(std::move(count)) {}
  // method: kPushSessionMethod (a push's messages, one reply) or kPullSessionMethod (a pull's
  // request, its pieces as replies).
  static std::shared_ptr<ShardSession> open(grpc::GenericStub& stub, const char* method,
                                            const std::string& token,
                                            std::shared_ptr<SessionCount> count) {
    auto s = std::make_shared<ShardSession>(std::move(count));
    s->self_ = s;
    s->ctx_.AddMetadata(kTokenKey, token);  // (no deadline: each job keeps its own)
    stub.PrepareBidiStreamingCall(&s->ctx_, method, grpc::StubOptions(), s.get());
    s->AddHold();  // until retired, or broken
    s->StartRead(&s->in_);
    s->StartCall();
    return s;
  }
  // A job: writes its messages (a push's, the last with `ends`; a pull's request), and gives
  // its replies to take; done(OK) once take has all of them and the writes are done, or
  // done(status) when the session ends first. False, and nothing sent, when the session
  // cannot take a job any more.
  bool run(std::vector<grpc::ByteBuffer> messages, Take take,
           std::function<void(grpc::Status)> done) {
    {
      std::lock_guard<std::mutex> l(mu_);
      if (!reusable_locked() || done_) return false;
      messages_ = std::move(messages);
      next_ = 0;
      take_ = std::move(take);
      error_ = grpc::Status::OK;
      done_ = std::move(done);
      replied_ = written_ = false;
      AddHold();  // the writes' (until the last one is done; added while the hold between
                  // jobs is held, as gRPC allows after StartCall)
    }
    write_next();
    return true;
  }
  // Ends the session's call (a job under way fails CANCELLED); it is not used again.
  void cancel() {
    {
      std::lock_guard<std::mutex> l(mu_);
      cancelled_ = true;
    }
    ctx_.TryCancel();
  }
  // Between jobs: the session is closed (the shard then ends it), or, if it cannot take a job
  // any more, left to end.
  void retire() {
    {
      std::lock_guard<std::mutex> l(mu_);
      if (retired_) return;
      const bool close = reusable_locked();
      retired_ = true;
      if (close) StartWritesDone();
    }
    release();
  }
  // Whether it can take the next job (not broken, cancelled or retired).
  bool reusable() {
    std::lock_guard<std::mutex> l(mu_);
    return reusable_locked();
  }

  void OnWriteDone(bool ok) override {
    std::function<void(grpc::Status)> done;
    {
      std::unique_lock<std::mutex> l(mu_);
      if (ok && next_ < messages_.size()) {
        l.unlock();
        write_next();
        return;
      }
      // The last write, or a failed one (the call is broken: the reply's read fails too, and
      // OnDone says why; even if the reply came, no job goes on it any more).
      if (!ok) broken_ = true;
      written_ = true;
      messages_.clear();  // lets go of the floats' slices (a lender waits for them)
      if (replied_) done = std::move(done_);
    }
    if (done) done(grpc::Status::OK);
    RemoveHold();
  }
  void OnReadDone(bool ok) override {
    std::function<void(grpc::Status)> done;
    bool stray = false, over = false, taking = false;
    {
      std::lock_guard<std::mutex> l(mu_);
      taking = ok && done_ && !replied_;
      if (!taking) {
        stray = ok;  // a reply that no job asked for
        over = broken_ = true;
      }
    }
    if (taking) {  // (take_ is this job's until its done: no lock while it copies)
      grpc::Status error;
      const bool all = take_(in_, &error);
      in_.Clear();
      std::lock_guard<std::mutex> l(mu_);
      if (!error.ok()) {
        error_ = std::move(error);
        stray = over = broken_ = true;  // (cancelled below; OnDone fails the job with error_)
      } else if (all) {
        replied_ = true;
        if (written_) done = std::move(done_);
      }
    }
    if (over) {
      // The call ends once no write is under way, and OnDone gives its status to the job
      // under way, if any.
      if (stray) cancel();
      release();
      return;
    }
    StartRead(&in_);  // the next reply (first: the read keeps the call from ending)
    if (done) done(grpc::Status::OK);
  }
  void OnDone(const grpc::Status& s) override {
    std::function<void(grpc::Status)> done;
    std::shared_ptr<ShardSession> self;
    bool cancelled = false;
    grpc::Status error;
    {
      std::lock_guard<std::mutex> l(mu_);
      broken_ = true;
      cancelled = cancelled_ && error_.ok();
      error = error_;
      done = std::move(done_);
      self = std::move(self_);
    }
    // The shard ends its sessions when it exits: a job under way then ends CANCELLED, which
    // this worker did not ask for. That counts as the shard being unavailable (retried until
    // the deadline), as a call ended by a shard that exits does.
    grpc::Status status = s;
    if (!error.ok())
      status = error;  // a reply that take refused
    else if (s.ok())
      status = grpc::Status(grpc::StatusCode::INTERNAL,
                            "the shard ended the session without the job's replies");
    else if (s.error_code() == grpc::StatusCode::CANCELLED && !cancelled)
      status = grpc::Status(grpc::StatusCode::UNAVAILABLE,
                            "the shard ended the session: " + s.error_message());
    if (done) done(status);
    // (self goes here: this may be the last reference)
  }

 private:
  bool reusable_locked() const { return !broken_ && !cancelled_ && !retired_; }
  void write_next() {
    grpc::ByteBuffer* m;
    {
      std::lock_guard<std::mutex> l(mu_);
      m = &messages_[next_++];
    }
    StartWrite(m);
  }
  // Lets go of the hold kept between jobs (once).
  void release() {
    {
      std::lock_guard<std::mutex> l(mu_);
      if (released_) return;
      released_ = true;
    }
    RemoveHold();
  }
  // First: counted out last, once the context (and its reference to the channel) is gone.
  struct Counted {
    explicit Counted(std::shared_ptr<SessionCount> c) : count(std::move(c)) {
      std::lock_guard<std::mutex> l(count->mu);
      ++count->alive;
    }
    ~Counted() {
      std::lock_guard<std::mutex> l(count->mu);
      --count->alive;
      count->cv.notify_all();
    }
    std::shared_ptr<SessionCount> count;
  } counted_;
  grpc::ClientContext ctx_;
  std::mutex mu_;
  grpc::ByteBuffer in_;
  std::vector<grpc::ByteBuffer> messages_;  // the job under way's
  size_t next_ = 0;
  Take take_;                               // the job under way's
  grpc::Status error_;                      // a reply take refused
  std::function<void(grpc::Status)> done_;  // the job under way's
  bool replied_ = false, written_ = false;
  bool broken_ = false;  // its call is ending
  bool cancelled_ = false;
  bool retired_ = false;
  bool released_ = false;               // the hold between jobs
  std::shared_ptr<ShardSession> self_;  // until OnDone
};

ShardSet::~ShardSet() {
  std::vector<std::shared_ptr<ShardSession>> idle;
  {
    std::lock_guard<std::mutex> l(idle_mu_);
    for (auto& shard : idle_)
      for (auto& conn : shard)
        for (auto& s : conn) idle.push_back(std::move(s));
  }
  for (auto& s : idle) s->retire();
  idle.clear();
  // Each shard ends a closed session at once; one that does not answer is cancelled.
  std::unique_lock<std::mutex> l(live_->mu);
  if (!live_->cv.wait_for(l, std::chrono::seconds(1), [&] { return live_->alive == 0; })) {
    l.unlock();
    {
      std::lock_guard<std::mutex> o(idle_mu_);
      for (const auto& w : opened_)
        if (auto s = w.lock()) s->cancel();
    }
    l.lock();
    live_->cv.wait(l, [&] { return live_->alive == 0; });
  }
}

std::shared_ptr<ShardSession> ShardSet::take_session(SessionKind kind, int i, int k) {
  {
    std::lock_guard<std::mutex> l(idle_mu_);
    auto& pool = idle_[kind * size() + i][k];
    while (!pool.empty()) {
      std::shared_ptr<ShardSession> s = std::move(pool.back());
      pool.pop_back();
      if (s->reusable()) return s;
      s->retire();
    }
  }
  ++sessions_opened_;
  std::shared_ptr<ShardSession> s = ShardSession::open(
      generic(i, k), kind == kPushes ? kPushSessionMethod : kPullSessionMethod, token_, live_);
  std::lock_guard<std::mutex> l(idle_mu_);
  std::erase_if(opened_, [](const auto& w) { return w.expired(); });
  opened_.push_back(s);
  return s;
}

void ShardSet::keep_session(SessionKind kind, int i, int k, std::shared_ptr<ShardSession> s) {
  std::lock_guard<std::mutex> l(idle_mu_);
  idle_[kind * size() + i][k].push_back(std::move(s));
}

void ShardSet::on_sessions(SessionKind kind, const char* what, double timeout,
                           const std::vector<int>& stripes, const MakeJob& make_job) {
  // The sessions of the attempts, and whether each one's job is over.
  struct Taken {
    int i, k;
    std::shared_ptr<ShardSession> session;
    bool ok = false;
  };
  std::mutex mu;
  std::vector<Taken> taken;
  // Sessions whose job succeeded go back for the next call; the rest are retired (a broken
  // one is over already, or about to be).
  struct Return {
    ShardSet* set;
    SessionKind kind;
    std::vector<Taken>& taken;
    ~Return() {
      for (Taken& t : taken)
        if (t.ok && t.session->reusable())
          set->keep_session(kind, t.i, t.k, std::move(t.session));
        else
          t.session->retire();
    }
  } give_back{this, kind, taken};
  const auto until = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                        std::chrono::duration<double>(timeout));
  all(
      what, timeout,
      [&](int i, Contexts, std::function<void(grpc::Status)> done) {
        const int s = stripes[i];
        const uint64_t id = next_push_++;  // new for every attempt
        const int64_t timeout_ms = std::max<int64_t>(
            1, std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now()).count());
        streams_ += s;
        std::vector<Job> jobs;  // (first: nothing is started before they are all made)
        for (int k = 0; k < s; ++k) jobs.push_back(make_job(i, k, s, id, timeout_ms));
        std::vector<std::shared_ptr<ShardSession>> mine;
        for (int k = 0; k < s; ++k) mine.push_back(take_session(kind, i, k));
        std::vector<size_t> at;  // each stripe's place in taken
        {
          std::lock_guard<std::mutex> l(mu);
          for (int k = 0; k < s; ++k) {
            at.push_back(taken.size());
            taken.push_back({i, k, mine[k]});
          }
        }
        auto* striped = new StripedCall(
            s,
            [mine] {
              for (const auto& m : mine) m->cancel();
            },
            std::move(done));
        for (int k = 0; k < s; ++k) {
          auto finished = [&, striped, slot = at[k]](grpc::Status st) {
            if (st.ok()) {
              std::lock_guard<std::mutex> l(mu);
              taken[slot].ok = true;
            }
            striped->finished(st);
          };
          if (!mine[k]->run(std::move(jobs[k].messages), std::move(jobs[k].take), finished))
            finished(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                  "the session to the shard was over before the call began"));
        }
        striped->started();
      },
      stripes,
      [&] {
        std::lock_guard<std::mutex> l(mu);
        for (const Taken& t : taken)
          if (!t.ok) t.session->cancel();
      });
}

void ShardSet::push(const std::vector<PushOut>& out, std::vector<PushReply>& replies,
                    double timeout) {
  const int n = size();
  auto messages_of_push = [](const PushOut& o) {
    return o.pieces.empty() ? 1 : static_cast<int>(o.pieces.size());
  };
  // Shard i's messages [a, b), with the small fields in `head`.
  auto encode_pieces = [](const PushOut& o, PushRequest head, int a, int b) {
    std::vector<grpc::ByteBuffer> m;
    if (o.pieces.empty()) {
      head.set_ends(head.stripes() > 0);
      m.push_back(encode(head));
      return m;
    }
    for (int j = a; j < b; ++j) {
      head.set_offset(o.pieces[j].first);
      head.set_ends(head.stripes() > 0 && j + 1 == b);
      m.push_back(encode(head, PushRequest::kGradsFieldNumber, &o.pieces[j].second));
    }
    return m;
  };
  if (!sessions_) {
    std::vector<std::vector<grpc::ByteBuffer>> messages(n);
    for (int i = 0; i < n; ++i)
      messages[i] = encode_pieces(out[i], out[i].head, 0, messages_of_push(out[i]));
    push_streams(messages, replies, timeout);
    return;
  }
  std::vector<int> stripes(n);
  for (int i = 0; i < n; ++i) stripes[i] = std::min(stripes_, messages_of_push(out[i]));
  std::vector<std::vector<grpc::ByteBuffer>> in(n);
  on_sessions(kPushes, "Push", timeout, stripes,
              [&](int i, int k, int s, uint64_t id, int64_t timeout_ms) {
                const int p = messages_of_push(out[i]);
                PushRequest head = out[i].head;
                head.set_push(id);
                head.set_stripe(k);
                head.set_stripes(s);
                head.set_timeout_ms(timeout_ms);
                if (k == 0) in[i].assign(s, grpc::ByteBuffer());
                grpc::ByteBuffer* reply = &in[i][k];
                return Job{encode_pieces(out[i], head, p * k / s, p * (k + 1) / s),
                           [reply](grpc::ByteBuffer& b, grpc::Status*) {
                             *reply = b;
                             return true;
                           }};
              });
  decode_replies(in, replies);
}

void ShardSet::decode_replies(const std::vector<std::vector<grpc::ByteBuffer>>& in,
                              std::vector<PushReply>& replies) const {
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
  decode_replies(in, replies);
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
  if (sessions_)
    on_sessions(
        kPulls, "Pull", timeout, stripes, [&](int i, int k, int s, uint64_t, int64_t timeout_ms) {
          const auto [a, b] = stripe_floats(ranges[i].size(), piece, k, s);
          if (k == 0) versions[i].assign(s, 0);
          PullRequest r = request;
          r.set_stripe(k);
          r.set_stripes(s);
          r.set_timeout_ms(timeout_ms);
          auto pieces = std::make_shared<PieceReader>(dst + ranges[i].begin, a, b, &versions[i][k]);
          return Job{{encode(r)}, [pieces](grpc::ByteBuffer& in, grpc::Status* error) {
                       std::string why;
                       if (!pieces->take(in, &why)) {
                         *error =
                             grpc::Status(grpc::StatusCode::DATA_LOSS, "the pull's reply: " + why);
                         return false;
                       }
                       return pieces->complete();
                     }};
        });
  else
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
