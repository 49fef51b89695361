#include "towers/remote/remote_store.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <limits>
#include <mutex>
#include <set>
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/check.h"
#include "core/clock.h"
#include "towers/remote/messages.h"
#include "towers/remote/shard_set.h"
#include "towers/remote/towers.grpc.pb.h"
#include "towers/remote/wire.h"

namespace towers::remote {

namespace {

std::string optimizer_json(const OptimizerConfig& c) {
  nlohmann::json j = {{"name", c.name}, {"nesterov", c.nesterov}, {"beta1", c.beta1},
                      {"beta2", c.beta2}, {"epsilon", c.epsilon}, {"rho", c.rho},
                      {"rms_epsilon", c.rms_epsilon}, {"ema", c.ema},
                      {"lookahead_k", c.lookahead_k}, {"lookahead_alpha", c.lookahead_alpha}};
  j["momentum"] = c.momentum ? nlohmann::json(*c.momentum) : nlohmann::json();
  return j.dump();
}

}  // namespace

RemoteParameterStore::RemoteParameterStore(RemoteConfig cfg, const ParameterLayout& layout,
                                           float* params, Optimizer& opt, UpdateAccess access)
    : cfg_(std::move(cfg)),
      layout_(layout),
      params_(params),
      opt_(opt),
      access_(access),
      hash_(layout_hash(layout)),
      ranges_(shard_ranges(layout.total(), static_cast<int>(cfg_.cluster.ps.size()))),
      shards_(std::make_unique<ShardSet>(cfg_.cluster.ps, cfg_.token, cfg_.tls, cfg_.stripes,
                                         cfg_.sessions)) {
  keep_message_buffers();
  // Heartbeats from the start, so that a worker still loading its data is not counted lost.
  heartbeat_ = std::thread([this] {
    const auto period = std::chrono::duration<double>(std::max(0.05, cfg_.heartbeat_timeout / 5));
    while (!stop_.load()) {
      for (int i = 0; i < shards_->size() && !stop_.load(); ++i) {
        HeartbeatRequest req;
        req.set_worker(cfg_.rank);
        req.set_worker_clock(worker_clock_.load());
        HeartbeatReply rep;
        // Short: an unreachable shard must not hold up the beats to the others.
        auto ctx = call_context(cfg_.token, std::clamp(cfg_.heartbeat_timeout / 5, 0.2, 2.0));
        shards_->stub(i).Heartbeat(ctx.get(), req, &rep);  // a missed beat is retried next period
      }
      const auto until = Clock::now() + std::chrono::duration_cast<Clock::duration>(period);
      while (!stop_.load() && Clock::now() < until)
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
}

RemoteParameterStore::~RemoteParameterStore() {
  try {
    finish();
  } catch (...) {
  }
  stop_.store(true);
  if (heartbeat_.joinable()) heartbeat_.join();
}

void RemoteParameterStore::finish() {
  if (finished_.exchange(true)) return;
  stop_.store(true);
  if (heartbeat_.joinable()) heartbeat_.join();
  for (int i = 0; i < shards_->size(); ++i) {
    HeartbeatRequest req;
    req.set_worker(cfg_.rank);
    req.set_done(true);
    HeartbeatReply rep;
    auto ctx = call_context(cfg_.token, 5.0);
    shards_->stub(i).Heartbeat(ctx.get(), req, &rep);  // best effort: the shard also times out
  }
}

void RemoteParameterStore::initialize_shards(int64_t version) {
  std::vector<InitRequest> reqs(shards_->size());
  std::vector<InitReply> reps(shards_->size());
  const auto slots = opt_.slots();
  for (int i = 0; i < shards_->size(); ++i) {
    InitRequest& r = reqs[i];
    r.set_layout_hash(hash_);
    add_variables(layout_, r.mutable_variables());
    RunSpec* run = r.mutable_run();
    run->set_mode(cfg_.mode);
    run->set_workers(cfg_.cluster.workers());
    run->set_replicas_to_aggregate(cfg_.replicas_to_aggregate);
    run->set_staleness(cfg_.staleness);
    run->set_use_locking(cfg_.use_locking);
    run->set_optimizer(optimizer_json(opt_.config()));
    run->set_heartbeat_timeout_ms(static_cast<int64_t>(cfg_.heartbeat_timeout * 1000));
    run->set_piece_floats(cfg_.piece_floats);
    r.set_version(version);
    r.set_updates(opt_.updates());
    const Range& g = ranges_[i];
    const size_t bytes = sizeof(float) * static_cast<size_t>(g.size());
    r.set_params(params_ + g.begin, bytes);
    for (const auto& [name, p] : slots) r.add_slots(p + g.begin, bytes);
    r.set_run_id(cfg_.run_id);
    r.set_model(cfg_.model);
    r.set_config(cfg_.config);
  }
  // Shards may still be starting: retry an unreachable one until the timeout.
  const auto until = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                        std::chrono::duration<double>(cfg_.rpc_timeout));
  for (int i = 0; i < shards_->size(); ++i) {
    bool said = false;
    for (;;) {
      // Waits for the connection (a shard still starting) for a second or two at a time; the
      // shard receives the request and writes it as its first checkpoint (decision 78), at
      // 25 MB/s or faster.
      auto ctx = call_context(cfg_.token, 2.0 + static_cast<double>(reqs[i].ByteSizeLong()) / 25e6);
      ctx->set_wait_for_ready(true);
      grpc::Status s = shards_->stub(i).Init(ctx.get(), reqs[i], &reps[i]);
      if (s.ok()) break;
      const bool starting = s.error_code() == grpc::StatusCode::UNAVAILABLE ||
                            s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
      if (!starting || Clock::now() >= until) shards_->fail(i, "Init", s);
      if (!said) {
        fmt::print(stderr, "towers: waiting for ps:{} ({}) to answer (up to --rpc-timeout {} s)\n",
                   i, cfg_.cluster.ps[i], cfg_.rpc_timeout);
        said = true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    TOWERS_CHECK(reps[i].begin() == ranges_[i].begin && reps[i].end() == ranges_[i].end,
                 "ps:{} serves [{}, {}), this worker expects [{}, {})", i, reps[i].begin(),
                 reps[i].end(), ranges_[i].begin, ranges_[i].end);
  }
  version_.store(version);
}

int64_t RemoteParameterStore::join() {
  const auto until = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                        std::chrono::duration<double>(cfg_.rpc_timeout));
  for (int i = 0; i < shards_->size(); ++i) {
    bool said = false;
    for (;;) {
      InfoRequest req;
      InfoReply rep;
      auto ctx = call_context(cfg_.token, 1.0);
      ctx->set_wait_for_ready(true);
      grpc::Status s = shards_->stub(i).Info(ctx.get(), req, &rep);
      const bool starting = s.error_code() == grpc::StatusCode::UNAVAILABLE ||
                            s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
      if (!s.ok() && !starting) shards_->fail(i, "Info", s);
      if (s.ok() && rep.initialized()) {
        TOWERS_REQUIRE(rep.layout_hash() == hash_,
                       "ps:{} ({}) serves a different model (layout hash {:016x}, this worker's "
                       "is {:016x}): every task of a run must train the same --model",
                       i, cfg_.cluster.ps[i], rep.layout_hash(), hash_);
        TOWERS_REQUIRE(rep.piece_floats() > 0 && (i == 0 || rep.piece_floats() == piece_),
                       "ps:{} ({}) serves pieces of {} floats, ps:0 of {}: the shards disagree",
                       i, cfg_.cluster.ps[i], rep.piece_floats(), piece_);
        piece_ = rep.piece_floats();
        generation_.store(std::max(generation_.load(), rep.generation()));
        break;
      }
      TOWERS_REQUIRE(Clock::now() < until,
                     "ps:{} ({}) was not initialised by the chief within --rpc-timeout {} s{}", i,
                     cfg_.cluster.ps[i], cfg_.rpc_timeout, s.ok() ? "" : ": " + describe(s));
      if (!said) {
        fmt::print(stderr, "towers: waiting for ps:{} ({}) to {} (up to --rpc-timeout {} s)\n", i,
                   cfg_.cluster.ps[i], s.ok() ? "be initialised by the chief" : "answer",
                   cfg_.rpc_timeout);
        said = true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }
  host_params();
  return version_.load();
}

void RemoteParameterStore::attach(const std::vector<Tower*>& towers) {
  towers_ = towers;
  pulled_.clear();
  for (size_t i = 0; i < towers.size(); ++i) pulled_.emplace_back(layout_.total());
  shard_read_.assign(towers.size(), std::vector<int64_t>(shards_->size(), version_.load()));
  reset_clocks(static_cast<int>(towers.size()));
}

int RemoteParameterStore::tower_index(const Tower& t) const {
  for (size_t i = 0; i < towers_.size(); ++i)
    if (towers_[i] == &t) return static_cast<int>(i);
  TOWERS_FAIL("a tower the remote store was not attached to");
}

namespace {
int64_t ns_since(Clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
}
}  // namespace

nlohmann::json RemoteParameterStore::timing() const {
  return {{"streams", shards_->streams()},
          {"sessions", shards_->sessions_opened()},
          {"pulls", pulls_.load()},
          {"pull_seconds", pull_ns_.load() * 1e-9},
          {"pushes", pushes_.load()},
          {"push_seconds", push_ns_.load() * 1e-9},
          {"push_wait_seconds", push_wait_ns_.load() * 1e-9}};
}

int64_t RemoteParameterStore::pull(Tower& tower) {
  const auto t0 = Clock::now();
  const int ti = tower_index(tower);
  float* dst = pulled_[ti].data();
  const int64_t v = fetch(dst, ti, &shard_read_[ti]);
  tower.load_params(dst);
  ++pulls_;
  pull_ns_ += ns_since(t0);
  return v;
}

int64_t RemoteParameterStore::fetch(float* dst, int ti, std::vector<int64_t>* shard_versions) {
  TOWERS_CHECK(piece_ > 0, "the remote store pulls before it has joined the shards");
  PullRequest req;
  req.set_layout_hash(hash_);
  req.set_worker(cfg_.rank);
  // sync: the current round, so a pull waits at the barrier for it
  if (cfg_.mode == "sync") {
    req.set_min_version(version_.load());
    req.set_generation(generation_.load());
  }
  if (cfg_.mode == "ssp") {
    req.set_clock(ti >= 0 ? clocks_[ti].load() : min_clock());
    req.set_worker_clock(min_clock());
  }
  // The one copy: each piece, from the received slices to dst, as it arrives.
  const std::vector<int64_t> versions = adopting_rollbacks(
      [&] { return shards_->pull_streams(req, ranges_, piece_, dst, cfg_.rpc_timeout); });
  const int64_t v = *std::min_element(versions.begin(), versions.end());
  if (shard_versions != nullptr) *shard_versions = versions;
  if (cfg_.mode != "sync") {
    int64_t seen = version_.load();
    while (seen < v && !version_.compare_exchange_weak(seen, v)) {}
  }
  return v;
}

int64_t RemoteParameterStore::push_ranges(const float* grads, bool skip, UpdateRecord& rec) {
  const auto t0 = Clock::now();
  const int n = shards_->size();
  std::vector<PushReply> reps(n);
  const int ti = rec.tower >= 0 ? rec.tower : 0;
  {
    // The gradient is lent to gRPC, not copied: `lender` waits, before this block ends, until
    // gRPC has let go of it.
    PushRequest r;  // the same small fields for every shard
    r.set_layout_hash(hash_);
    r.set_worker(cfg_.rank);
    if (cfg_.mode == "sync") {  // async, ssp: each shard's round below
      r.set_round(version_.load());
      r.set_generation(generation_.load());
    }
    r.set_lr(rec.lr);
    r.set_skip(skip);
    r.set_loss_sum(rec.loss * static_cast<double>(rec.examples));
    r.set_correct(rec.correct);
    r.set_examples(rec.examples);
    r.set_towers(rec.contributors);
    // ssp: the worker's clock once this push counts (its slowest tower's)
    int64_t c = n_clocks_ == 0 ? 0 : std::numeric_limits<int64_t>::max();
    for (int t = 0; t < n_clocks_; ++t) c = std::min(c, clocks_[t].load() + (t == ti ? 1 : 0));
    r.set_clock(c);
    // Each shard's range in pieces (none for a skip).
    Lender lender;
    std::vector<ShardSet::PushOut> out(n);
    for (int i = 0; i < n; ++i) {
      const Range& g = ranges_[i];
      // async, ssp: the version this tower read from shard i, from which the shard counts
      // the updates applied since (the shards' versions move apart while pushes are applied)
      if (cfg_.mode != "sync") r.set_round(shard_read_.at(ti).at(i));
      out[i].head = r;
      if (skip) continue;
      for_each_piece(g.size(), piece_, [&](int64_t lo, int64_t hi) {
        out[i].pieces.emplace_back(
            lo, lender.lend(grads + g.begin + lo, sizeof(float) * static_cast<size_t>(hi - lo)));
        return true;
      });
    }
    adopting_rollbacks([&] {
      shards_->push(out, reps, cfg_.rpc_timeout);
      return 0;
    });
  }
  const PushReply& r0 = reps[0];
  int64_t v = r0.version();
  for (const PushReply& r : reps) v = std::min(v, r.version());
  if (cfg_.mode == "sync") {
    // The whole round, over every worker (every shard applied it, or every shard skipped it).
    rec.skipped = !r0.applied() && !r0.dropped();
    if (!r0.dropped()) {
      rec.loss = r0.examples() > 0 ? r0.loss_sum() / static_cast<double>(r0.examples()) : rec.loss;
      rec.correct = r0.correct();
      rec.examples = r0.examples();
      rec.contributors = r0.contributors();
    } else {
      rec.contributors = 0;  // late: the round was applied without this worker's gradient
    }
    version_.store(v);
    // The push's wait at the barrier: the longest a shard held it for the other workers
    // (the shards' waits overlap; the push ends with the last reply).
    double wait = 0.0;
    for (const PushReply& r : reps) wait = std::max(wait, r.wait_seconds());
    push_wait_ns_ += static_cast<int64_t>(wait * 1e9);
  } else {
    int64_t seen = version_.load();
    while (seen < v && !version_.compare_exchange_weak(seen, v)) {}
    // The staleness the shards saw when they applied (or skipped) the push: the updates of
    // every worker applied on a shard between this tower's pull and its push (the largest
    // over the shards). The mode's estimate from this process's version cannot see the other
    // workers' pushes.
    int64_t staleness = 0;
    for (const PushReply& r : reps) staleness = std::max<int64_t>(staleness, r.staleness());
    rec.staleness = staleness;
  }
  ++pushes_;
  push_ns_ += ns_since(t0);
  return v;
}

int64_t RemoteParameterStore::push(const float* grads, UpdateRecord& rec, UpdateThreads&) {
  return push_ranges(grads, false, rec);
}

int64_t RemoteParameterStore::skip(UpdateRecord& rec) { return push_ranges(nullptr, true, rec); }

const float* RemoteParameterStore::host_params() {
  PullRequest req;
  req.set_layout_hash(hash_);
  req.set_with_slots(true);
  // sync: every shard at one round (with backup workers, rounds go on while the chief reads),
  // read as this worker at its rollback generation: a shard that has gone back to an earlier
  // round refuses it with the rollback, which the run then takes.
  const bool sync = cfg_.mode == "sync";
  const bool member = sync && reads_as_worker_.load();
  req.set_worker(member ? cfg_.rank : -1);
  if (member) req.set_generation(generation_.load());
  const std::vector<ShardSet::Pulled> reps = member
      ? adopting_rollbacks([&] { return shards_->pull_all(req, sync, cfg_.rpc_timeout); })
      : shards_->pull_all(req, sync, cfg_.rpc_timeout);
  const auto names = opt_.slot_names();
  for (int i = 0; i < shards_->size(); ++i) {
    const Range& g = ranges_[i];
    const PullReply& head = reps[i].head;
    const size_t bytes = sizeof(float) * static_cast<size_t>(g.size());
    TOWERS_REQUIRE(reps[i].params.size() == bytes &&
                       static_cast<size_t>(head.slots_size()) == names.size(),
                   "ps:{}: a pull with slots does not fit its range", i);
    reps[i].params.copy_to(params_ + g.begin);
    for (size_t s = 0; s < names.size(); ++s) {
      TOWERS_REQUIRE(head.slots(static_cast<int>(s)).size() == bytes,
                     "ps:{}: a pull with slots does not fit its range", i);
      std::memcpy(opt_.slot(names[s]) + g.begin, head.slots(static_cast<int>(s)).data(), bytes);
    }
  }
  opt_.load_state({{"name", opt_.config().name}, {"updates", reps[0].head.updates()}});
  int64_t v = reps[0].head.version();
  for (const auto& r : reps) v = std::min(v, r.head.version());
  version_.store(std::max(version_.load(), v));
  return params_;
}

template <class Call>
auto RemoteParameterStore::adopting_rollbacks(Call call) -> decltype(call()) {
  try {
    return call();
  } catch (const RollbackError& e) {
    const Rollback r = roll_back(e.rollback);
    throw RollbackError(fmt::format("{}; every shard went back to round {} (rollback generation "
                                    "{})", e.what(), r.version, r.generation),
                        r);
  }
}

Rollback RemoteParameterStore::roll_back(Rollback r) {
  std::lock_guard<std::mutex> l(rollback_mu_);
  for (int tries = 0;; ++tries) {
    // A later one taken meanwhile (by another tower's call) stands; this one's Restore is
    // asked again (a shard that has done it answers at once; one that has not yet loaded it
    // loads it).
    if (generation_.load() > r.generation) return {version_.load(), generation_.load()};
    TOWERS_REQUIRE(tries < 16, "the shards kept asking for rollbacks (the last: to round {}, "
                   "generation {}); continue the run from the chief's checkpoint with --resume",
                   r.version, r.generation);
    std::vector<RestoreRequest> reqs(shards_->size());
    std::vector<RestoreReply> reps(shards_->size());
    for (RestoreRequest& q : reqs) {
      q.set_layout_hash(hash_);
      q.set_version(r.version);
      q.set_generation(r.generation);
    }
    try {
      shards_->all("Restore", cfg_.rpc_timeout, [&](int i, ShardSet::Contexts ctx, auto done) {
        shards_->stub(i).async()->Restore(ctx[0], &reqs[i], &reps[i], std::move(done));
      });
    } catch (const RollbackError& later) {  // a shard is at a later rollback: that one
      r = later.rollback;
      continue;
    }
    version_.store(r.version);
    generation_.store(r.generation);
    return r;
  }
}

std::vector<std::string> RemoteParameterStore::save_shards(int64_t version) {
  std::vector<SaveRequest> reqs(shards_->size());
  std::vector<SaveReply> reps(shards_->size());
  for (auto& r : reqs) r.set_version(version);
  shards_->all("Save", cfg_.rpc_timeout, [&](int i, ShardSet::Contexts ctx, auto done) {
    shards_->stub(i).async()->Save(ctx[0], &reqs[i], &reps[i], std::move(done));
  });
  std::vector<std::string> paths;
  for (const SaveReply& r : reps) paths.push_back(r.path());
  return paths;
}

void RemoteParameterStore::take_back(int64_t version) {
  std::vector<TakeBackRequest> reqs(shards_->size());
  std::vector<TakeBackReply> reps(shards_->size());
  for (auto& r : reqs) {
    r.set_layout_hash(hash_);
    r.set_version(version);
  }
  shards_->all("TakeBack", cfg_.rpc_timeout, [&](int i, ShardSet::Contexts ctx, auto done) {
    shards_->stub(i).async()->TakeBack(ctx[0], &reqs[i], &reps[i], std::move(done));
  });
}

std::vector<int> RemoteParameterStore::lost_workers() {
  const int workers = cfg_.cluster.workers();
  const auto until = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                        std::chrono::duration<double>(cfg_.heartbeat_timeout + 30.0));
  std::set<int> lost;
  for (;;) {
    std::set<int> done;
    lost.clear();
    bool reached = false;
    for (int i = 0; i < shards_->size(); ++i) {
      InfoRequest req;
      InfoReply rep;
      auto ctx = call_context(cfg_.token, 10.0);
      if (!shards_->stub(i).Info(ctx.get(), req, &rep).ok()) continue;  // gone: nothing to say
      reached = true;
      lost.insert(rep.lost_workers().begin(), rep.lost_workers().end());
      done.insert(rep.done_workers().begin(), rep.done_workers().end());
    }
    int settled = 1;  // this worker
    for (int w = 0; w < workers; ++w)
      if (w != cfg_.rank && (done.count(w) || lost.count(w))) ++settled;
    if (!reached || settled == workers || Clock::now() >= until) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return {lost.begin(), lost.end()};
}

int64_t RemoteParameterStore::dropped() {
  int64_t d = 0;
  InfoRequest req;
  InfoReply rep;
  auto ctx = call_context(cfg_.token, 10.0);
  if (shards_->stub(0).Info(ctx.get(), req, &rep).ok()) d = rep.dropped();
  return d;
}

void RemoteParameterStore::reset_clocks(int towers) {
  clocks_ = std::make_unique<std::atomic<int64_t>[]>(towers);
  for (int t = 0; t < towers; ++t) clocks_[t].store(0);
  n_clocks_ = towers;
  worker_clock_.store(0);
}
int64_t RemoteParameterStore::tick(int tower) {
  TOWERS_CHECK(tower >= 0 && tower < n_clocks_, "no tower {}", tower);
  const int64_t c = ++clocks_[tower];
  // (Racing ticks may store an older minimum: the shards keep the largest they hear.)
  worker_clock_.store(min_clock());
  return c;
}
int64_t RemoteParameterStore::min_clock() const {
  int64_t m = n_clocks_ == 0 ? 0 : std::numeric_limits<int64_t>::max();
  for (int t = 0; t < n_clocks_; ++t) m = std::min(m, clocks_[t].load());
  return m;
}

}  // namespace towers::remote
