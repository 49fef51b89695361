#include "towers/remote/shard_server.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <map>
#include <mutex>
#include <shared_mutex>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "core/check.h"
#include "core/clock.h"
#include "core/parallel.h"
#include "core/relaxed.h"
#include "kernels/reduce.h"
#include "optim/optimizer.h"
#include "towers/remote/messages.h"
#include "towers/remote/towers.grpc.pb.h"
#include "towers/remote/wire.h"

namespace towers::remote {

namespace {

using grpc::ServerContext;
using grpc::ServerContextBase;
using grpc::Status;
using grpc::StatusCode;

// Totals of one applied sync round, for every worker's reply.
struct RoundTotals {
  double loss_sum = 0.0;
  int64_t correct = 0, examples = 0;
  int contributors = 0;
  bool applied = false;
};

OptimizerConfig optimizer_from_json(const std::string& text) {
  const nlohmann::json j = nlohmann::json::parse(text);
  OptimizerConfig c;
  c.name = j.at("name").get<std::string>();
  if (j.contains("momentum") && !j["momentum"].is_null()) c.momentum = j["momentum"].get<float>();
  c.nesterov = j.value("nesterov", false);
  c.beta1 = j.value("beta1", c.beta1);
  c.beta2 = j.value("beta2", c.beta2);
  c.epsilon = j.value("epsilon", c.epsilon);
  c.rho = j.value("rho", c.rho);
  c.rms_epsilon = j.value("rms_epsilon", c.rms_epsilon);
  c.ema = j.value("ema", c.ema);
  c.lookahead_k = j.value("lookahead_k", c.lookahead_k);
  c.lookahead_alpha = j.value("lookahead_alpha", c.lookahead_alpha);
  return c;
}

// The threads that serve the raw calls (Push, Pull). A call may wait, at the sync barrier or
// for a version, until other calls have arrived, so each call gets a thread of its own: one
// waiting in the pool, or a new one when none is.
class CallThreads {
 public:
  ~CallThreads() {
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (std::thread& t : threads_) t.join();
  }
  void run(std::function<void()> f) {
    std::lock_guard<std::mutex> l(mu_);
    queue_.push_back(std::move(f));
    if (queue_.size() > static_cast<size_t>(idle_)) threads_.emplace_back([this] { serve(); });
    else cv_.notify_one();
  }

 private:
  void serve() {
    std::unique_lock<std::mutex> l(mu_);
    for (;;) {
      ++idle_;
      cv_.wait(l, [&] { return stop_ || !queue_.empty(); });
      --idle_;
      if (queue_.empty()) return;  // stop_
      std::function<void()> f = std::move(queue_.front());
      queue_.pop_front();
      l.unlock();
      f();
      l.lock();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  std::vector<std::thread> threads_;
  int idle_ = 0;
  bool stop_ = false;
};

// Push and Pull are raw (wire.h): their floats are not copied through protobuf messages.
using ShardBase = Shard::WithRawCallbackMethod_Push<Shard::WithRawCallbackMethod_Pull<Shard::Service>>;

class ShardService final : public ShardBase {
 public:
  ShardService(const ShardOptions& o) : o_(o), name_(fmt::format("ps:{}", o.index)) {}

  ~ShardService() override {
    {
      std::lock_guard<std::mutex> l(mu_);
      exit_ = true;
    }
    cv_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
  }

  // Blocks until the shard should exit: Shutdown, or every worker done or lost.
  void wait_for_exit() {
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait(l, [&] { return exit_; });
  }

  void say(const std::string& s) const {
    if (!o_.quiet) fmt::print(stderr, "towers ps:{}: {}\n", o_.index, s);
  }

  Status Init(ServerContext* ctx, const InitRequest* req, InitReply* rep) override {
    if (Status s = authorize(ctx); !s.ok()) return s;
    std::unique_lock<std::mutex> l(mu_);
    if (initialized_) {
      if (req->run_id() == run_id_ && req->layout_hash() == hash_) {  // a retried Init
        rep->set_begin(range_.begin);
        rep->set_end(range_.end);
        return Status::OK;
      }
      return {StatusCode::FAILED_PRECONDITION,
              fmt::format("{} already serves run {}; a shard serves one run (start a fresh one{})",
                          name_, run_id_,
                          restored_ ? fmt::format(", without {}, which it restored that run from",
                                                  checkpoint_path())
                                    : "")};
    }
    if (Status s = init_checked(*req, "the chief"); !s.ok()) return s;
    rep->set_begin(range_.begin);
    rep->set_end(range_.end);
    return Status::OK;
  }

  // A restarted shard: its last checkpoint, if --checkpoint-dir holds one. Throws for a file
  // that cannot be used.
  void restore() {
    if (o_.checkpoint_dir.empty()) return;
    const std::string path = checkpoint_path();
    std::ifstream in(path, std::ios::binary);
    if (!in.good()) return;
    std::stringstream ss;
    ss << in.rdbuf();
    InitRequest req;
    TOWERS_REQUIRE(req.ParseFromString(ss.str()), "{}: '{}' is not a shard checkpoint", name_, path);
    std::unique_lock<std::mutex> l(mu_);
    Status s = init_checked(req, path);
    restored_ = true;
    TOWERS_REQUIRE(s.ok(), "{}: cannot restore '{}': {}", name_, path, s.error_message());
  }

  Status Save(ServerContext* ctx, const SaveRequest* req, SaveReply* rep) override {
    if (Status s = authorize(ctx); !s.ok()) return s;
    if (Status s = check_reader(0); !s.ok()) return s;
    if (o_.checkpoint_dir.empty()) return Status::OK;  // no checkpoints: an empty path
    std::lock_guard<std::mutex> save(save_mu_);
    InitRequest ck;
    {
      std::lock_guard<std::mutex> l(mu_);
      ck = init_;
    }
    const size_t n = static_cast<size_t>(range_.size());
    {
      // sync: between rounds (the chief's towers are paused, so no round completes); async:
      // a copy that races with updates, read as relaxed atomics like every pull.
      std::shared_lock<std::shared_mutex> a(apply_mu_);
      ck.set_version(version_.load());
      ck.set_updates(opt_->updates());
      std::string* p = ck.mutable_params();
      p->resize(sizeof(float) * n);
      load_relaxed(params_.data(), reinterpret_cast<float*>(p->data()), static_cast<int64_t>(n));
      ck.clear_slots();
      for (const auto& [name, s] : opt_->slots()) {
        std::string* d = ck.add_slots();
        d->resize(sizeof(float) * n);
        load_relaxed(s, reinterpret_cast<float*>(d->data()), static_cast<int64_t>(n));
      }
    }
    const std::string path = checkpoint_path();
    try {
      write_atomically(path, ck.SerializeAsString());
    } catch (const std::exception& e) {
      return {StatusCode::INTERNAL, fmt::format("{}: {}", name_, e.what())};
    }
    say(fmt::format("saved version {} to {} (the chief's checkpoint is at {})", ck.version(), path,
                    req->version()));
    rep->set_path(path);
    rep->set_version(ck.version());
    return Status::OK;
  }

  // init_from, with anything it throws (a layout or optimizer state it cannot take) as the
  // call's error: a handler returns a status, never an exception.
  Status init_checked(const InitRequest& in, const std::string& from) {
    try {
      return init_from(in, from);
    } catch (const std::exception& e) {
      return {StatusCode::INVALID_ARGUMENT, fmt::format("{}: cannot initialise from {}: {}", name_,
                                                        from, e.what())};
    }
  }

  // Under mu_: takes the run from an Init (the chief's, or a checkpoint's: from). Everything is
  // built and checked before the shard's state changes.
  Status init_from(const InitRequest& in, const std::string& from) {
    const InitRequest* req = &in;
    auto layout = std::make_unique<ParameterLayout>(param_specs(req->variables()));
    if (layout_hash(*layout) != req->layout_hash())
      return {StatusCode::INVALID_ARGUMENT,
              fmt::format("{}: the variables sent do not give the layout hash sent ({:016x}); "
                          "client and shard disagree on the layout", name_, req->layout_hash())};
    const RunSpec& run = req->run();
    if (run.mode() != "sync" && run.mode() != "async" && run.mode() != "ssp")
      return {StatusCode::INVALID_ARGUMENT, fmt::format("{}: unknown mode '{}'", name_, run.mode())};
    if (run.workers() < 1 || run.replicas_to_aggregate() < 0 ||
        run.replicas_to_aggregate() > run.workers())
      return {StatusCode::INVALID_ARGUMENT,
              fmt::format("{}: {} workers with replicas_to_aggregate {}", name_, run.workers(),
                          run.replicas_to_aggregate())};
    const Range range = shard_ranges(layout->total(), static_cast<int>(o_.cluster.ps.size()))[o_.index];
    const size_t bytes = sizeof(float) * static_cast<size_t>(range.size());
    OptimizerConfig oc;
    try {
      oc = optimizer_from_json(run.optimizer());
    } catch (const std::exception& e) {
      return {StatusCode::INVALID_ARGUMENT, fmt::format("{}: bad optimizer config: {}", name_, e.what())};
    }
    if (!find_optimizer(oc.name))
      return {StatusCode::INVALID_ARGUMENT, fmt::format("{}: unknown optimizer '{}'", name_, oc.name)};
    auto opt = std::make_unique<Optimizer>(*layout, oc, range.begin, range.end);
    if (req->params().size() != bytes ||
        static_cast<size_t>(req->slots_size()) != opt->slot_names().size())
      return {StatusCode::INVALID_ARGUMENT,
              fmt::format("{}: Init carries {} bytes of parameters and {} slots; the range "
                          "[{}, {}) needs {} bytes and {} slots",
                          name_, req->params().size(), req->slots_size(), range.begin, range.end,
                          bytes, opt->slot_names().size())};
    for (const std::string& s : req->slots())
      if (s.size() != bytes)
        return {StatusCode::INVALID_ARGUMENT, fmt::format("{}: an Init slot of {} bytes; the range needs {}",
                                                          name_, s.size(), bytes)};
    if (req->updates() < 0 || req->version() < 0 || run.workers() > 4096)
      return {StatusCode::INVALID_ARGUMENT,
              fmt::format("{}: version {}, {} updates, {} workers: out of range", name_,
                          req->version(), req->updates(), run.workers())};
    opt->load_state({{"name", oc.name}, {"updates", req->updates()}});
    layout_ = std::move(layout);
    hash_ = req->layout_hash();
    range_ = range;
    run_ = run;
    opt_ = std::move(opt);
    params_ = HostBuffer(range.size());
    std::memcpy(params_.data(), req->params().data(), bytes);
    for (int i = 0; i < req->slots_size(); ++i)
      std::memcpy(opt_->slot(opt_->slot_names()[i]), req->slots(i).data(), bytes);
    version_.store(req->version());
    run_id_ = req->run_id();
    const int w = run.workers();
    k_ = run.replicas_to_aggregate() == 0 ? w : run.replicas_to_aggregate();
    grads_.clear();
    if (run.mode() == "sync")
      for (int i = 0; i < w; ++i) grads_.emplace_back(range.size());
    arrived_.assign(w, 0);
    worker_stats_.assign(w, {});
    clocks_.assign(w, 0);
    done_.assign(w, 0);
    lost_.assign(w, 0);
    // A worker that has not called yet has until the startup grace to do so.
    const auto now = Clock::now();
    seen_.assign(w, now + std::chrono::seconds(60));
    for (int i = 0; i < w; ++i)
      if (early_seen_.count(i)) seen_[i] = early_seen_[i];
    timeout_ = std::chrono::milliseconds(std::max<int64_t>(run.heartbeat_timeout_ms(), 100));
    initialized_ = true;
    init_ = *req;  // what a checkpoint repeats, less the arrays it replaces
    init_.clear_params();
    init_.clear_slots();
    say(fmt::format("serving [{}, {}) of {} floats ({:.2f} MB), {} mode, {} worker(s){}, "
                    "optimizer {}, from version {} (initialised by {})",
                    range.begin, range.end, layout_->total(), bytes / 1e6, run.mode(), w,
                    run.mode() == "sync" && k_ < w ? fmt::format(" (the first {} of each round)", k_) : "",
                    oc.name, req->version(), from));
    watchdog_ = std::thread([this] { watch(); });
    return Status::OK;
  }

  grpc::ServerUnaryReactor* Push(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* in,
                                 grpc::ByteBuffer* out) override {
    grpc::ServerUnaryReactor* r = ctx->DefaultReactor();
    serve(r, [=, this] {
      PushRequest req;
      PushReply rep;
      Bulk grads;
      std::string error;
      if (!decode(*in, PushRequest::kGradsFieldNumber, req, grads, &error))
        return Status(StatusCode::INVALID_ARGUMENT, fmt::format("{}: Push: {}", name_, error));
      Status s = push(ctx, &req, grads, &rep);
      if (s.ok()) *out = encode(rep);
      return s;
    });
    return r;
  }

  grpc::ServerUnaryReactor* Pull(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* in,
                                 grpc::ByteBuffer* out) override {
    grpc::ServerUnaryReactor* r = ctx->DefaultReactor();
    serve(r, [=, this] {
      PullRequest req;
      std::string error;
      if (!decode(*in, req, &error))
        return Status(StatusCode::INVALID_ARGUMENT, fmt::format("{}: Pull: {}", name_, error));
      return pull(ctx, &req, *out);
    });
    return r;
  }

  // Runs call() on a thread of threads_ and finishes the reactor with its status; an exception
  // is the call's error, not the shard's end.
  template <class Call>
  void serve(grpc::ServerUnaryReactor* r, Call call) {
    threads_.run([r, call = std::move(call), this] {
      Status s;
      try {
        s = call();
      } catch (const std::exception& e) {
        s = Status(StatusCode::INTERNAL, fmt::format("{}: {}", name_, e.what()));
      }
      r->Finish(s);
    });
  }

  // The gradient arrives in the received slices; it is copied once, into the sync round's
  // buffer of its worker, or (async, unless it arrived in one piece) into this thread's scratch.
  Status push(ServerContextBase* ctx, const PushRequest* req, const Bulk& grads, PushReply* rep) {
    if (Status s = authorize(ctx); !s.ok()) return s;
    if (Status s = check_worker(req->layout_hash(), req->worker()); !s.ok()) return s;
    const size_t bytes = sizeof(float) * static_cast<size_t>(range_.size());
    if (!req->skip() && grads.size() != bytes)
      return {StatusCode::INVALID_ARGUMENT,
              fmt::format("{}: a gradient of {} bytes from worker {}; the range [{}, {}) is {} "
                          "bytes: refused, not applied",
                          name_, grads.size(), req->worker(), range_.begin, range_.end, bytes)};
    if (run_.mode() == "sync") return push_sync(ctx, *req, grads, *rep);
    // async and ssp: applied at once, concurrently with pulls and other pushes.
    if (!req->skip()) {
      const auto* g = reinterpret_cast<const float*>(grads.contiguous());
      thread_local std::vector<float> scratch;
      if (g == nullptr || reinterpret_cast<uintptr_t>(g) % alignof(float) != 0) {
        scratch.resize(static_cast<size_t>(range_.size()));
        grads.copy_to(scratch.data());
        g = scratch.data();
      }
      opt_->apply_shared(params_.data(), g, req->lr(), run_.use_locking());
    }
    const int64_t v = version_.fetch_add(1) + 1;
    rep->set_version(v);
    rep->set_applied(!req->skip());
    rep->set_staleness(std::max<int64_t>(0, v - 1 - req->round()));
    {
      std::lock_guard<std::mutex> l(mu_);
      clocks_[req->worker()] = std::max(clocks_[req->worker()], req->clock());
    }
    cv_.notify_all();
    return Status::OK;
  }

  // The reply's parameters are copied once, into a slice that the reply owns.
  Status pull(ServerContextBase* ctx, const PullRequest* req, grpc::ByteBuffer& out) {
    if (Status s = authorize(ctx, req->worker() >= 0); !s.ok()) return s;
    if (req->worker() >= 0) {
      if (Status s = check_worker(req->layout_hash(), req->worker()); !s.ok()) return s;
    } else if (Status s = check_reader(req->layout_hash()); !s.ok()) {
      return s;
    }
    if (req->min_version() > 0 || (run_.mode() == "ssp" && req->worker() >= 0)) {
      std::unique_lock<std::mutex> l(mu_);
      if (req->worker() >= 0)  // a restarted shard learns the workers' clocks from their pulls
        clocks_[req->worker()] = std::max(clocks_[req->worker()], req->worker_clock());
      if (restored_ && run_.mode() == "sync" && req->min_version() > version_.load() &&
          arrived_count_ == 0)
        return {StatusCode::FAILED_PRECONDITION,
                fmt::format("{} was restarted and restored round {} from its checkpoint, but "
                            "worker {} is at round {}: sync cannot go on with the other shards "
                            "rounds ahead; continue the run from the chief's checkpoint with "
                            "--resume", name_, version_.load(), req->worker(), req->min_version())};
      auto ready = [&] {
        if (version_.load() < req->min_version()) return false;
        return run_.mode() != "ssp" || req->worker() < 0 ||
               req->clock() <= min_live_clock(req->worker()) + run_.staleness();
      };
      if (Status s = wait(l, ctx, ready, [&] {
            return version_.load() < req->min_version()
                       ? fmt::format("version {} (at {})", req->min_version(), version_.load())
                       : fmt::format("the slowest worker (clock {} is more than {} ahead)",
                                     req->clock(), run_.staleness());
          });
          !s.ok())
        return s;
    }
    const size_t n = static_cast<size_t>(range_.size());
    // sync: no update runs while the copy is taken (the shared lock), so it is one copy
    // straight into the message; async: updates race with the copy (Hogwild), read as
    // relaxed atomics like every reader of the store (the lock is never held exclusively).
    PullReply rep;
    OwnedSlice params = owned_slice(sizeof(float) * n);
    {
      std::shared_lock<std::shared_mutex> l(apply_mu_);
      rep.set_version(version_.load());
      if (run_.mode() == "sync")
        std::memcpy(params.data, params_.data(), sizeof(float) * n);
      else
        load_relaxed(params_.data(), reinterpret_cast<float*>(params.data), static_cast<int64_t>(n));
      if (req->with_slots()) copy_slots(rep);
    }
    out = encode(rep, PullReply::kParamsFieldNumber, &params.slice);
    return Status::OK;
  }

  Status Heartbeat(ServerContext* ctx, const HeartbeatRequest* req, HeartbeatReply* rep) override {
    if (Status s = authorize(ctx); !s.ok()) return s;
    std::lock_guard<std::mutex> l(mu_);
    const int w = req->worker();
    if (!initialized_) {
      early_seen_[w] = Clock::now();
      return Status::OK;
    }
    if (w < 0 || w >= static_cast<int>(seen_.size()))
      return {StatusCode::INVALID_ARGUMENT, fmt::format("{}: no worker {}", name_, w)};
    seen(w);
    if (req->done() && !done_[w]) {
      done_[w] = 1;
      say(fmt::format("worker {} is done", w));
      check_exit();
    }
    rep->set_version(version_.load());
    cv_.notify_all();
    return Status::OK;
  }

  Status Shutdown(ServerContext* ctx, const ShutdownRequest*, ShutdownReply*) override {
    if (Status s = authorize(ctx); !s.ok()) return s;
    std::lock_guard<std::mutex> l(mu_);
    say("shut down by a client");
    exit_ = true;
    cv_.notify_all();
    return Status::OK;
  }

  Status Info(ServerContext* ctx, const InfoRequest* req, InfoReply* rep) override {
    if (Status s = authorize(ctx, false); !s.ok()) return s;
    std::lock_guard<std::mutex> l(mu_);
    rep->set_initialized(initialized_);
    rep->set_run_id(run_id_);
    rep->set_version(version_.load());
    rep->set_layout_hash(hash_);
    rep->set_begin(range_.begin);
    rep->set_end(range_.end);
    rep->set_total(layout_ ? layout_->total() : 0);
    rep->set_dropped(dropped_);
    rep->set_heartbeat_timeout_ms(timeout_.count());
    if (req->with_layout() && initialized_) {
      *rep->mutable_variables() = init_.variables();
      rep->set_model(init_.model());
      rep->set_config(init_.config());
      rep->set_mode(run_.mode());
    }
    for (size_t w = 0; w < lost_.size(); ++w) {
      if (lost_[w]) rep->add_lost_workers(static_cast<int>(w));
      if (done_[w]) rep->add_done_workers(static_cast<int>(w));
    }
    return Status::OK;
  }

 private:
  // write: the call changes the shard or takes part in the run (everything but Info and a
  // reader's Pull), so only the run's token will do; a read-only token does for the rest.
  Status authorize(ServerContextBase* ctx, bool write = true) const {
    const auto& md = ctx->client_metadata();
    auto it = md.find(kTokenKey);
    if (it == md.end()) {
      note_rejected(ctx, "no token");
      return {StatusCode::UNAUTHENTICATED,
              fmt::format("{}: the call carries no token (metadata '{}'); give --token-file or "
                          "TOWERS_TOKEN", name_, kTokenKey)};
    }
    const std::string got(it->second.data(), it->second.size());
    if (!same(got, o_.token)) {
      if (!write && !o_.read_token.empty() && same(got, o_.read_token)) return Status::OK;
      if (!o_.read_token.empty() && same(got, o_.read_token)) {
        note_rejected(ctx, "the read-only token on a call that needs the run's");
        return {StatusCode::PERMISSION_DENIED,
                fmt::format("{}: the read-only token allows reading the parameters only", name_)};
      }
      note_rejected(ctx, "wrong token");
      return {StatusCode::UNAUTHENTICATED,
              fmt::format("{}: wrong token: the call's token is not this run's (check "
                          "--token-file / TOWERS_TOKEN)", name_)};
    }
    return Status::OK;
  }

  // Compared in constant time (for tokens of one length).
  static bool same(const std::string& a, const std::string& b) {
    unsigned diff = a.size() != b.size();
    for (size_t i = 0; i < a.size(); ++i) diff |= a[i] ^ b[i % std::max<size_t>(1, b.size())];
    return diff == 0;
  }

  // Logs a rejected call: the first 10, then every 1000th (a flood does not fill the log).
  void note_rejected(ServerContextBase* ctx, const char* why) const {
    const int64_t n = ++rejected_;
    if (n <= 10 || n % 1000 == 0)
      say(
          fmt::format("rejected a call from {}: {} ({} rejected so far)", ctx->peer(), why, n));
  }

  Status check_reader(uint64_t hash) {
    std::lock_guard<std::mutex> l(mu_);
    if (!initialized_ && hash != 0)  // a call of a run: the run's shard has lost its state
      return {StatusCode::FAILED_PRECONDITION,
              fmt::format("{} has no parameters of this run: it was restarted without a "
                          "checkpoint (--checkpoint-dir) to restore", name_)};
    if (!initialized_)
      return {StatusCode::UNAVAILABLE, fmt::format("{} is not initialised yet (the chief has not "
                                                   "sent the parameters)", name_)};
    if (hash != 0 && hash != hash_)
      return {StatusCode::INVALID_ARGUMENT,
              fmt::format("{}: layout hash {:016x} does not match this run's {:016x}: a different "
                          "model; refused", name_, hash, hash_)};
    return Status::OK;
  }

  Status check_worker(uint64_t hash, int worker) {
    if (Status s = check_reader(hash); !s.ok()) return s;
    std::lock_guard<std::mutex> l(mu_);
    if (worker < 0 || worker >= static_cast<int>(seen_.size()))
      return {StatusCode::INVALID_ARGUMENT,
              fmt::format("{}: worker {} is not in this run of {} workers", name_, worker,
                          seen_.size())};
    seen(worker);
    return Status::OK;
  }

  // Under mu_: worker w has called now. A lost worker that calls again is back.
  void seen(int w) {
    seen_[w] = Clock::now();
    if (lost_[w]) {
      lost_[w] = 0;
      say(fmt::format("worker {} is back", w));
    }
  }

  // Under mu_: the smallest clock of the live workers other than `except` (its own).
  int64_t min_live_clock(int except) const {
    int64_t m = std::numeric_limits<int64_t>::max();
    for (size_t w = 0; w < clocks_.size(); ++w)
      if (static_cast<int>(w) != except && !lost_[w] && !done_[w]) m = std::min(m, clocks_[w]);
    return m == std::numeric_limits<int64_t>::max() ? clocks_[except] : m;
  }

  // Under mu_: the shard exits once every worker is done or lost (and one was done).
  void check_exit() {
    bool any_done = false;
    for (size_t w = 0; w < done_.size(); ++w) {
      if (!done_[w] && !lost_[w]) return;
      any_done = any_done || done_[w];
    }
    if (!any_done) return;
    say("every worker is done or lost; exiting");
    exit_ = true;
    cv_.notify_all();
  }

  // Waits on cv_ (l holds mu_) until ready(), the call's deadline, or a lost worker that the
  // wait needs (sync). what() says what is waited for.
  template <class Ready, class What>
  Status wait(std::unique_lock<std::mutex>& l, ServerContextBase* ctx, Ready ready, What what) {
    while (!ready()) {
      if (exit_) return {StatusCode::UNAVAILABLE, fmt::format("{} is shutting down", name_)};
      if (ctx->IsCancelled())
        return {StatusCode::CANCELLED, fmt::format("{}: the call was cancelled", name_)};
      if (Status s = lost_blocks_round(); !s.ok()) return s;
      if (std::chrono::system_clock::now() >= ctx->deadline())
        return {StatusCode::DEADLINE_EXCEEDED,
                fmt::format("{}: the call's deadline passed while waiting for {}", name_, what())};
      cv_.wait_for(l, std::chrono::milliseconds(100));
    }
    return Status::OK;
  }

  // Under mu_: in sync mode, whether lost workers leave the current round unable to complete.
  Status lost_blocks_round() const {
    if (run_.mode() != "sync") return Status::OK;
    int possible = 0;
    std::vector<int> lost, stopped;
    for (size_t w = 0; w < lost_.size(); ++w) {
      if (arrived_[w] || (!lost_[w] && !done_[w])) ++possible;
      else if (lost_[w]) lost.push_back(static_cast<int>(w));
      else stopped.push_back(static_cast<int>(w));  // done before this round: it stopped early
    }
    if (possible >= k_ || (lost.empty() && stopped.empty())) return Status::OK;
    std::string why;
    if (!lost.empty())
      why = fmt::format("worker(s) {} lost (no call for {:.1f} s)", fmt::join(lost, ", "),
                        timeout_.count() / 1e3);
    if (!stopped.empty())
      why += fmt::format("{}worker(s) {} stopped before the round", why.empty() ? "" : "; ",
                         fmt::join(stopped, ", "));
    return {StatusCode::ABORTED,
            fmt::format("{}: round {} cannot complete: {}; sync needs {} of {} workers", name_,
                        version_.load(), why, k_, lost_.size())};
  }

  Status push_sync(ServerContextBase* ctx, const PushRequest& req, const Bulk& grads, PushReply& rep) {
    std::unique_lock<std::mutex> l(mu_);
    const int w = req.worker();
    const int64_t round = req.round();
    const int64_t v = version_.load();
    if (round < v) {
      // A late gradient of an applied round (backup workers): dropped and counted.
      ++dropped_;
      rep.set_version(v);
      rep.set_dropped(true);
      return Status::OK;
    }
    if (round > v)
      return {StatusCode::FAILED_PRECONDITION,
              restored_
                  ? fmt::format("{} was restarted and restored round {} from its checkpoint, but "
                                "worker {} is at round {}: sync cannot go on with the other "
                                "shards rounds ahead; continue the run from the chief's "
                                "checkpoint with --resume", name_, v, w, round)
                  : fmt::format("{}: worker {} pushed round {} but the shard is at round {}",
                                name_, w, round, v)};
    if (arrived_[w])
      return {StatusCode::FAILED_PRECONDITION,
              fmt::format("{}: worker {} pushed round {} twice", name_, w, round)};
    if (!req.skip()) grads.copy_to(grads_[w].data());
    arrived_[w] = 1;
    worker_stats_[w] = {req.loss_sum(), req.correct(), req.examples(), req.towers(), !req.skip()};
    lr_ = req.lr();
    if (++arrived_count_ == k_) apply_round(round);
    if (Status s = wait(l, ctx, [&] { return version_.load() > round; },
                        [&] { return fmt::format("the other workers' gradients of round {}", round); });
        !s.ok()) {
      if (version_.load() <= round && arrived_[w]) {  // withdraw: the round may still complete
        arrived_[w] = 0;
        --arrived_count_;
      }
      return s;
    }
    const auto found = rounds_.find(round);
    if (found == rounds_.end())  // more than 64 rounds went by before this call woke up
      return {StatusCode::INTERNAL,
              fmt::format("{}: round {} was applied, but its totals are no longer kept", name_, round)};
    const RoundTotals& t = found->second;
    rep.set_version(round + 1);
    rep.set_applied(t.applied);
    rep.set_loss_sum(t.loss_sum);
    rep.set_correct(t.correct);
    rep.set_examples(t.examples);
    rep.set_contributors(t.contributors);
    return Status::OK;
  }

  // Under mu_: the K-th gradient of the round has arrived. Sums the arrived workers' gradients
  // in rank order by the fixed tree and applies the sum, unless a contributor's loss was not
  // finite (then the round is skipped, as in one process).
  void apply_round(int64_t round) {
    RoundTotals t;
    std::vector<float*> blocks;
    bool finite = true;
    for (size_t w = 0; w < arrived_.size(); ++w) {
      if (!arrived_[w]) continue;
      const WorkerStats& s = worker_stats_[w];
      t.loss_sum += s.loss_sum;
      t.correct += s.correct;
      t.examples += s.examples;
      t.contributors += s.towers;
      finite = finite && s.finite;
      blocks.push_back(grads_[w].data());
    }
    if (finite) {
      std::unique_lock<std::shared_mutex> a(apply_mu_);
      const int64_t n = range_.size();
      const int count = static_cast<int>(blocks.size());
      if (count > 1)
        for_chunks(n, 1 << 15, [&](int64_t, int64_t b, int64_t e) {
          kernels::cpu::tree_sum(blocks.data(), count, b, e);
        });
      opt_->apply(params_.data(), blocks[0], lr_);
    }
    t.applied = finite;
    rounds_[round] = t;
    while (rounds_.size() > 64) rounds_.erase(rounds_.begin());
    std::fill(arrived_.begin(), arrived_.end(), 0);
    arrived_count_ = 0;
    version_.store(round + 1);
    cv_.notify_all();
  }

  void copy_slots(PullReply& rep) {
    const size_t bytes = sizeof(float) * static_cast<size_t>(range_.size());
    for (const auto& [name, p] : opt_->slots()) {
      std::string* s = rep.add_slots();
      s->resize(bytes);
      load_relaxed(p, reinterpret_cast<float*>(s->data()), range_.size());
    }
    rep.set_updates(opt_->updates());
  }

  // Marks workers lost after the heartbeat timeout without a call.
  void watch() {
    std::unique_lock<std::mutex> l(mu_);
    while (!exit_) {
      cv_.wait_for(l, std::chrono::milliseconds(100));
      const auto now = Clock::now();
      bool changed = false;
      for (size_t w = 0; w < seen_.size(); ++w) {
        if (lost_[w] || done_[w] || now - seen_[w] <= timeout_) continue;
        lost_[w] = 1;
        changed = true;
        say(fmt::format("worker {} lost: no call for {:.1f} s", w,
                        std::chrono::duration<double>(now - seen_[w]).count()));
      }
      if (changed) {
        check_exit();
        cv_.notify_all();
      }
    }
  }

  struct WorkerStats {
    double loss_sum = 0.0;
    int64_t correct = 0, examples = 0;
    int towers = 0;
    bool finite = true;
  };

  std::string checkpoint_path() const {
    return (std::filesystem::path(o_.checkpoint_dir) / fmt::format("ps-{}.ckpt", o_.index)).string();
  }

  // path's bytes replaced by data, or left as they were: a temporary file in the same folder,
  // fsynced, renamed over path, the folder fsynced.
  static void write_atomically(const std::string& path, const std::string& data) {
    const std::string tmp = fmt::format("{}.tmp-{}", path, getpid());
    const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    TOWERS_REQUIRE(fd >= 0, "cannot write '{}': {}", tmp, std::strerror(errno));
    size_t done = 0;
    while (done < data.size()) {
      const ssize_t w = write(fd, data.data() + done, data.size() - done);
      if (w <= 0) {
        const int err = errno;
        close(fd);
        unlink(tmp.c_str());
        TOWERS_BAD_INPUT("cannot write '{}': {}", tmp, std::strerror(err));
      }
      done += static_cast<size_t>(w);
    }
    const bool synced = fsync(fd) == 0;
    close(fd);
    if (!synced || rename(tmp.c_str(), path.c_str()) != 0) {
      const int err = errno;
      unlink(tmp.c_str());
      TOWERS_BAD_INPUT("cannot save '{}': {}", path, std::strerror(err));
    }
    const std::string dir = std::filesystem::path(path).parent_path().string();
    const int dfd = open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd >= 0) {
      fsync(dfd);
      close(dfd);
    }
  }

  const ShardOptions& o_;
  const std::string name_;
  InitRequest init_;      // the run as initialised, without its arrays
  bool restored_ = false;  // from a checkpoint, by a restarted shard
  std::mutex save_mu_;    // one Save at a time
  mutable std::atomic<int64_t> rejected_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  bool initialized_ = false, exit_ = false;
  std::string run_id_;
  std::unique_ptr<ParameterLayout> layout_;
  uint64_t hash_ = 0;
  Range range_;
  RunSpec run_;
  int k_ = 1;
  HostBuffer params_;
  std::unique_ptr<Optimizer> opt_;
  std::atomic<int64_t> version_{0};
  std::shared_mutex apply_mu_;  // sync: pulls copy under it shared, a round applies exclusively
  std::vector<HostBuffer> grads_;  // sync: each worker's gradient of the current round
  std::vector<char> arrived_;
  std::vector<WorkerStats> worker_stats_;
  int arrived_count_ = 0;
  float lr_ = 0.0f;
  std::map<int64_t, RoundTotals> rounds_;  // the last applied rounds, for late repliers
  int64_t dropped_ = 0;
  std::vector<int64_t> clocks_;
  std::vector<char> done_, lost_;
  std::vector<Clock::time_point> seen_;
  std::map<int, Clock::time_point> early_seen_;
  std::chrono::milliseconds timeout_{10000};
  std::thread watchdog_;
  CallThreads threads_;  // last: joined first, while everything its calls use is still there
};

}  // namespace

int run_shard(const ShardOptions& o) {
  TOWERS_REQUIRE(o.index >= 0 && o.index < static_cast<int>(o.cluster.ps.size()),
                 "--task ps:{}: {} has {} ps entries", o.index, o.cluster.origin, o.cluster.ps.size());
  const std::string& entry = o.cluster.ps[o.index];
  const std::string port = entry.substr(entry.rfind(':') + 1);
  const std::string address = (o.bind.find(':') != std::string::npos ? "[" + o.bind + "]" : o.bind) + ":" + port;
  keep_message_buffers();
  if (!o.checkpoint_dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(o.checkpoint_dir, ec);
    TOWERS_REQUIRE(std::filesystem::is_directory(o.checkpoint_dir),
                   "--checkpoint-dir: '{}' is not a directory and cannot be created",
                   o.checkpoint_dir);
  }
  ShardService service(o);
  service.restore();
  grpc::ServerBuilder builder;
  int bound = 0;
  builder.AddListeningPort(address, server_credentials(o.tls), &bound);
  builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
  builder.SetMaxSendMessageSize(kMaxMessageBytes);
  tune(builder);
  // A second shard on the same port is an error, not a sharer of its connections.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  TOWERS_REQUIRE(server && bound != 0, "ps:{}: cannot listen on {} (the port is in use, or --bind "
                 "is not an address of this machine)", o.index, address);
  service.say(fmt::format("listening on {}{}", address, o.tls.enabled() ? " (TLS)" : ""));
  service.wait_for_exit();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  return 0;
}

}  // namespace towers::remote
