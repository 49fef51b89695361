#include "towers/remote/shard_server.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>
#include <tuple>
#include <utility>

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

// The threads that serve the raw calls (Push, Pull) and take PushStream's messages. A call may
// wait, at the sync barrier or for a version, until other calls have arrived, so each call that
// may wait gets a thread of its own: one waiting in the pool, or a new one when none is. (A
// worker's pull in plain sync that need not wait is served on gRPC's thread: PullStream.)
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
  // Runs f on a thread of the pool, or throws with nothing queued (no thread could be
  // started: the caller fails what f was for, and f never runs).
  void run(std::function<void()> f) {
    std::lock_guard<std::mutex> l(mu_);
    queue_.push_back(std::move(f));
    if (queue_.size() <= static_cast<size_t>(idle_)) {
      cv_.notify_one();
      return;
    }
    try {
      threads_.emplace_back([this] { serve(); });
    } catch (...) {
      queue_.pop_back();
      throw;
    }
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

// Push, Pull and their streams are raw (wire.h): their floats are not copied through protobuf
// messages.
using ShardBase = Shard::WithRawCallbackMethod_Push<
    Shard::WithRawCallbackMethod_Pull<Shard::WithRawCallbackMethod_PushStream<
        Shard::WithRawCallbackMethod_PullStream<Shard::WithRawCallbackMethod_PushSession<
            Shard::WithRawCallbackMethod_PullSession<Shard::Service>>>>>>;

// Who asks, and by when the answer is due: a call's context (its metadata, its cancellation)
// and its deadline, or for a push on a session (PushSession), the push's own deadline.
struct Asker {
  Asker(ServerContextBase* c)  // NOLINT: a call asks (null: nobody waits for the answer)
      : ctx(c), deadline(c ? c->deadline() : std::chrono::system_clock::time_point::max()) {}
  Asker(ServerContextBase* c, std::chrono::system_clock::time_point d) : ctx(c), deadline(d) {}
  ServerContextBase* ctx;
  std::chrono::system_clock::time_point deadline;
};

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
    // Pulls' slices of the parameters that gRPC still holds come back as it lets go of them;
    // wait (a little) so that none comes back to a shard that is gone.
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait_for(l, std::chrono::seconds(5), [&] { return copying_ == 0; });
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
    // (Held while the run's start is saved: no Save or Restore meanwhile, and a retried Init
    // waits for the first one's answer.)
    std::lock_guard<std::mutex> save(save_mu_);
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
                          restored_ ? fmt::format(", without the checkpoints in {}, which it "
                                                  "restored that run from", o_.checkpoint_dir)
                                    : "")};
    }
    if (Status s = init_checked(*req, "the chief", /*save_start=*/true); !s.ok()) return s;
    rep->set_begin(range_.begin);
    rep->set_end(range_.end);
    return Status::OK;
  }

  // A restarted shard: its last checkpoint, if --checkpoint-dir holds one. Throws for a file
  // that cannot be used. In a sync run the other shards are rounds ahead of it: the workers'
  // calls are refused with a rollback to its version, at a generation after the one it saved
  // at (and after any the workers are at: admit()).
  void restore() {
    if (o_.checkpoint_dir.empty()) return;
    const std::map<int64_t, std::string> files = checkpoints();
    if (files.empty()) return;
    const std::string& path = files.rbegin()->second;
    const InitRequest req = read_checkpoint(path);
    std::unique_lock<std::mutex> l(mu_);
    Status s = init_checked(req, path);
    restored_ = true;
    TOWERS_REQUIRE(s.ok(), "{}: cannot restore '{}': {}", name_, path, s.error_message());
    // The workers of a live run beat every fifth of the heartbeat timeout and call an
    // unreachable shard again within a second, so they reach a restarted one well within the
    // timeout and kRestartGrace. One that none reaches (check_exit) is not waited for the
    // startup grace of a fresh shard's workers.
    restarted_grace_ = Clock::now() + kRestartGrace;
    seen_.assign(seen_.size(), restarted_grace_);
    generation_ = req.generation();
    if (run_.mode() == "sync") {
      generation_ = req.generation() + 1;
      rollback_version_ = version_.load();
      pending_ = true;
      say(fmt::format("the other shards may be rounds ahead: workers will be asked to roll back "
                      "to round {} (generation {})", rollback_version_, generation_));
    }
  }

  // A checkpoint file of this shard (an InitRequest); throws naming the file.
  InitRequest read_checkpoint(const std::string& path) const {
    std::ifstream in(path, std::ios::binary);
    TOWERS_REQUIRE(in.good(), "{}: cannot read '{}'", name_, path);
    std::stringstream ss;
    ss << in.rdbuf();
    InitRequest req;
    TOWERS_REQUIRE(req.ParseFromString(ss.str()), "{}: '{}' is not a shard checkpoint", name_, path);
    return req;
  }

  // Sync: goes back to the request's version, from this shard's checkpoint at that version,
  // once no call of an earlier generation is still taking a piece, applying one or holding
  // the parameters; calls of earlier generations are refused from the start, and the waiting
  // ones are woken and refused.
  Status Restore(ServerContext* ctx, const RestoreRequest* req, RestoreReply* rep) override {
    if (Status s = authorize(ctx); !s.ok()) return s;
    if (Status s = check_reader(req->layout_hash()); !s.ok()) return s;
    if (run_.mode() != "sync")
      return {StatusCode::FAILED_PRECONDITION,
              fmt::format("{}: rollbacks are for sync runs; this run is {}", name_, run_.mode())};
    if (o_.checkpoint_dir.empty())
      return {StatusCode::FAILED_PRECONDITION,
              fmt::format("{} was started without --checkpoint-dir, so it cannot roll back to "
                          "round {}; continue the run from the chief's checkpoint with --resume",
                          name_, req->version())};
    const Rollback want{req->version(), req->generation()};
    // No Save between the switch and the reload: what it wrote could be of the rounds given up.
    std::lock_guard<std::mutex> saving(save_mu_);
    InitRequest ck;
    std::string path;
    for (bool read = false;;) {
      std::unique_lock<std::mutex> l(mu_);
      if (want.generation < generation_) {
        offered_ = offered_ || pending_;
        return rollback_status({rollback_version_, generation_},
                               fmt::format("{} is at a later rollback: round {}, generation {}",
                                           name_, rollback_version_, generation_));
      }
      if (pending_ && !offered_) {
        // A restarted shard's generation (its checkpoint's, plus one) may be one the workers
        // already are at, from a rollback after that checkpoint was saved: a Restore of it is
        // that rollback's, taken late by a worker, and not this shard's, which is then one
        // generation after it.
        generation_ = want.generation + 1;
        offered_ = true;
        return rollback_status({rollback_version_, generation_},
                               fmt::format("{} was restarted and restored round {}: roll back "
                                           "to it (generation {})",
                                           name_, rollback_version_, generation_));
      }
      if (pending_ && want.version > rollback_version_) {
        // A restarted shard has no round after its checkpoint's: the others come back to it.
        generation_ = std::max(generation_, want.generation) + 1;
        return rollback_status({rollback_version_, generation_},
                               fmt::format("{} was restarted at round {}, before round {}: roll "
                                           "back to it (generation {})", name_,
                                           rollback_version_, want.version, generation_));
      }
      if (want.generation == generation_ && want.version != rollback_version_) {
        // Two restarted shards made one generation from different rounds (and workers may
        // have taken either): the earlier round, one generation on, loaded here when asked.
        generation_ += 1;
        rollback_version_ = std::min(rollback_version_, want.version);
        pending_ = false;
        needs_load_ = true;
        return rollback_status({rollback_version_, generation_},
                               fmt::format("{} restored a later round: roll back to round {} "
                                           "(generation {})", name_, rollback_version_,
                                           generation_));
      }
      if (want.generation == generation_ && !needs_load_) {  // this rollback is done here
        pending_ = false;
        rep->set_version(version_.load());
        return Status::OK;
      }
      if (!read) {
        // The checkpoint is read and checked before anything changes.
        l.unlock();
        path = checkpoint_path(want.version);
        if (!std::filesystem::exists(path)) {
          // No checkpoint of that round here. With backup workers, rounds go on while the
          // chief checkpoints, so the shards save rounds apart: the latest earlier round saved
          // here, one generation on, for every shard to load (one without it offers its own
          // latest before it, down to a round that every shard saved).
          int64_t earlier = -1;
          for (const auto& [v, file] : checkpoints())
            if (v < want.version) earlier = v;
          if (earlier >= 0) {
            l.lock();
            if (want.generation < generation_) continue;  // (moved meanwhile: answered above)
            generation_ = std::max(generation_, want.generation) + 1;
            rollback_version_ = earlier;
            pending_ = false;
            needs_load_ = true;
            return rollback_status(
                {rollback_version_, generation_},
                fmt::format("{} has no checkpoint of round {}: roll back to round {}, the latest "
                            "before it saved here (generation {})",
                            name_, want.version, rollback_version_, generation_));
          }
        }
        try {
          ck = read_checkpoint(path);
        } catch (const std::exception& e) {
          return {StatusCode::FAILED_PRECONDITION,
                  fmt::format("{} cannot roll back to round {}: {}; continue the run from the "
                              "chief's checkpoint with --resume", name_, want.version, e.what())};
        }
        const size_t bytes = sizeof(float) * static_cast<size_t>(range_.size());
        if (ck.layout_hash() != hash_ || ck.version() != want.version ||
            ck.params().size() != bytes ||
            static_cast<size_t>(ck.slots_size()) != opt_->slot_names().size())
          return {StatusCode::FAILED_PRECONDITION,
                  fmt::format("{} cannot roll back to round {}: '{}' holds round {} of another "
                              "range or layout", name_, want.version, path, ck.version())};
        for (const std::string& slot : ck.slots())
          if (slot.size() != bytes)
            return {StatusCode::FAILED_PRECONDITION,
                    fmt::format("{} cannot roll back: a slot of '{}' does not fit the range", name_,
                                path)};
        read = true;
        continue;  // (the generation may have moved meanwhile)
      }
      generation_ = want.generation;
      rollback_version_ = want.version;
      pending_ = false;
      needs_load_ = true;  // until the checkpoint is in (a Restore that times out leaves it so)
      restoring_ = true;
      cv_.notify_all();
      // The calls of earlier generations let go: their copies and applies of pieces finish,
      // and gRPC lets go of the parameters lent to their pulls.
      auto quiet = [&] {
        return started_ == finished_ && copying_ == 0 &&
               std::all_of(inflight_.begin(), inflight_.end(), [](int n) { return n == 0; });
      };
      if (!cv_.wait_until(l, answer_by(ctx), quiet)) {
        restoring_ = false;
        return {StatusCode::DEADLINE_EXCEEDED,
                fmt::format("{}: the round in progress did not let go of the parameters before "
                            "the rollback's deadline", name_)};
      }
      const size_t bytes = sizeof(float) * static_cast<size_t>(range_.size());
      std::memcpy(params_.data(), ck.params().data(), bytes);
      for (int i = 0; i < ck.slots_size(); ++i)
        std::memcpy(opt_->slot(opt_->slot_names()[i]), ck.slots(i).data(), bytes);
      opt_->load_state({{"name", opt_->config().name}, {"updates", ck.updates()}});
      version_.store(want.version);
      clear_round();
      taken_back_ = kept_round_ = -1;
      round_updates_ = opt_->updates();
      deferred_.clear();
      rounds_.clear();
      needs_load_ = restoring_ = false;
      cv_.notify_all();
      l.unlock();
      // Checkpoints of the rounds given up are not restored from again.
      for (const auto& [v, file] : checkpoints())
        if (v > want.version) std::filesystem::remove(file);
      say(fmt::format("rolled back to round {} (generation {}) from {}", want.version,
                      want.generation, path));
      rep->set_version(want.version);
      rep->set_path(path);
      return Status::OK;
    }
  }

  // Sync, a worker's call at rollback generation `gen`: refused with the rollback to adopt
  // when the shard is at a later one; held while a rollback is being loaded.
  Status admit(Asker ctx, int64_t gen, bool* would_wait = nullptr) {
    if (run_.mode() != "sync") return Status::OK;
    std::unique_lock<std::mutex> l(mu_);
    // A restarted shard's rollback comes after every generation the workers are at.
    if (pending_ && gen >= generation_) generation_ = gen + 1;
    if (gen < generation_ || needs_load_) {  // (needs_load_: Restore loads)
      offered_ = offered_ || pending_;
      return stale(gen);
    }
    if (gen > generation_)
      return {StatusCode::FAILED_PRECONDITION,
              fmt::format("{}: a call of rollback generation {}, but the shard is at {}", name_,
                          gen, generation_)};
    if (!restoring_) return Status::OK;
    return wait(l, ctx, [&] { return !restoring_; },
                [] { return std::string("the rollback to finish"); }, gen, would_wait);
  }

  // Under mu_: the refusal of a call of generation gen, earlier than the shard's.
  Status stale(int64_t gen) const {
    return rollback_status({rollback_version_, generation_},
                           fmt::format("{} {} round {}: roll back to it (generation {}; the "
                                       "call's is {})", name_,
                                       pending_ ? "was restarted and restored" : "went back to",
                                       rollback_version_, generation_, gen));
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
    // sync: between rounds (the chief's towers are paused, so no round completes); async: a
    // copy that races with updates, read as relaxed atomics like every pull.
    if (Status s = read_params(ctx, [&] {
          ck.set_version(version_.load());
          ck.set_updates(opt_->updates());
          std::string* p = ck.mutable_params();
          p->resize(sizeof(float) * n);
          load_relaxed(params_.data(), reinterpret_cast<float*>(p->data()), static_cast<int64_t>(n));
          ck.clear_slots();
          for (const auto& [name, slot] : opt_->slots()) {
            std::string* d = ck.add_slots();
            d->resize(sizeof(float) * n);
            load_relaxed(slot, reinterpret_cast<float*>(d->data()), static_cast<int64_t>(n));
          }
        });
        !s.ok())
      return s;
    {
      std::lock_guard<std::mutex> l(mu_);
      ck.set_generation(generation_);
    }
    std::string path;
    try {
      path = write_checkpoint(ck);
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
  Status init_checked(const InitRequest& in, const std::string& from, bool save_start = false) {
    try {
      return init_from(in, from, save_start);
    } catch (const std::exception& e) {
      return {StatusCode::INVALID_ARGUMENT, fmt::format("{}: cannot initialise from {}: {}", name_,
                                                        from, e.what())};
    }
  }

  // Under mu_: takes the run from an Init (the chief's, or a checkpoint's: from). Everything is
  // built and checked before the shard's state changes.
  // save_start (the chief's Init; under save_mu_ too): the run's start is saved first, as the
  // shard's first checkpoint (decision 78). A shard killed before the chief's first Save then
  // restores it, and the run rolls back to it, rather than failing for a range the shard no
  // longer holds. The Init is a checkpoint's content (the range, its slots, the version and
  // the optimizer's updates). A folder that cannot be written refuses the Init, with nothing
  // changed: the run fails at its start, not at its first Save.
  Status init_from(const InitRequest& in, const std::string& from, bool save_start) {
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
    // Pieces: at most a quarter of the message limit each, and at most 2^20 of them.
    const int64_t piece = run.piece_floats() > 0 ? run.piece_floats() : kDefaultPieceFloats;
    if (run.piece_floats() < 0 || piece > kMaxMessageBytes / 16 ||
        (range.size() + piece - 1) / piece > (1 << 20))
      return {StatusCode::INVALID_ARGUMENT,
              fmt::format("{}: pieces of {} floats for a range of {} (at most {} floats a piece, "
                          "and 2^20 pieces)", name_, run.piece_floats(), range.size(),
                          kMaxMessageBytes / 16)};
    if (req->updates() < 0 || req->version() < 0 || run.workers() > 4096)
      return {StatusCode::INVALID_ARGUMENT,
              fmt::format("{}: version {}, {} updates, {} workers: out of range", name_,
                          req->version(), req->updates(), run.workers())};
    opt->load_state({{"name", oc.name}, {"updates", req->updates()}});
    if (save_start && !o_.checkpoint_dir.empty()) {
      try {
        say(fmt::format("saved version {} to {} (the run's start)", req->version(),
                        write_checkpoint(*req)));
      } catch (const std::exception& e) {
        return {StatusCode::INTERNAL, fmt::format("{}: {}", name_, e.what())};
      }
    }
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
    piece_ = piece;
    pieces_ = static_cast<int>((range.size() + piece_ - 1) / piece_);
    grads_.clear();
    if (run.mode() == "sync")
      for (int i = 0; i < w; ++i) grads_.emplace_back(range.size());
    got_.assign(run.mode() == "sync" ? w : 0, std::vector<char>(pieces_, 0));
    claimed_.assign(pieces_, 0);
    copied_.assign(pieces_, 0);
    started_ = finished_ = copying_ = 0;
    undo_ = run.mode() == "sync" && k_ == w && w > 1;
    applied_.assign(undo_ ? pieces_ : 0, 0);
    kept_.assign(undo_ ? pieces_ : 0, 0);
    kept_round_ = -1;
    undo_kept_.clear();
    undo_pairs_.clear();
    if (undo_) {
      undo_pairs_.emplace_back(params_.data(), undo_kept_.emplace_back(range.size()).data());
      for (const std::string& name : opt_->slot_names())
        undo_pairs_.emplace_back(opt_->slot(name), undo_kept_.emplace_back(range.size()).data());
    }
    taken_back_ = -1;
    round_updates_ = opt_->updates();
    arrived_.assign(w, 0);
    waiting_.assign(w, 0);
    inflight_.assign(w, 0);
    deferred_.clear();
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
    lending_.store(run.mode() == "sync" && k_ == w);
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

  // The stripes of one striped push (wire.h, kStripeKey): the PushStreams that carry its
  // pieces. Each stripe's messages are taken as a push's are; the stripe that ends last ends
  // the push (push_end), the others reply `partial` (decision 68).
  struct PushGroup {
    PushRequest head;          // the first stripe's small fields
    HostBuffer grads;          // async and ssp: the gradient, as the stripes' pieces arrive
    std::vector<char> joined;  // [stripe]
    int ended = 0;             // stripes whose streams are over (taken whole, or failed)
    bool late = false;         // sync: a stripe saw the round applied without it
    Status error;              // the first stripe's failure: the push fails with it
    std::chrono::system_clock::time_point deadline;  // the first stripe's: then it is dropped
    std::once_flag allocated;  // grads, by the first stripe to need it (outside groups_mu_)
  };

  // One push in progress (a Push, or the messages of a PushStream so far; a stripe's).
  struct PushCall {
    ServerContextBase* ctx = nullptr;
    PushRequest head;      // the first message's small fields
    bool started = false;
    bool late = false;     // sync: a gradient of a round applied without it (dropped)
    int64_t next = 0;      // where the next message's floats must start
    int64_t end = 0;       // where the call's floats end (the range's size, or its stripe's end)
    HostBuffer grads;      // async and ssp: the gradient, as its pieces arrive
    bool stream = false;   // a PushStream's or a session's (only those may be a stripe)
    bool session = false;  // a push on a PushSession: its stripe and deadline are its messages'
    std::chrono::system_clock::time_point deadline;  // the answer's (set by the first message)
    std::chrono::system_clock::time_point arrived;   // a session's: its first message's arrival
    std::shared_ptr<PushGroup> group;  // a stripe's push
    Stripe stripe;
    float* buffer() { return group ? group->grads.data() : grads.data(); }
    Asker asker() const { return {ctx, deadline}; }
  };

  // ---- Push and Pull: the floats travel as raw slices (wire.h), whole or in pieces ----

  grpc::ServerUnaryReactor* Push(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* in,
                                 grpc::ByteBuffer* out) override {
    grpc::ServerUnaryReactor* r = ctx->DefaultReactor();
    serve(r, [=, this] {
      PushRequest req;
      Bulk grads;
      std::string error;
      if (!decode(*in, PushRequest::kGradsFieldNumber, req, grads, &error))
        return Status(StatusCode::INVALID_ARGUMENT, fmt::format("{}: Push: {}", name_, error));
      // Whole, or refused before any of it is taken.
      const size_t bytes = sizeof(float) * static_cast<size_t>(range_.size());
      if (initialized() && !req.skip() && grads.size() != bytes)
        return Status(StatusCode::INVALID_ARGUMENT,
                      fmt::format("{}: a gradient of {} bytes from worker {}; the range [{}, {}) is "
                                  "{} bytes: refused, not applied", name_, grads.size(),
                                  req.worker(), range_.begin, range_.end, bytes));
      PushCall call;
      call.ctx = ctx;
      if (Status s = push_message(call, req, grads); !s.ok()) return s;
      PushReply rep;
      Status s = push_end(call, rep);
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
      return pull(ctx, req, *out);
    });
    return r;
  }

  // The messages of a push's stream (PushStream, PushSession) received and not yet taken, in
  // order. gRPC's thread parses a message's small fields, queues it here and asks for the
  // next one while less than kAhead bytes wait to be taken (decision 66). A message that does
  // not parse is refused in its turn, after the ones before it; nothing after it is read.
  // Guarded by its reader's mutex.
  struct Received {
    static constexpr size_t kAhead = 8 << 20;  // bytes received and not yet taken, at most
    struct Message {
      PushRequest head;
      Bulk grads;
      Status refusal;  // not OK: a message that did not parse
      std::chrono::system_clock::time_point arrived = std::chrono::system_clock::now();
    };
    std::deque<Message> queue;
    size_t bytes = 0;     // their floats'
    bool paused = false;  // no read is asked for until the taking has caught up
    // Queues the message read into `in` (cleared: its floats live on in its Bulk's slices);
    // whether to read the next one now.
    bool add(ShardService* shard, grpc::ByteBuffer& in, const char* method) {
      Message m;
      m.refusal = shard->guarded([&] {
        std::string error;
        return decode(in, PushRequest::kGradsFieldNumber, m.head, m.grads, &error)
                   ? Status::OK
                   : Status(StatusCode::INVALID_ARGUMENT,
                            fmt::format("{}: {}: {}", shard->name_, method, error));
      });
      bool read_on = m.refusal.ok();
      bytes += m.grads.size();
      queue.push_back(std::move(m));
      if (read_on && bytes >= kAhead) {
        read_on = false;
        paused = true;
      }
      in.Clear();
      return read_on;
    }
    // The first message; *resume: the reads stopped for the queue, and go on now.
    Message pop(bool* resume) {
      Message m = std::move(queue.front());
      queue.pop_front();
      bytes -= m.grads.size();
      *resume = paused && bytes < kAhead;
      if (*resume) paused = false;
      return m;
    }
  };

  // PushStream: every message is taken as it arrives (push_message: in sync mode each piece is
  // copied into the worker's round buffer, and applied at once when it completes the piece
  // across the workers), so the shard's work overlaps the wire; the end of the stream is the
  // push's end (push_end: it may wait at the barrier). gRPC's thread only parses a message's
  // small fields, queues it and asks for the next one, while less than kAhead bytes wait to
  // be taken; the messages are taken in order by one task at a time on a thread of threads_,
  // which then ends the push (decision 66): the stream's window is given back as soon as a
  // piece is received, not after it has been applied.
  class PushReader final : public grpc::ServerReadReactor<grpc::ByteBuffer> {
   public:
    PushReader(ShardService* shard, grpc::CallbackServerContext* ctx, grpc::ByteBuffer* reply)
        : shard_(shard), reply_(reply) {
      call_.ctx = ctx;
      call_.stream = true;
      StartRead(&in_);
    }
    void OnReadDone(bool ok) override {
      bool read_on = false, start = false;
      {
        std::lock_guard<std::mutex> l(mu_);
        if (finishing_) return;  // a read that was under way when the push was refused
        if (!ok) {
          ended_ = true;  // the client has sent everything, or has gone
        } else {
          read_on = received_.add(shard_, in_, "PushStream");
        }
        start = !busy_;
        busy_ = true;
      }
      if (start) start_taking();
      if (read_on) StartRead(&in_);
    }
    void OnDone() override { delete this; }

   private:
    void start_taking() {
      try {
        shard_->threads_.run([this] { take(); });
      } catch (const std::exception& e) {  // no thread to take them: the push fails
        {
          std::lock_guard<std::mutex> l(mu_);
          finishing_ = true;
        }
        Finish(Status(StatusCode::INTERNAL, fmt::format("{}: {}", shard_->name_, e.what())));
      }
    }
    // The queued messages in order, then (the stream ended, or a message was refused) the
    // push's end; the reactor finishes here, once.
    void take() {
      std::unique_lock<std::mutex> l(mu_);
      for (;;) {
        if (error_.ok() && !received_.queue.empty()) {
          bool resume = false;
          Received::Message m = received_.pop(&resume);
          l.unlock();
          if (resume) StartRead(&in_);
          const Status s =
              m.refusal.ok()
                  ? shard_->guarded([&] { return shard_->push_message(call_, m.head, m.grads); })
                  : m.refusal;
          l.lock();
          if (!s.ok() && error_.ok()) error_ = s;
          continue;
        }
        if (error_.ok() && !ended_) {
          busy_ = false;  // the next message starts the next task
          return;
        }
        received_.queue.clear();  // after a refusal: not taken
        finishing_ = true;
        break;
      }
      Status s = error_;
      l.unlock();
      if (s.ok())
        s = shard_->guarded([&] {
          if (call_.ctx->IsCancelled())
            return Status(StatusCode::CANCELLED,
                          fmt::format("{}: PushStream cancelled", shard_->name_));
          PushReply rep;
          const Status end = shard_->push_end(call_, rep);
          if (end.ok()) *reply_ = encode(rep);
          return end;
        });
      if (!s.ok()) shard_->stripe_failed(call_, s);  // a stripe's failure fails its push
      Finish(s);
    }

    ShardService* shard_;
    grpc::ByteBuffer* reply_;
    grpc::ByteBuffer in_;  // read into by one read at a time; cleared under mu_
    PushCall call_;        // take()'s task only
    std::mutex mu_;
    Received received_;        // under mu_
    Status error_;             // the first refusal, in the stream's order: the push ends with it
    bool busy_ = false;        // a take() task is queued or running
    bool ended_ = false;       // no message will follow
    bool finishing_ = false;   // Finish is called, or about to be
  };

  grpc::ServerReadReactor<grpc::ByteBuffer>* PushStream(grpc::CallbackServerContext* ctx,
                                                        grpc::ByteBuffer* reply) override {
    return new PushReader(this, ctx, reply);
  }

  // PushSession: a worker's pushes one after another on one stream (decision 75). Each push's
  // messages are taken as a PushStream's are (in order, by one task at a time on a thread of
  // threads_, while gRPC's thread reads on), its message with `ends` ends it (push_end: it may
  // wait at the barrier), and its reply is written on the stream. The first refusal or failure
  // ends the session with its status, as it would end the push's PushStream; the worker opens
  // another for its next push. The session ends with OK when the worker closes it between
  // pushes, and the shard ends its sessions when it exits (end_sessions).
  class SessionReader final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
   public:
    SessionReader(ShardService* shard, grpc::CallbackServerContext* ctx)
        : shard_(shard), ctx_(ctx) {
      new_push();
      shard_->add_session(ctx_);
      StartRead(&in_);
    }
    void OnReadDone(bool ok) override {
      bool read_on = false, start = false;
      {
        std::lock_guard<std::mutex> l(mu_);
        if (finishing_) return;
        if (!ok) {
          ended_ = true;  // the worker closed the session, or has gone
        } else {
          read_on = received_.add(shard_, in_, "PushSession");
        }
        start = !busy_;
        busy_ = true;
      }
      if (start) start_taking();
      if (read_on) StartRead(&in_);
    }
    void OnWriteDone(bool) override {
      // (A write that fails: the worker has gone, and the next read fails too.)
      bool finish = false;
      grpc::ByteBuffer* next = nullptr;
      {
        std::lock_guard<std::mutex> l(mu_);
        replies_.pop_front();
        if (!replies_.empty())
          next = &replies_.front();
        else
          finish = finish_due_;
      }
      if (next != nullptr) StartWrite(next);
      if (finish) Finish(status_);
    }
    void OnDone() override {
      shard_->drop_session(ctx_);
      delete this;
    }

   private:
    void new_push() {
      call_ = PushCall();
      call_.ctx = ctx_;
      call_.stream = true;
      call_.session = true;
    }
    void start_taking() {
      try {
        shard_->threads_.run([this] { take(); });
      } catch (const std::exception& e) {
        {
          std::lock_guard<std::mutex> l(mu_);
          finishing_ = true;
        }
        finish(Status(StatusCode::INTERNAL, fmt::format("{}: {}", shard_->name_, e.what())));
      }
    }
    // The queued messages in order: each push's end and reply after its last message; then
    // (the session closed, or a push failed) the session's end, here, once.
    void take() {
      std::unique_lock<std::mutex> l(mu_);
      for (;;) {
        if (error_.ok() && !received_.queue.empty()) {
          bool resume = false;
          Received::Message m = received_.pop(&resume);
          l.unlock();
          if (resume) StartRead(&in_);
          const bool first = !call_.started;
          if (first) call_.arrived = m.arrived;  // (the push's time counts from it)
          Status s =
              m.refusal.ok()
                  ? shard_->guarded([&] { return shard_->push_message(call_, m.head, m.grads); })
                  : m.refusal;
          if (s.ok() && first && call_.started)
            shard_->session_call(ctx_, ++calls_, call_.deadline,
                                 fmt::format("worker {}'s push of round {}", call_.head.worker(),
                                             call_.head.round()));
          grpc::ByteBuffer reply;
          if (s.ok() && m.head.ends())
            s = shard_->guarded([&] {
              if (ctx_->IsCancelled())
                return Status(StatusCode::CANCELLED,
                              fmt::format("{}: PushSession cancelled", shard_->name_));
              PushReply rep;
              const Status end = shard_->push_end(call_, rep);
              if (end.ok()) reply = encode(rep);
              return end;
            });
          if (!s.ok()) shard_->stripe_failed(call_, s);  // a stripe's failure fails its push
          if (s.ok() && m.head.ends()) shard_->session_call_over(ctx_, calls_);
          l.lock();
          if (!s.ok()) {
            if (error_.ok()) error_ = s;
          } else if (m.head.ends()) {
            new_push();
            replies_.push_back(std::move(reply));
            if (replies_.size() == 1) {                   // no write under way: this one starts now
              grpc::ByteBuffer* out = &replies_.front();  // (stays put until written)
              l.unlock();
              StartWrite(out);
              l.lock();
            }
          }
          continue;
        }
        if (error_.ok() && !ended_) {
          busy_ = false;
          return;
        }
        received_.queue.clear();
        finishing_ = true;
        break;
      }
      Status s = error_;
      const bool inside = call_.started;
      l.unlock();
      if (s.ok() && inside)  // closed (or gone) in the middle of a push
        s = shard_->stripe_failed(
            call_, {ctx_->IsCancelled() ? StatusCode::CANCELLED : StatusCode::INVALID_ARGUMENT,
                    fmt::format("{}: worker {}'s PushSession ended inside its push of round {}",
                                shard_->name_, call_.head.worker(), call_.head.round())});
      finish(s);
    }
    // Finishes the session once its replies are written.
    void finish(Status s) {
      {
        std::lock_guard<std::mutex> l(mu_);
        status_ = std::move(s);
        if (!replies_.empty()) {
          finish_due_ = true;
          return;
        }
      }
      Finish(status_);
    }

    ShardService* shard_;
    grpc::CallbackServerContext* ctx_;
    grpc::ByteBuffer in_;
    PushCall call_;       // the push in progress: take()'s task only
    uint64_t calls_ = 0;  // pushes begun on the session (take()'s task only)
    std::mutex mu_;
    Received received_;                     // under mu_
    std::deque<grpc::ByteBuffer> replies_;  // the front one is being written
    Status error_;
    Status status_;  // the session's, once it is finishing
    bool busy_ = false;
    bool ended_ = false;
    bool finishing_ = false;
    bool finish_due_ = false;  // Finish once the replies are written
  };

  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* PushSession(
      grpc::CallbackServerContext* ctx) override {
    return new SessionReader(this, ctx);
  }

  // The shard exits: every session ends, rather than holding the server's shutdown until its
  // grace runs out. (A push under way on one ends CANCELLED by the shard; the worker counts
  // that as the shard being unavailable, as it counts a PushStream's end by a shard that
  // exits, and calls again until its deadline.)
  void add_session(grpc::CallbackServerContext* c) {
    std::lock_guard<std::mutex> l(sessions_mu_);
    sessions_.emplace(c, SessionCall());
  }
  void drop_session(grpc::CallbackServerContext* c) {
    std::lock_guard<std::mutex> l(sessions_mu_);
    sessions_.erase(c);
  }
  void end_sessions() {
    std::lock_guard<std::mutex> l(sessions_mu_);
    for (auto& [c, call] : sessions_) c->TryCancel();  // (a read under way fails)
  }

  // A call on a session (a push, from its first message until its end; a pull, from its
  // request until its last piece is written) keeps its own deadline (decision 76). The worker
  // gives it up a second after that deadline; a worker that cannot (a stopped process, a
  // network path gone silent) would leave it open for as long as its connection lasts: a
  // session's pull in plain sync holding the lent parameters, a push holding its round's
  // partial state. The watchdog (watch) ends such a session kSessionOverdue after the call's
  // deadline, as gRPC ends a PushStream or PullStream call at its own.
  static constexpr std::chrono::seconds kSessionOverdue{3};
  // Session c's call number `call` (its calls so far) is under way until `deadline`; what:
  // it, for the shard's log line should it be overdue.
  void session_call(grpc::CallbackServerContext* c, uint64_t call,
                    std::chrono::system_clock::time_point deadline, std::string what) {
    std::lock_guard<std::mutex> l(sessions_mu_);
    const auto it = sessions_.find(c);
    if (it != sessions_.end()) it->second = {call, deadline + kSessionOverdue, std::move(what)};
  }
  // Session c's call number `call` is over (unless a later one has started: it stays due).
  void session_call_over(grpc::CallbackServerContext* c, uint64_t call) {
    std::lock_guard<std::mutex> l(sessions_mu_);
    const auto it = sessions_.find(c);
    if (it != sessions_.end() && it->second.call == call) it->second.due = SessionCall::never();
  }
  // Ends the sessions whose call is overdue, saying so. (Not under mu_: a cancel lets go of
  // the lent pieces of a pull, which takes it. Under sessions_mu_, as in end_sessions, so that
  // no session's call is gone while it is cancelled: gRPC runs the reactions that a cancel
  // brings about, OnDone's drop_session among them, on its own threads, not inside TryCancel.)
  void end_overdue_sessions() {
    const auto now = std::chrono::system_clock::now();
    std::vector<std::string> ended;
    {
      std::lock_guard<std::mutex> l(sessions_mu_);
      for (auto& [c, call] : sessions_) {
        if (call.due > now) continue;
        call.due = SessionCall::never();
        c->TryCancel();
        ended.push_back(std::move(call.what));
      }
    }
    for (const std::string& what : ended)
      say(
          fmt::format("{} on a session was not over {} s after its deadline: the session is "
                      "ended (the worker stopped taking part in it)",
                      what, kSessionOverdue.count()));
  }

  // The messages of a PullStream, written one at a time as gRPC takes them, while the thread
  // that serves the pull (gRPC's, or one of threads_ that may copy them) offers the next pieces
  // (offer) and then ends the stream (close).
  // Where a pull's pieces go (serve_pull): a PullStream's writer, or a PullSession's.
  struct PieceSink {
    virtual ~PieceSink() = default;
    // Queues a message; false once the client has gone (stop offering).
    virtual bool offer(grpc::ByteBuffer b) = 0;
    // The pull is over (s: how), once the queued messages are written.
    virtual void close(Status s) = 0;
    // A session's pull: it is due by `deadline` (what: it).
    virtual void due(std::chrono::system_clock::time_point /*deadline*/, std::string /*what*/) {}
  };
  // A reactor's writes of the pieces offered to it, one at a time, in order.
  template <class Reactor>
  class QueuedPieces : public Reactor, public PieceSink {
   public:
    bool offer(grpc::ByteBuffer b) override {
      std::unique_lock<std::mutex> l(mu_);
      if (broken_) return false;
      queue_.push_back(std::move(b));
      if (writing_) return true;
      writing_ = true;
      current_ = std::move(queue_.front());
      queue_.pop_front();
      l.unlock();
      this->StartWrite(&current_);
      return true;
    }
    void OnWriteDone(bool ok) override {
      std::unique_lock<std::mutex> l(mu_);
      if (!ok) {
        broken_ = true;
        queue_.clear();
      }
      if (!queue_.empty()) {
        current_ = std::move(queue_.front());
        queue_.pop_front();
        l.unlock();
        this->StartWrite(&current_);
        return;
      }
      writing_ = false;
      current_.Clear();  // let go of the last piece (a lent one ends a hold)
      if (!closed_) {
        written(l);
        return;
      }
      l.unlock();
      this->Finish(status_);
    }

   protected:
    // Under mu_ (l, which it unlocks): every piece offered so far is written, and the call goes
    // on.
    virtual void written(std::unique_lock<std::mutex>& l) { l.unlock(); }
    // Under mu_ (l): the call ends with s (CANCELLED if the client went away) once the queued
    // pieces are written.
    void finish_after_writes(std::unique_lock<std::mutex>& l, Status s) {
      closed_ = true;
      status_ = broken_ ? Status(StatusCode::CANCELLED, "the client went away") : std::move(s);
      if (writing_) return;
      l.unlock();
      this->Finish(status_);
    }
    std::mutex mu_;
    std::deque<grpc::ByteBuffer> queue_;
    grpc::ByteBuffer current_;
    bool writing_ = false, closed_ = false, broken_ = false;
    Status status_;
  };

  // A PullStream's pieces: the stream ends with the pull.
  class PieceWriter final : public QueuedPieces<grpc::ServerWriteReactor<grpc::ByteBuffer>> {
   public:
    void close(Status s) override {
      std::unique_lock<std::mutex> l(mu_);
      finish_after_writes(l, std::move(s));
    }
    void OnDone() override { delete this; }
  };

  // PullSession: a worker's pulls one after another on one stream (decision 75). Each request
  // is served as a PullStream's is (serve_pull, on a thread of threads_) and its pieces are
  // written on the stream; the next request is read once the pull has offered its last piece
  // (the worker knows a pull's end by its floats). A refused or failed pull ends the session
  // with its status; the worker's closing it between pulls ends it with OK.
  class PullSessionWriter final
      : public QueuedPieces<grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>> {
   public:
    PullSessionWriter(ShardService* shard, grpc::CallbackServerContext* ctx)
        : shard_(shard), ctx_(ctx) {
      shard_->add_session(ctx_);
      StartRead(&in_);
    }
    void OnReadDone(bool ok) override {
      if (!ok) {  // closed between pulls, or gone (no read is asked for during a pull)
        std::unique_lock<std::mutex> l(mu_);
        finish_after_writes(l, Status::OK);
        return;
      }
      const auto arrived = std::chrono::system_clock::now();
      ++calls_;
      try {
        shard_->threads_.run(
            [this, arrived] { shard_->serve_pull(ctx_, &in_, this, false, true, arrived); });
      } catch (const std::exception& e) {  // no thread to serve it: the session fails
        close(Status(StatusCode::INTERNAL, fmt::format("{}: {}", shard_->name_, e.what())));
      }
    }
    void close(Status s) override {
      std::unique_lock<std::mutex> l(mu_);
      if (!s.ok() || broken_) {
        finish_after_writes(l, std::move(s));
        return;
      }
      // The pull is over once its last piece is written.
      uint64_t over = 0;
      if (writing_)
        over_when_written_ = calls_;
      else
        over = calls_;
      l.unlock();
      if (over != 0) shard_->session_call_over(ctx_, over);
      in_.Clear();
      StartRead(&in_);  // the next pull's request
    }
    void due(std::chrono::system_clock::time_point deadline, std::string what) override {
      shard_->session_call(ctx_, calls_, deadline, std::move(what));
    }
    void OnDone() override {
      shard_->drop_session(ctx_);
      delete this;
    }

   private:
    void written(std::unique_lock<std::mutex>& l) override {
      // (Taken under the lock that saw the last write end: a later pull's close cannot have
      // stored its own number here yet.)
      const uint64_t over = std::exchange(over_when_written_, 0);
      l.unlock();
      if (over != 0) shard_->session_call_over(ctx_, over);
    }

    ShardService* shard_;
    grpc::CallbackServerContext* ctx_;
    grpc::ByteBuffer in_;  // the request being read or served
    uint64_t calls_ = 0;   // pulls so far (the one being served: the last)
    uint64_t over_when_written_ = 0;  // under mu_: a pull that is over once its pieces are written
  };

  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* PullSession(
      grpc::CallbackServerContext* ctx) override {
    return new PullSessionWriter(this, ctx);
  }

  // PullStream: the range in pieces, at one version. A worker's pull in plain sync: the
  // parameters themselves, lent to gRPC without a copy, held between rounds until gRPC lets go
  // of them. Other sync pulls: copies taken between rounds. async and ssp: each piece copied
  // (racing with the updates, as Hogwild reads) and handed to gRPC at once, while the next is
  // copied. A pull that lends the parameters and need not wait is served at once, on gRPC's
  // thread: a hand-off to a thread of threads_ costs a wake-up before the first byte is sent
  // (about a tenth of a 4 MiB pull on a 2-core machine); the others are handed off.
  grpc::ServerWriteReactor<grpc::ByteBuffer>* PullStream(grpc::CallbackServerContext* ctx,
                                                         const grpc::ByteBuffer* in) override {
    auto* w = new PieceWriter;
    if (!serve_pull(ctx, in, w, true)) threads_.run([=, this] { serve_pull(ctx, in, w, false); });
    return w;
  }

  // Serves a PullStream on w. on_grpc_thread: only where nothing waits and nothing is copied;
  // otherwise returns false, having sent nothing.
  // session: a PullSession's pull (arrived: when its request did), whose stripe and deadline
  // are in its request.
  bool serve_pull(grpc::CallbackServerContext* call, const grpc::ByteBuffer* in, PieceSink* w,
                  bool on_grpc_thread, bool session = false,
                  std::chrono::system_clock::time_point arrived = {}) {
    bool would_wait = false;
    bool* const may_not_wait = on_grpc_thread ? &would_wait : nullptr;
    const char* method = session ? "PullSession" : "PullStream";
    Asker ctx(call);
    Status s;
    try {
      PullRequest req;
      std::string error;
      if (!decode(*in, req, &error))
        s = Status(StatusCode::INVALID_ARGUMENT, fmt::format("{}: {}: {}", name_, method, error));
      else if (req.with_slots())
        s = Status(StatusCode::INVALID_ARGUMENT,
                   fmt::format("{}: {} carries no optimizer slots (Pull does)", name_, method));
      else if (session) {
        const std::string what = fmt::format("worker {}'s pull", req.worker());
        s = session_deadline(req.timeout_ms(), arrived, what, &ctx.deadline);
        if (s.ok()) w->due(ctx.deadline, what);
      } else if (on_grpc_thread && !(lending_.load() && req.worker() >= 0))
        return false;  // a pull that copies: to a thread of threads_ before anything is done
      if (s.ok()) s = pull_ready(ctx, req, may_not_wait);
      // A stripe of a striped pull: floats [a, b) of the range only.
      int64_t a = 0, b = 0;
      if (s.ok() && !would_wait) s = pull_stripe(call, req, session, &a, &b);
      // A worker's pull in plain sync: the parameters themselves, lent to gRPC, held (no round
      // applies) until it has let go of every piece. (Readers get copies, so that a reader
      // cannot hold up the run; so do backup-worker runs, whose rounds apply whole.)
      const bool lends = s.ok() && lending_.load() && req.worker() >= 0;
      if (would_wait || (on_grpc_thread && s.ok() && !lends)) return false;
      if (lends) {
        int64_t v = 0;
        s = hold_params(ctx, &v, may_not_wait);
        if (would_wait) return false;
        if (s.ok()) {
          struct Hold {  // this loop's own share of the lease, however the loop ends
            Lease* lease;
            ~Hold() { Lease::returned(lease); }
          } hold{new Lease{this}};
          send_pieces(w, v, a, b, [&](int64_t lo, int64_t hi) {
            hold.lease->out.fetch_add(1);
            return grpc::Slice(params_.data() + lo, sizeof(float) * static_cast<size_t>(hi - lo),
                               &Lease::returned, hold.lease);
          });
        }
      } else if (s.ok() && run_.mode() == "sync") {
        // Copies, taken at one version between rounds, then sent.
        std::vector<grpc::Slice> pieces;
        int64_t v = 0;
        s = read_params(ctx, [&] {
          v = version_.load();
          for_each_piece(a, b, piece_, [&](int64_t lo, int64_t hi) {
            pieces.push_back(copied_piece(lo, hi));
            return true;
          });
        });
        if (s.ok()) {
          size_t i = 0;
          send_pieces(w, v, a, b, [&](int64_t, int64_t) { return pieces[i++]; });
        }
      } else if (s.ok()) {
        send_pieces(w, version_.load(), a, b,
                    [&](int64_t lo, int64_t hi) { return copied_piece(lo, hi); });
      }
    } catch (const std::exception& e) {
      s = Status(StatusCode::INTERNAL, fmt::format("{}: {}", name_, e.what()));
    }
    w->close(s);
    return true;
  }

  // The stripe a call says it is (its kStripeKey; one stripe of one when it says none), or
  // its refusal, naming the call as `what` says.
  template <class What>
  Status stripe_of(ServerContextBase* ctx, What what, Stripe* st) {
    *st = Stripe();
    const auto& md = ctx->client_metadata();
    const auto it = md.find(kStripeKey);
    if (it == md.end()) return Status::OK;
    std::string error;
    const int64_t pieces = messages_of(range_.size(), piece_);
    if (!parse_stripe(std::string(it->second.data(), it->second.size()), st, &error) ||
        st->s > pieces)
      return {StatusCode::INVALID_ARGUMENT,
              fmt::format("{}: {}: metadata '{}': {}: refused", name_, what(), kStripeKey,
                          !error.empty() ? error
                                         : fmt::format("{} stripes of a range of {} piece(s)",
                                                       st->s, pieces))};
    return Status::OK;
  }

  // The stripe a call on a session (PushSession, PullSession: pull) says it is in its messages:
  // stripe k of s (s 0: one stripe of one) of push `id`; or the refusal of one that is not a
  // stripe of the range, or of a session that also says a stripe in its metadata (kStripeKey),
  // naming the call as `what` says.
  template <class What>
  Status session_stripe(ServerContextBase* ctx, bool pull, uint64_t id, int k, int s, What what,
                        Stripe* st) {
    if (ctx->client_metadata().count(kStripeKey) != 0)
      return {StatusCode::INVALID_ARGUMENT,
              fmt::format("{}: a {} with metadata '{}': a session's {} say their stripes in "
                          "their {}: refused",
                          name_, pull ? "PullSession" : "PushSession", kStripeKey,
                          pull ? "pulls" : "pushes", pull ? "requests" : "messages")};
    const int64_t pieces = messages_of(range_.size(), piece_);
    *st = Stripe{id, k, std::max(1, s)};
    if (k < 0 || k >= st->s || st->s > kMaxStripes || st->s > pieces)
      return {StatusCode::INVALID_ARGUMENT,
              fmt::format("{}: {}: stripe {} of {} (a range of {} piece(s), at most {} "
                          "stripes): refused",
                          name_, what(), k, s, pieces, kMaxStripes)};
    return Status::OK;
  }

  // A call on a session gives the time its answer is due in (timeout_ms, counted from when it
  // arrived): *deadline becomes the earlier of it and *deadline, or the call named `what` is
  // refused for giving none.
  Status session_deadline(int64_t timeout_ms, std::chrono::system_clock::time_point arrived,
                          const std::string& what,
                          std::chrono::system_clock::time_point* deadline) const {
    if (timeout_ms <= 0)
      return {StatusCode::INVALID_ARGUMENT,
              fmt::format("{}: {} on a session gives no time for its answer (timeout_ms {}): "
                          "refused",
                          name_, what, timeout_ms)};
    // (At most ten years: the deadline and the overdue margin stay within the clock's range.)
    constexpr int64_t kLongest = int64_t{10} * 365 * 24 * 3600 * 1000;
    *deadline =
        std::min(*deadline, arrived + std::chrono::milliseconds(std::min(timeout_ms, kLongest)));
    return Status::OK;
  }

  // Floats [*a, *b) of the range, which a PullStream sends: a stripe's, or the whole range.
  // A pull on a session says its stripe in the request.
  Status pull_stripe(ServerContextBase* ctx, const PullRequest& req, bool session, int64_t* a,
                     int64_t* b) {
    Stripe st;
    auto what = [&] { return fmt::format("worker {}'s pull", req.worker()); };
    const Status s = session ? session_stripe(ctx, true, 0, req.stripe(), req.stripes(), what, &st)
                             : stripe_of(ctx, what, &st);
    if (s.ok()) std::tie(*a, *b) = stripe_floats(range_.size(), piece_, st.k, st.s);
    return s;
  }

  // Floats [a, b) of the range in pieces on w, each the slice slice_of(lo, hi) of floats
  // [lo, hi), at version v; stops early once the client has gone.
  template <class SliceOf>
  void send_pieces(PieceSink* w, int64_t v, int64_t a, int64_t b, SliceOf slice_of) {
    for_each_piece(a, b, piece_, [&](int64_t lo, int64_t hi) {
      const grpc::Slice piece = slice_of(lo, hi);
      PullReply head;
      head.set_version(v);
      head.set_offset(lo);
      return w->offer(encode(head, PullReply::kParamsFieldNumber, &piece));
    });
  }

  // Floats [lo, hi) of the parameters, copied (copy_params) into a slice of their own.
  grpc::Slice copied_piece(int64_t lo, int64_t hi) {
    OwnedSlice piece = owned_slice(sizeof(float) * static_cast<size_t>(hi - lo));
    copy_params(lo, hi, reinterpret_cast<float*>(piece.data));
    return std::move(piece.slice);
  }

  // A hold on the parameters (hold_params) shared by the slices of them lent to gRPC, and
  // released when the last one is let go.
  struct Lease {
    ShardService* shard;
    std::atomic<int> out{1};
    static void returned(void* self) {
      auto* l = static_cast<Lease*>(self);
      if (l->out.fetch_sub(1) != 1) return;
      l->shard->release_params();
      delete l;
    }
  };

  // call()'s status; an exception is the call's error (INTERNAL), not the shard's end.
  template <class Call>
  Status guarded(Call&& call) {
    try {
      return call();
    } catch (const std::exception& e) {
      return {StatusCode::INTERNAL, fmt::format("{}: {}", name_, e.what())};
    }
  }

  // Runs call() on a thread of threads_ and finishes the reactor with its status.
  template <class Call>
  void serve(grpc::ServerUnaryReactor* r, Call call) {
    threads_.run([r, call = std::move(call), this] { r->Finish(guarded(call)); });
  }

  bool initialized() {
    std::lock_guard<std::mutex> l(mu_);
    return initialized_;
  }

  // One message of a push. The first is checked as a call (token, layout, worker); the others
  // must repeat its small fields. Each must carry whole pieces of the range, in order after the
  // previous message's, and nothing beyond the range: a message that does not is refused
  // before any of it is taken.
  Status push_message(PushCall& c, const PushRequest& m, const Bulk& grads) {
    if (!c.started) {
      c.deadline = c.ctx->deadline();
      if (c.session)
        if (Status s = session_deadline(
                m.timeout_ms(), c.arrived,
                fmt::format("worker {}'s push of round {}", m.worker(), m.round()), &c.deadline);
            !s.ok())
          return s;
      if (Status s = authorize(c.ctx); !s.ok()) return s;
      if (Status s = check_worker(m.layout_hash(), m.worker()); !s.ok()) return s;
      if (Status s = admit(c.asker(), m.generation()); !s.ok()) return s;
      c.head = m;
      c.head.clear_offset();
      c.started = true;
      c.end = range_.size();
      if (Status s = join_stripes(c); !s.ok()) return s;
      if (run_.mode() != "sync" && !m.skip() && !c.group) c.grads = HostBuffer(range_.size());
    } else if (m.worker() != c.head.worker() || m.round() != c.head.round() ||
               m.skip() != c.head.skip() || m.layout_hash() != c.head.layout_hash() ||
               m.generation() != c.head.generation() || m.push() != c.head.push() ||
               m.stripe() != c.head.stripe() || m.stripes() != c.head.stripes()) {
      return {StatusCode::INVALID_ARGUMENT,
              fmt::format("{}: a PushStream message of worker {}, round {} inside a push of worker "
                          "{}, round {}: refused", name_, m.worker(), m.round(), c.head.worker(),
                          c.head.round())};
    }
    const int64_t n = range_.size();
    if (m.skip()) {
      if (grads.size() > 0)
        return {StatusCode::INVALID_ARGUMENT,
                fmt::format("{}: a push of worker {} that skips its round carries a gradient: "
                            "refused", name_, m.worker())};
      return Status::OK;
    }
    const int64_t floats = static_cast<int64_t>(grads.size() / sizeof(float));
    const bool fits =
        m.offset() == c.next && grads.size() % sizeof(float) == 0 && floats <= c.end - c.next;
    const int64_t end = fits ? c.next + floats : 0;
    if (!fits || (end != n && end % piece_ != 0))
      return {StatusCode::INVALID_ARGUMENT,
              fmt::format(
                  "{}: worker {} sent {} bytes at float {} of round {}'s gradient; the "
                  "range [{}, {}) is {} floats, sent in pieces of {} from float {}{}: "
                  "refused, not applied",
                  name_, m.worker(), grads.size(), m.offset(), m.round(), range_.begin, range_.end,
                  n, piece_, c.next,
                  c.group ? fmt::format(" to {} (stripe {} of {})", c.end, c.stripe.k, c.stripe.s)
                          : "")};
    for (int64_t lo = c.next; lo < end; lo += piece_)
      if (Status s = take_piece(c, grads, sizeof(float) * static_cast<size_t>(lo - c.next), lo,
                                std::min(lo + piece_, end));
          !s.ok())
        return s;
    c.next = end;
    return Status::OK;
  }

  // Floats [lo, hi) of the range, at byte `at` of `grads`. async and ssp: into the call's
  // buffer. sync: into the worker's round buffer; in plain sync (every worker's gradient in
  // every round), the worker that completes a piece applies it: the piece's sum over the
  // workers in rank order, by the fixed tree, then the optimizer on the piece.
  Status take_piece(PushCall& c, const Bulk& grads, size_t at, int64_t lo, int64_t hi) {
    const size_t bytes = sizeof(float) * static_cast<size_t>(hi - lo);
    if (run_.mode() != "sync") {
      grads.copy_range(c.buffer() + lo, at, bytes);
      return Status::OK;
    }
    const int w = c.head.worker();
    const int64_t round = c.head.round();
    const size_t piece = static_cast<size_t>(lo / piece_);
    const bool plain = k_ == workers();  // every worker's gradient in every round
    bool completes = false;
    {
      std::unique_lock<std::mutex> l(mu_);
      if (c.head.generation() < generation_) return stale(c.head.generation());
      const int64_t v = version_.load();
      if (c.late || round < v) {
        c.late = true;
        return Status::OK;
      }
      if (round > v) return round_ahead(w, round, v);
      if (round == taken_back_) return taken_back();
      if (arrived_[w] || got_[w][piece]) return Status::OK;  // retried: this piece is here
      got_[w][piece] = 1;  // claimed, then copied (or applied) without the lock
      completes = plain && ++claimed_[piece] == k_;
      if (!completes) {
        ++inflight_[w];
      } else {
        // The other workers' copies of the piece are done (they are under way, so this wait
        // is short).
        cv_.wait(l, [&] {
          return copied_[piece] == k_ - 1 || c.head.generation() < generation_ ||
                 round == taken_back_;
        });
        if (c.head.generation() < generation_) return stale(c.head.generation());
        if (round == taken_back_) return taken_back();
        begin_piece(c.head.lr());  // from here, readers wait for the round
        if (copying_ > 0) {
          // A worker's pull still holds the parameters (gRPC has not sent all it was lent):
          // the piece is applied once the hold ends (release_params), by the thread that ends
          // it, rather than by a thread waiting here for gRPC to send them.
          deferred_.push_back({w, grads, at, lo, hi});
          return Status::OK;
        }
      }
    }
    if (!completes) {
      grads.copy_range(grads_[w].data() + lo, at, bytes);
      std::lock_guard<std::mutex> l(mu_);
      --inflight_[w];
      cv_.notify_all();
      if (version_.load() != round) {  // applied without this worker (backup workers)
        c.late = true;
        return Status::OK;
      }
      if (plain) ++copied_[piece];
      return Status::OK;
    }
    apply_completed(w, grads, at, lo, hi);
    return Status::OK;
  }

  // Under mu_: a piece of the round is being applied from now on (new readers wait until the
  // round is done; a piece whose apply waits for a reader's hold to end counts too).
  void begin_piece(float lr) {
    if (started_++ == 0) {
      kept_round_ = -1;  // (the values kept of the last round are overwritten from here)
      round_t_ = opt_->begin_pieces();
      round_lr_ = lr;
    }
  }

  // Worker w completed floats [lo, hi) of the round (at byte `at` of `grads`): applies them,
  // chunk by chunk while the chunk is in cache: this worker's floats (one copy out of the
  // received slices), the tree over the workers in rank order, the optimizer.
  void apply_completed(int w, const Bulk& grads, size_t at, int64_t lo, int64_t hi) {
    thread_local std::vector<float> scratch;
    constexpr int64_t kChunk = 1 << 14;
    std::vector<float*> blocks;
    for (HostBuffer& g : grads_) blocks.push_back(g.data());
    for (int64_t a = lo; a < hi; a += kChunk) {
      const int64_t b = std::min(a + kChunk, hi);
      const size_t from = at + sizeof(float) * static_cast<size_t>(a - lo);
      const size_t chunk = sizeof(float) * static_cast<size_t>(b - a);
      const float* g;
      if (blocks.size() == 1) {  // one worker: its floats straight into the update
        scratch.resize(kChunk);
        grads.copy_range(scratch.data(), from, chunk);
        g = scratch.data();
      } else {
        grads.copy_range(grads_[w].data() + a, from, chunk);
        kernels::cpu::tree_sum(blocks.data(), static_cast<int64_t>(blocks.size()), a, b);
        g = blocks[0] + a;
      }
      for (const auto& [from, to] : undo_pairs_)
        std::memcpy(to + a, from + a, sizeof(float) * static_cast<size_t>(b - a));
      opt_->apply_piece(params_.data(), g, a, b, round_lr_, round_t_);
    }
    std::lock_guard<std::mutex> l(mu_);
    ++finished_;
    if (undo_) applied_[static_cast<size_t>(lo / piece_)] = 1;
    complete_round();
  }

  int workers() const { return static_cast<int>(arrived_.size()); }

  // The first message of a PushStream: a stripe of a striped push (its call's kStripeKey)
  // joins the push's group, and is to carry its stripe's floats only.
  Status join_stripes(PushCall& c) {
    const PushRequest& m = c.head;
    if (!c.stream) {
      if (c.ctx->client_metadata().count(kStripeKey) == 0) return Status::OK;
      return {StatusCode::INVALID_ARGUMENT,
              fmt::format("{}: a unary Push of worker {} with metadata '{}': only a PushStream "
                          "is a stripe: refused",
                          name_, m.worker(), kStripeKey)};
    }
    Stripe st;
    auto what = [&] { return fmt::format("worker {}'s push of round {}", m.worker(), m.round()); };
    if (Status s = c.session
                       ? session_stripe(c.ctx, false, m.push(), m.stripe(), m.stripes(), what, &st)
                       : stripe_of(c.ctx, what, &st);
        !s.ok())
      return s;
    if (m.skip() && st.s > 1)
      return {StatusCode::INVALID_ARGUMENT,
              fmt::format("{}: {}: metadata '{}': a push that skips its round is one stream: "
                          "refused",
                          name_, what(), kStripeKey)};
    const int64_t n = range_.size();
    if (st.s == 1) return Status::OK;
    std::tie(c.next, c.end) = stripe_floats(n, piece_, st.k, st.s);
    c.stripe = st;
    std::shared_ptr<PushGroup> joined;
    {
      std::lock_guard<std::mutex> l(groups_mu_);
      // Pushes of which a stripe never came (its attempt failed on the way) are dropped at
      // their deadline, or after an hour for a call without one.
      const auto now = std::chrono::system_clock::now();
      for (auto g = groups_.begin(); g != groups_.end();)
        g = g->second->deadline < now ? groups_.erase(g) : std::next(g);
      std::shared_ptr<PushGroup>& g = groups_[{m.worker(), st.push}];
      if (!g) {
        g = std::make_shared<PushGroup>();
        g->head = m;
        g->joined.assign(st.s, 0);
        g->deadline = std::min(c.deadline, now + std::chrono::hours(1));
      } else if (static_cast<int>(g->joined.size()) != st.s || g->joined[st.k] ||
                 m.round() != g->head.round() || m.lr() != g->head.lr() ||
                 m.generation() != g->head.generation() ||
                 m.layout_hash() != g->head.layout_hash()) {
        return {
            StatusCode::INVALID_ARGUMENT,
            fmt::format("{}: worker {}'s stripe {} of {} of push {} does not match the push's "
                        "other stripes (round {}, {} stripes){}: refused",
                        name_, m.worker(), st.k, st.s, st.push, g->head.round(), g->joined.size(),
                        static_cast<int>(g->joined.size()) == st.s && g->joined[st.k]
                            ? ", and that stripe came before"
                            : "")};
      }
      g->joined[st.k] = 1;
      joined = g;
    }
    if (run_.mode() != "sync")
      std::call_once(joined->allocated, [&] { joined->grads = HostBuffer(n); });
    c.group = std::move(joined);
    return Status::OK;
  }

  // A stripe's stream is over, all of it taken: the stripe that ends last ends the push (its
  // gradient whole, in push_end), the others reply `partial`.
  Status end_stripe(PushCall& c, PushReply& rep) {
    const int64_t n = range_.size();
    if (c.next != c.end) {
      const int64_t begin = stripe_floats(n, piece_, c.stripe.k, c.stripe.s).first;
      return stripe_failed(
          c, {StatusCode::INVALID_ARGUMENT,
              fmt::format("{}: worker {}'s stripe {} of {} of round {} ended after {} of its "
                          "floats [{}, {}): refused",
                          name_, c.head.worker(), c.stripe.k, c.stripe.s, c.head.round(),
                          c.next - begin, begin, c.end)});
    }
    std::shared_ptr<PushGroup> g = std::move(c.group);
    bool last = false;
    Status error;
    {
      std::lock_guard<std::mutex> l(groups_mu_);
      g->late = g->late || c.late;
      last = ++g->ended == static_cast<int>(g->joined.size());
      if (last) forget(c.head.worker(), c.stripe.push, g);
      error = g->error;
    }
    if (!error.ok())  // (with its details: a rollback's is the one to adopt)
      return {error.error_code(),
              fmt::format("{}: another stripe of worker {}'s push of round {} failed: {}", name_,
                          c.head.worker(), c.head.round(), error.error_message()),
              error.error_details()};
    if (!last) {
      rep.set_partial(true);
      rep.set_version(version_.load());
      return Status::OK;
    }
    PushCall whole;
    whole.ctx = c.ctx;
    whole.deadline = c.deadline;
    whole.session = c.session;
    whole.head = g->head;
    whole.head.clear_offset();
    whole.started = true;
    whole.late = g->late;
    whole.next = whole.end = n;
    whole.grads = std::move(g->grads);
    return push_end(whole, rep);
  }

  // A stripe failed (refused, cancelled, or ended short): its push fails with it; returns s.
  Status stripe_failed(PushCall& c, Status s) {
    std::shared_ptr<PushGroup> g = std::move(c.group);
    if (!g) return s;  // not a stripe, or already counted
    std::lock_guard<std::mutex> l(groups_mu_);
    if (g->error.ok()) g->error = s;
    if (++g->ended == static_cast<int>(g->joined.size())) forget(c.head.worker(), c.stripe.push, g);
    return s;
  }

  // Under groups_mu_: g is done with (unless the map holds another push by that key by now).
  void forget(int worker, uint64_t push, const std::shared_ptr<PushGroup>& g) {
    const auto it = groups_.find({worker, push});
    if (it != groups_.end() && it->second == g) groups_.erase(it);
  }

  Status round_ahead(int w, int64_t round, int64_t v) const {
    return {StatusCode::FAILED_PRECONDITION,
            fmt::format("{}: worker {} pushed round {} but the shard is at round {}{}", name_, w,
                        round, v,
                        restored_ ? " (it was restarted from a checkpoint, and no rollback "
                                    "brought the run back to it)"
                                  : "")};
  }

  // After the last message of a push: async and ssp apply it; sync counts the worker's
  // gradient in and waits for the round (push_sync).
  Status push_end(PushCall& c, PushReply& rep) {
    if (!c.started)
      return {StatusCode::INVALID_ARGUMENT, fmt::format("{}: a PushStream without a message", name_)};
    if (c.group) return end_stripe(c, rep);
    const PushRequest& req = c.head;
    if (!req.skip() && c.next != range_.size())
      return {StatusCode::INVALID_ARGUMENT,
              fmt::format("{}: worker {}'s push of round {} ended after {} of the range's {} "
                          "floats: refused", name_, req.worker(), req.round(), c.next,
                          range_.size())};
    if (run_.mode() == "sync") return push_sync(c, rep);
    // async and ssp: applied at once, concurrently with pulls and other pushes.
    if (!req.skip()) opt_->apply_shared(params_.data(), c.grads.data(), req.lr(), run_.use_locking());
    const int64_t v = version_.fetch_add(1) + 1;
    rep.set_version(v);
    rep.set_applied(!req.skip());
    rep.set_staleness(std::max<int64_t>(0, v - 1 - req.round()));
    {
      std::lock_guard<std::mutex> l(mu_);
      clocks_[req.worker()] = std::max(clocks_[req.worker()], req.clock());
    }
    cv_.notify_all();
    return Status::OK;
  }

  // Token, layout and worker of a pull, and its wait: sync, for the version it asks for; ssp,
  // while the puller is too far ahead of the slowest live worker.
  Status pull_ready(const Asker& ctx, const PullRequest& req, bool* would_wait = nullptr) {
    if (Status s = authorize(ctx.ctx, req.worker() >= 0); !s.ok()) return s;
    if (req.worker() >= 0) {
      if (Status s = check_worker(req.layout_hash(), req.worker()); !s.ok()) return s;
    } else if (Status s = check_reader(req.layout_hash()); !s.ok()) {
      return s;
    }
    const int64_t gen = req.worker() >= 0 ? req.generation() : -1;
    if (gen >= 0)
      if (Status s = admit(ctx, gen, would_wait); !s.ok() || (would_wait && *would_wait)) return s;
    if (req.min_version() == 0 && (run_.mode() != "ssp" || req.worker() < 0)) return Status::OK;
    std::unique_lock<std::mutex> l(mu_);
    if (req.worker() >= 0)  // a restarted shard learns the workers' clocks from their pulls
      clocks_[req.worker()] = std::max(clocks_[req.worker()], req.worker_clock());
    auto ready = [&] {
      if (version_.load() < req.min_version()) return false;
      return run_.mode() != "ssp" || req.worker() < 0 ||
             req.clock() <= min_live_clock(req.worker()) + run_.staleness();
    };
    return wait(l, ctx, ready, [&] {
      return version_.load() < req.min_version()
                 ? fmt::format("version {} (at {})", req.min_version(), version_.load())
                 : fmt::format("the slowest worker (clock {} is more than {} ahead)", req.clock(),
                               run_.staleness());
    }, run_.mode() == "sync" ? gen : -1, would_wait);
  }

  // The reply's parameters are copied once, into a slice that the reply owns.
  Status pull(ServerContextBase* ctx, const PullRequest& req, grpc::ByteBuffer& out) {
    if (Status s = pull_ready(ctx, req); !s.ok()) return s;
    const int64_t n = range_.size();
    PullReply rep;
    OwnedSlice params = owned_slice(sizeof(float) * static_cast<size_t>(n));
    if (Status s = read_params(ctx, [&] {
          rep.set_version(version_.load());
          copy_params(0, n, reinterpret_cast<float*>(params.data));
          if (req.with_slots()) copy_slots(rep);
        });
        !s.ok())
      return s;
    out = encode(rep, PullReply::kParamsFieldNumber, &params.slice);
    return Status::OK;
  }

  // Floats [lo, hi) of the parameters to dst. sync: read() holds off the rounds, so a plain
  // copy; async: updates race with the copy (Hogwild), read as relaxed atomics like every
  // reader of the store.
  void copy_params(int64_t lo, int64_t hi, float* dst) {
    if (run_.mode() == "sync")
      std::memcpy(dst, params_.data() + lo, sizeof(float) * static_cast<size_t>(hi - lo));
    else
      load_relaxed(params_.data() + lo, dst, hi - lo);
  }

  // Runs read() while no sync round is being applied, so that what it copies is one version:
  // it waits (ctx: up to the call's deadline; null: as long as it takes) while a round is
  // applied in part, and holds off the next round's first piece until it returns. async and
  // ssp: at once.
  template <class Read>
  Status read_params(const Asker& ctx, Read read) {
    if (run_.mode() != "sync") {
      read();
      return Status::OK;
    }
    if (k_ < workers()) {  // backup workers: rounds apply whole, under mu_
      std::lock_guard<std::mutex> l(mu_);
      read();
      return Status::OK;
    }
    if (Status s = hold_params(ctx, nullptr); !s.ok()) return s;
    struct Done {
      ShardService* s;
      ~Done() { s->release_params(); }
    } done{this};
    read();
    return Status::OK;
  }

  // sync: waits (ctx: up to the call's deadline; null: as long as it takes) until no round is
  // applied in part, then holds the parameters: no round begins until release_params(). *v:
  // the version held.
  Status hold_params(const Asker& ctx, int64_t* v, bool* would_wait = nullptr) {
    std::unique_lock<std::mutex> l(mu_);
    if (ctx.ctx != nullptr) {
      if (Status s = wait(
              l, ctx, [&] { return started_ == 0; },
              [] { return std::string("the round being applied"); }, -1, would_wait, true);
          !s.ok() || (would_wait && *would_wait))
        return s;
    } else {
      cv_.wait(l, [&] { return started_ == 0; });
    }
    ++copying_;
    if (v != nullptr) *v = version_.load();
    return Status::OK;
  }
  // Ends a hold; the last one hands the pieces deferred by it to a thread of threads_.
  void release_params() {
    std::vector<Deferred> due;
    {
      std::lock_guard<std::mutex> l(mu_);
      if (--copying_ == 0) due.swap(deferred_);
    }
    cv_.notify_all();
    if (!due.empty())
      threads_.run([this, due = std::move(due)] {
        for (const Deferred& d : due) apply_completed(d.worker, d.grads, d.at, d.lo, d.hi);
      });
  }

  // A completed piece waiting for a reader's hold to end (take_piece).
  struct Deferred {
    int worker;
    Bulk grads;
    size_t at;
    int64_t lo, hi;
  };

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
    if (run_.mode() == "ssp") {  // a restarted shard learns the workers' clocks from heartbeats too
      clocks_[w] = std::max(clocks_[w], req->worker_clock());
    }
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
    rep->set_piece_floats(piece_);
    rep->set_generation(generation_);
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
    called_ = true;
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

  // Under mu_: the shard exits once every worker is done or lost, and one was done. While
  // every worker is lost and none done, it keeps the run's state for workers that come back;
  // but a restarted shard that no worker has called at all since its start exits then: the
  // run ended while it was down, or its workers are gone (started again with --resume, a
  // chief initialises fresh shards from its checkpoint).
  void check_exit() {
    bool any_done = false;
    for (size_t w = 0; w < done_.size(); ++w) {
      if (!done_[w] && !lost_[w]) return;
      any_done = any_done || done_[w];
    }
    if (!any_done) {
      if (!restored_ || called_) return;
      say(
          fmt::format("no worker has called since this shard restarted from its checkpoint "
                      "({:.1f} s): the run ended while it was down, or its workers are gone; "
                      "exiting",
                      std::chrono::duration<double>(timeout_ + kRestartGrace).count()));
      exit_ = true;
      cv_.notify_all();
      return;
    }
    say("every worker is done or lost; exiting");
    exit_ = true;
    cv_.notify_all();
  }

  // The time a waiting call gives up: its deadline, less what its answer needs to reach the
  // caller, so that the caller reads why (the shard's status) rather than its own bare
  // "Deadline Exceeded".
  static std::chrono::system_clock::time_point answer_by(const Asker& a) {
    return a.deadline - kAnswerMargin;
  }
  static constexpr std::chrono::milliseconds kAnswerMargin{250};

  // Waits on cv_ (l holds mu_) until ready(), the call's deadline, or a lost worker that the
  // wait needs (sync). what() says what is waited for. gen >= 0: a sync call of that rollback
  // generation, refused once the shard goes on to a later one.
  // would_wait (not null): a call served on one of gRPC's threads, which must not block; instead
  // of waiting, *would_wait is set and OK returned, and the caller serves the call again on a
  // thread of threads_ (what it did before the wait must be safe to do twice).
  // reads: a read of the parameters, which waits through lost workers while the round applied
  // in part is to be taken back (take_back_round), and is then served.
  template <class Ready, class What>
  Status wait(std::unique_lock<std::mutex>& l, const Asker& ctx, Ready ready, What what,
              int64_t gen = -1, bool* would_wait = nullptr, bool reads = false) {
    while (!ready()) {
      if (gen >= 0 && gen < generation_) return stale(gen);
      if (exit_) return {StatusCode::UNAVAILABLE, fmt::format("{} is shutting down", name_)};
      if (ctx.ctx->IsCancelled())
        return {StatusCode::CANCELLED, fmt::format("{}: the call was cancelled", name_)};
      const Status lost = lost_blocks_round();
      if (!lost.ok() && !(reads && undo_ && started_ > 0)) return lost;
      if (std::chrono::system_clock::now() >= answer_by(ctx))
        return {StatusCode::DEADLINE_EXCEEDED,
                fmt::format("{}: the call's deadline passed while waiting for {}{}", name_, what(),
                            lost.ok() ? std::string() : " (" + lost.error_message() + ")")};
      if (would_wait != nullptr) {
        *would_wait = true;
        return Status::OK;
      }
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

  // The end of worker w's push of a round: its gradient counts in (all its pieces are here, or
  // it skips the round), and the call waits until the round is applied.
  Status push_sync(PushCall& c, PushReply& rep) {
    const PushRequest& req = c.head;
    std::unique_lock<std::mutex> l(mu_);
    if (req.generation() < generation_) return stale(req.generation());
    const int w = req.worker();
    const int64_t round = req.round();
    const int64_t v = version_.load();
    if (c.late || round < v) {
      // A late gradient of an applied round (backup workers): dropped and counted.
      ++dropped_;
      rep.set_version(v);
      rep.set_dropped(true);
      return Status::OK;
    }
    if (round > v) return round_ahead(w, round, v);
    if (round == taken_back_) return taken_back();
    // A stale call of this worker (its stream broken, then retried) may still be copying a
    // piece that this push skipped as already here: its gradient is whole once that is done.
    cv_.wait(l, [&] { return inflight_[w] == 0 || req.generation() < generation_; });
    if (req.generation() < generation_) return stale(req.generation());
    if (round == taken_back_) return taken_back();
    if (version_.load() != round) {  // applied without it meanwhile (backup workers)
      ++dropped_;
      rep.set_version(version_.load());
      rep.set_dropped(true);
      return Status::OK;
    }
    if (!arrived_[w]) {  // (else a push retried after its reply was lost: it waits again)
      arrived_[w] = 1;
      worker_stats_[w] = {req.loss_sum(), req.correct(), req.examples(), req.towers(), !req.skip()};
      lr_ = req.lr();
      if (++arrived_count_ == k_ && k_ < workers()) apply_round();
      complete_round();
    }
    ++waiting_[w];
    const Clock::time_point waited_from = Clock::now();
    const Status s = wait(
        l, c.asker(), [&] { return version_.load() > round; },
        [&] { return fmt::format("the other workers' gradients of round {}", round); },
        req.generation());
    --waiting_[w];
    if (rollback_of(s)) return s;  // the round is gone with its generation: nothing to withdraw
    if (!s.ok()) {
      // Withdraw, so that the round may still complete with a retry of this push (its pieces
      // stay: they are the same gradient), unless another call of the worker still waits.
      if (version_.load() <= round && arrived_[w] && waiting_[w] == 0) {
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
    rep.set_wait_seconds(seconds_since(waited_from));
    return Status::OK;
  }

  // Under mu_ (l): the K-th gradient of a backup-workers round has arrived. Sums the arrived
  // workers' gradients in rank order by the fixed tree and applies the sum, unless a
  // contributor's loss was not finite (then the round is skipped, as in one process).
  void apply_round() {
    bool finite = true;
    std::vector<float*> blocks;
    for (size_t w = 0; w < arrived_.size(); ++w)
      if (arrived_[w]) {
        finite = finite && worker_stats_[w].finite;
        blocks.push_back(grads_[w].data());
      }
    if (!finite) return;
    // (No reader holds the parameters: in a backup-workers run they read under mu_.)
    const int64_t n = range_.size();
    const int count = static_cast<int>(blocks.size());
    if (count > 1)
      for_chunks(n, 1 << 15, [&](int64_t, int64_t b, int64_t e) {
        kernels::cpu::tree_sum(blocks.data(), count, b, e);
      });
    opt_->apply(params_.data(), blocks[0], lr_);  // the last arrived worker's (all send the same)
  }

  // Under mu_: ends the round once it is done: its K gradients have arrived and, unless one of
  // them skips it (a loss that was not finite: then nothing is applied), every piece is applied.
  void complete_round() {
    if (arrived_count_ < k_) return;
    bool finite = true;
    RoundTotals t;
    for (size_t w = 0; w < arrived_.size(); ++w) {
      if (!arrived_[w]) continue;
      const WorkerStats& s = worker_stats_[w];
      t.loss_sum += s.loss_sum;
      t.correct += s.correct;
      t.examples += s.examples;
      t.contributors += s.towers;
      finite = finite && s.finite;
    }
    if (finite && k_ == workers() && finished_ < pieces_) return;  // pieces still being applied
    if (finite && k_ == workers() && pieces_ == 0) opt_->begin_pieces();  // an empty range counts it
    t.applied = finite;
    const int64_t round = version_.load();
    rounds_[round] = t;
    while (rounds_.size() > 64) rounds_.erase(rounds_.begin());
    if (undo_) {  // its values from before stay, until the next round overwrites them
      kept_.swap(applied_);
      kept_round_ = round;
      kept_updates_ = round_updates_;
    }
    clear_round();
    version_.store(round + 1);
    round_updates_ = opt_->updates();
    cv_.notify_all();
  }

  // Under mu_: no worker's gradient or piece of a round is here.
  void clear_round() {
    std::fill(arrived_.begin(), arrived_.end(), 0);
    arrived_count_ = 0;
    for (auto& g : got_) std::fill(g.begin(), g.end(), 0);
    std::fill(claimed_.begin(), claimed_.end(), 0);
    std::fill(copied_.begin(), copied_.end(), 0);
    std::fill(applied_.begin(), applied_.end(), 0);
    started_ = finished_ = 0;
  }

  // Under mu_, plain sync (applied_ kept): when lost workers leave the current round unable to
  // complete after some of its pieces were applied, takes those pieces back: their parameters
  // and slots, and the optimizer's count, are again the last complete round's, which the
  // chief then reads for its checkpoint and the shard saves. The round is refused from then
  // on (plain sync stops when a worker is lost). Waits for nothing: while a piece is being
  // applied or copied, or a reader holds the parameters, it is tried again at the next check
  // (watch). Returns whether it took the round back.
  bool take_back_round() {
    if (!undo_ || started_ == 0 || taken_back_ == version_.load()) return false;
    if (started_ != finished_ || copying_ != 0 ||
        std::any_of(inflight_.begin(), inflight_.end(), [](int n) { return n > 0; }))
      return false;
    const Status why = lost_blocks_round();
    if (why.ok()) return false;
    const int64_t round = version_.load();
    go_back_to(round, applied_, round_updates_,
               fmt::format("{}; the {} of its {} pieces applied here were taken back, and this "
                           "shard holds round {} again",
                           why.error_message(), std::count(applied_.begin(), applied_.end(), 1),
                           pieces_, round));
    return true;
  }
  // Under mu_: the shard holds `round` again, and refuses it from then on, saying `why` (which
  // begins with the shard's name): the pieces marked in `pieces` get their values from before
  // the round back, and the optimizer its count `updates`.
  void go_back_to(int64_t round, const std::vector<char>& pieces, int64_t updates,
                  std::string why) {
    for (int p = 0; p < pieces_; ++p) {
      if (!pieces[static_cast<size_t>(p)]) continue;
      const int64_t a = p * piece_, b = std::min<int64_t>(a + piece_, range_.size());
      for (const auto& [live, kept] : undo_pairs_)
        std::memcpy(live + a, kept + a, sizeof(float) * static_cast<size_t>(b - a));
    }
    opt_->load_state({{"name", opt_->config().name}, {"updates", updates}});
    version_.store(round);
    rounds_.erase(round);
    clear_round();
    kept_round_ = -1;
    round_updates_ = updates;
    taken_back_ = round;
    taken_back_why_ = std::move(why);
    say(taken_back_why_.substr(name_.size() + 2));  // (the log names the shard already)
    cv_.notify_all();
  }

  // Plain sync, a run that stops on a lost worker (TakeBackRequest, towers.proto): holds
  // req->version, the last round complete on every shard. A shard one round beyond it takes
  // that round back, from the values it keeps; the round is refused from then on.
  Status TakeBack(ServerContext* ctx, const TakeBackRequest* req, TakeBackReply* rep) override {
    if (Status s = authorize(ctx); !s.ok()) return s;
    if (Status s = check_reader(req->layout_hash()); !s.ok()) return s;
    std::unique_lock<std::mutex> l(mu_);
    const int64_t v = version_.load();
    rep->set_version(v);
    if (v == req->version()) return Status::OK;  // (a round in part: take_back_round)
    auto refuse = [&](const std::string& why) {
      return Status{StatusCode::FAILED_PRECONDITION,
                    fmt::format("{} cannot go back to round {}: {}", name_, req->version(), why)};
    };
    if (run_.mode() != "sync" || !undo_)
      return refuse("it keeps no earlier round (plain sync with more than one worker does)");
    // The shards count a worker lost each by its own clock (their watchdogs wake every 100 ms,
    // and the worker's last call to each differs): the loss that stopped the chief at another
    // shard is awaited here for up to a heartbeat timeout and 2 s more. Then the readers' holds
    // of the parameters end. Nothing of the next round may have arrived (it cannot have: the
    // chief, whose push of it is needed, is at req->version).
    const auto until = std::min(
        answer_by(ctx), std::chrono::system_clock::now() + timeout_ + std::chrono::seconds(2));
    auto can = [&] {
      return v == version_.load() && v == req->version() + 1 && kept_round_ == req->version() &&
             !lost_blocks_round().ok() && copying_ == 0 && arrived_count_ == 0 &&
             std::all_of(claimed_.begin(), claimed_.end(), [](int n) { return n == 0; }) &&
             std::all_of(inflight_.begin(), inflight_.end(), [](int n) { return n == 0; });
    };
    while (!can() && version_.load() == v && kept_round_ == req->version() &&
           std::chrono::system_clock::now() < until)
      cv_.wait_for(l, std::chrono::milliseconds(100));
    if (!can()) {
      if (version_.load() != v || kept_round_ != req->version())
        return refuse(fmt::format("it is at round {}, and {}", version_.load(),
                                  kept_round_ < 0 ? std::string("keeps no earlier one")
                                                  : fmt::format("keeps round {}", kept_round_)));
      if (lost_blocks_round().ok()) return refuse("the run can go on (no lost worker stops it)");
      if (copying_ != 0)
        return {StatusCode::DEADLINE_EXCEEDED,
                fmt::format("{}: a reader held the parameters until the deadline of going back "
                            "to round {}",
                            name_, req->version())};
      return refuse(fmt::format("round {} has begun here", v));
    }
    go_back_to(
        req->version(), kept_, kept_updates_,
        fmt::format("{}: round {} was taken back ({} pieces): it had completed here but "
                    "not on every shard ({}); this shard holds round {} again",
                    name_, req->version(), std::count(kept_.begin(), kept_.end(), 1),
                    lost_blocks_round().error_message().substr(name_.size() + 2), req->version()));
    rep->set_version(req->version());
    return Status::OK;
  }

  // A call of the round taken back: refused.
  Status taken_back() const {
    return {StatusCode::ABORTED, fmt::format("{}: refused", taken_back_why_)};
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

  // Marks workers lost after the heartbeat timeout without a call, and ends sessions whose
  // call is overdue (end_overdue_sessions), at least every 100 ms.
  // Time in which the shard itself did not run (stopped with SIGSTOP, a paused VM, a machine
  // swapping) does not count against its workers: their calls of that time wait in its
  // sockets. When a check comes more than kStallGap after the last one, every worker's last
  // call moves forward by the gap, so that a worker is lost only for a heartbeat timeout of
  // the shard's own running time without a call.
  void watch() {
    constexpr auto kEvery = std::chrono::milliseconds(100),
                   kStallGap = std::chrono::milliseconds(500);
    std::unique_lock<std::mutex> l(mu_);
    Clock::time_point sessions_checked{}, last = Clock::now();
    while (!exit_) {
      cv_.wait_for(l, kEvery);
      const auto now = Clock::now();
      if (now - last > kStallGap) {
        for (auto& t : seen_) t += now - last;
        restarted_grace_ += now - last;
        if (now - last >= std::chrono::seconds(1))
          say(
              fmt::format("this shard did not run for {:.1f} s (stopped, or starved of CPU): that "
                          "time does not count against its workers' heartbeats",
                          std::chrono::duration<double>(now - last).count()));
      }
      last = now;
      bool changed = false;
      for (size_t w = 0; w < seen_.size(); ++w) {
        if (lost_[w] || done_[w] || now - seen_[w] <= timeout_) continue;
        lost_[w] = 1;
        changed = true;
        if (restored_ && seen_[w] == restarted_grace_)
          say(fmt::format("worker {} lost: no call since this shard restarted ({:.1f} s)", w,
                          std::chrono::duration<double>(now - seen_[w] + kRestartGrace).count()));
        else
          say(fmt::format("worker {} lost: no call for {:.1f} s", w,
                          std::chrono::duration<double>(now - seen_[w]).count()));
      }
      if (changed) {
        check_exit();
        cv_.notify_all();
      }
      take_back_round();
      if (now - sessions_checked >= std::chrono::milliseconds(100)) {  // (not on every wake)
        sessions_checked = now;
        l.unlock();
        end_overdue_sessions();
        l.lock();
      }
    }
  }

  struct WorkerStats {
    double loss_sum = 0.0;
    int64_t correct = 0, examples = 0;
    int towers = 0;
    bool finite = true;
  };

  // This shard's checkpoint of a version: ps-I-VERSION.ckpt.
  std::string checkpoint_path(int64_t version) const {
    return (std::filesystem::path(o_.checkpoint_dir) /
            fmt::format("ps-{}-{:010}.ckpt", o_.index, version))
        .string();
  }
  // This shard's checkpoints in --checkpoint-dir, by version.
  std::map<int64_t, std::string> checkpoints() const {
    std::map<int64_t, std::string> out;
    const std::string prefix = fmt::format("ps-{}-", o_.index);
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(o_.checkpoint_dir, ec)) {
      const std::string name = e.path().filename().string();
      if (name.size() <= prefix.size() + 5 || name.compare(0, prefix.size(), prefix) != 0 ||
          name.compare(name.size() - 5, 5, ".ckpt") != 0)
        continue;
      const std::string digits = name.substr(prefix.size(), name.size() - prefix.size() - 5);
      auto digit = [](char ch) { return ch >= '0' && ch <= '9'; };
      if (digits.size() > 18 || !std::all_of(digits.begin(), digits.end(), digit)) continue;
      out[std::stoll(digits)] = e.path().string();
    }
    return out;
  }
  static constexpr size_t kKeepCheckpoints = 3;
  // Under save_mu_: writes ck as the checkpoint of its version and keeps the last few; its
  // path. Throws for a file that cannot be written.
  std::string write_checkpoint(const InitRequest& ck) {
    const std::string path = checkpoint_path(ck.version());
    write_atomically(path, ck.SerializeAsString());
    // The last few: a rollback goes back to the round of a restarted shard's last checkpoint,
    // which the other shards may already have saved past.
    std::map<int64_t, std::string> files = checkpoints();
    while (files.size() > kKeepCheckpoints) {
      std::filesystem::remove(files.begin()->second);
      files.erase(files.begin());
    }
    return path;
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
  bool called_ = false;    // a worker has called since the shard started
  static constexpr auto kRestartGrace = std::chrono::seconds(5);
  Clock::time_point restarted_grace_{};  // a restarted shard's start, plus kRestartGrace
  // Sync rollbacks (Restore): the generation the shard is at, the round it went back to,
  // whether it is a restarted shard whose rollback no worker has adopted yet, whether its
  // parameters still have to be loaded, and whether a Restore is loading them.
  int64_t generation_ = 0;
  int64_t rollback_version_ = 0;
  bool pending_ = false;
  bool offered_ = false;     // pending_, and a worker has been told of its rollback's generation
  bool needs_load_ = false;  // the parameters are not yet rollback_version_'s (Restore loads them)
  bool restoring_ = false;
  std::mutex save_mu_;    // one Save at a time
  mutable std::atomic<int64_t> rejected_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  std::mutex groups_mu_;  // groups_ and the PushGroups in it
  std::map<std::pair<int, uint64_t>, std::shared_ptr<PushGroup>> groups_;  // (worker, push id)
  bool initialized_ = false, exit_ = false;
  // Set with initialized_: a worker's pull lends the parameters (plain sync). Read without
  // mu_, by PullStream on gRPC's thread to hand every other pull off at once, and after
  // pull_ready to decide how a pull is served.
  std::atomic<bool> lending_{false};
  std::string run_id_;
  std::unique_ptr<ParameterLayout> layout_;
  uint64_t hash_ = 0;
  Range range_;
  RunSpec run_;
  int k_ = 1;
  HostBuffer params_;
  std::unique_ptr<Optimizer> opt_;
  std::atomic<int64_t> version_{0};
  int64_t piece_ = kDefaultPieceFloats;  // floats per piece of a push or pull
  int pieces_ = 0;                        // pieces in the range
  std::vector<HostBuffer> grads_;  // sync: each worker's gradient of the current round
  std::vector<std::vector<char>> got_;  // sync: [worker][piece], arrived in the current round
  std::vector<int> claimed_, copied_;   // plain sync: [piece], workers whose piece arrived / is copied
  int started_ = 0, finished_ = 0;      // plain sync: pieces of the round applied, begun / done
  int64_t round_t_ = 0;                 // plain sync: the round's update number
  float round_lr_ = 0.0f;               // plain sync: the round's learning rate
  // Plain sync with more than one worker: the pieces applied in the current round, with their
  // parameters and slots as they were before it (kept by apply_completed) and the optimizer's
  // count of updates before it. A round that cannot complete (a worker lost in the middle of
  // its push) is taken back from them (take_back_round), so that the shard is read at the last
  // complete round rather than refusing every read while the round is applied in part. The
  // values stay until the next round's first piece is applied: until then the last complete
  // round (kept_round_, its pieces kept_) can be taken back too (TakeBack), where the lost
  // worker completed it on this shard but not on another.
  bool undo_ = false;  // whether the run keeps them (plain sync, more than one worker)
  std::vector<char> applied_, kept_;
  std::vector<HostBuffer> undo_kept_;  // the parameters', then each slot's, values kept
  std::vector<std::pair<float*, float*>> undo_pairs_;  // each array and where it is kept
  int64_t round_updates_ = 0;  // the optimizer's updates when the current round began
  int64_t kept_round_ = -1, kept_updates_ = 0;
  int64_t taken_back_ = -1;             // the round taken back: refused from then on
  std::string taken_back_why_;          // why, for its refusals
  int copying_ = 0;                     // sync: readers holding the parameters (hold_params)
  std::vector<char> arrived_;
  std::vector<int> waiting_;   // sync: [worker], its calls waiting at the barrier
  std::vector<int> inflight_;  // sync: [worker], its pieces being copied without the lock
  std::vector<Deferred> deferred_;  // plain sync: completed pieces waiting for a hold to end
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
  struct SessionCall {  // a session's call under way (session_call)
    static std::chrono::system_clock::time_point never() {
      return std::chrono::system_clock::time_point::max();
    }
    uint64_t call = 0;
    std::chrono::system_clock::time_point due = never();  // its deadline and kSessionOverdue
    std::string what;
  };
  std::mutex sessions_mu_;
  // Open sessions' calls (end_sessions), and the call under way on each (end_overdue_sessions).
  std::map<grpc::CallbackServerContext*, SessionCall> sessions_;
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
  service.end_sessions();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  if (o.exit_process_when_done) {
    std::fflush(nullptr);
    std::_Exit(0);
  }
  return 0;
}

}  // namespace towers::remote
