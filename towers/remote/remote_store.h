// remote_store.h — the parameters of a remote tower group, held by parameter-server shards in
// other processes (towers/remote/shard_server.h), behind the ParameterStore seam.
//
// A worker process runs its T local towers with the same step driver and modes as one
// process; only the store differs:
//   pull(tower)   fetches every shard's range (in parallel) into the tower's own host buffer
//                 and loads the tower from it; sync pulls ask for the current round, so they
//                 wait at the shards for the round's barrier; SSP pulls carry the tower's
//                 clock, so they wait while it is too far ahead of the slowest live worker
//   push          sends each shard its range of the gradient (already summed over the local
//                 towers by the fixed tree: node-local aggregation). Sync pushes return once
//                 the round is applied, with the round's totals over every worker
//   host_params   the chief's evaluation and checkpoints: every shard's range, with the
//                 optimizer slots and update count, into the trainer's host arrays
// Every call has a deadline (--rpc-timeout) and carries the token. A heartbeat thread keeps
// the worker alive at the shards while it computes.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "optim/optimizer.h"
#include "towers/parameter_store.h"
#include "towers/remote/cluster.h"
#include "towers/remote/rpc.h"

namespace towers::remote {

struct RemoteConfig {
  Cluster cluster;
  int rank = 0;  // this worker's training rank (0: the chief)
  std::string token;
  TlsFiles tls;
  double rpc_timeout = 300.0;       // seconds: every call's deadline, waits at a barrier included
  double heartbeat_timeout = 10.0;  // seconds without a call before a shard counts a worker lost
  std::string mode = "sync";        // sync | async | ssp
  int replicas_to_aggregate = 0;    // sync: workers per round (0: all)
  int64_t staleness = 0;
  bool use_locking = false;
  std::string run_id;               // the chief's run, sent with Init
  std::string model;                // sent with Init, for readers of the live parameters
  std::string config;               // the run's configuration (JSON), likewise
  // Pushes and pulls travel in pieces of this many floats (the chief's is sent with Init and
  // every worker takes the shards'); 0: kDefaultPieceFloats.
  int64_t piece_floats = 0;
  // A push to a shard, and a pull from it, travel on this many TCP connections at once, each
  // carrying a run of its pieces (wire.h, kStripeKey).
  int stripes = 4;
  // Pushes and pulls go on sessions (PushSession, PullSession) that stay open from call to
  // call (a stream a shard, stripe and kind), rather than on a call each (decision 75).
  bool sessions = true;
};

class ShardSet;  // the channels and stubs (shard_set.h)

class RemoteParameterStore final : public ParameterStore {
 public:
  // params and opt: the trainer's host copy (the chief initialises the shards from them, and
  // host_params refreshes them); opt's configuration is sent to the shards.
  RemoteParameterStore(RemoteConfig cfg, const ParameterLayout& layout, float* params,
                       Optimizer& opt, UpdateAccess access);
  ~RemoteParameterStore() override;

  // The chief: sends every shard its range of the parameters and slots, at version; waits
  // (up to the rpc timeout) for shards that are still starting.
  void initialize_shards(int64_t version);
  // Every worker: waits until every shard serves this run's layout, then pulls the
  // parameters into the host copy; returns the version the shards are at.
  int64_t join();
  // The chief at the end of its run: waits (up to the heartbeat timeout and a grace period)
  // until every other worker has said it is done or a shard has counted it lost, and returns
  // the lost ones, over all shards.
  std::vector<int> lost_workers();
  int64_t dropped();
  // The chief's checkpoint at version: every shard with a --checkpoint-dir saves its range
  // there too. Returns each shard's file (empty for a shard without a checkpoint dir).
  std::vector<std::string> save_shards(int64_t version);
  // Plain sync, a run that stops on a lost worker: every shard holds `version`, this worker's
  // last complete round, again; a shard that completed the next round, which the lost worker
  // left incomplete on another, takes it back (TakeBackRequest, towers.proto).
  void take_back(int64_t version);
  // Tells the shards this worker is done (also done by the destructor).
  void finish();
  // Where this worker's time went at the store: calls and seconds of pulls and of pushes (a
  // sync push includes the wait at the barrier for the other workers, which push_wait_seconds
  // gives apart: the shards' own count of it), over all towers; and the gRPC streams its
  // pushes and pulls used (`streams`: a stripe's count one each, decision 68).
  nlohmann::json timing() const;

  // What a tower's pull reads (sync: the current round, waited for), into dst (the flat
  // array), without loading a tower: pull() and the transport benchmark.
  int64_t pull_into(float* dst) { return fetch(dst, -1); }
  // The size of the pieces that pushes and pulls travel in, as the shards serve them.
  int64_t piece_floats() const { return piece_; }
  // Sync: the rollback generation this worker is at (towers.proto, RestoreRequest).
  int64_t generation() const { return generation_.load(); }
  // Sync, while the run's steps go on (the trainer's loop): host_params reads the shards as
  // this worker at its generation, so that a shard that has gone back to an earlier round
  // refuses, and the rollback is taken (RollbackError). Otherwise (joining, the end of the
  // run) it reads as a reader, and changes nothing at the shards.
  void read_as_worker(bool on) { reads_as_worker_.store(on); }

  int64_t version() const override { return version_.load(); }
  UpdateAccess access() const override { return access_; }
  void restore_version(int64_t v) override { version_.store(v); }
  void attach(const std::vector<Tower*>& towers) override;
  int64_t pull(Tower& tower) override;
  int64_t push(const float* grads, UpdateRecord& rec, UpdateThreads& on) override;
  int64_t skip(UpdateRecord& rec) override;
  void wait(int64_t) override {}  // a push returns once it is applied
  const float* host_params() override;
  void reset_clocks(int towers) override;
  int64_t tick(int tower) override;
  int64_t clock(int tower) const override { return clocks_[tower].load(); }
  int64_t min_clock() const override;
  bool shared_by_processes() const override { return true; }

 private:
  int64_t push_ranges(const float* grads, bool skip, UpdateRecord& rec);
  // A call of this worker was refused with rollback r: asks every shard to restore r's round
  // (adopting any later rollback a shard answers with), and takes the round as the store's
  // version. Returns the rollback adopted; a later one adopted meanwhile by another tower's
  // call is returned as it is.
  Rollback roll_back(Rollback r);
  // Runs call(); a rollback it meets is adopted (roll_back), then thrown on, so that the run
  // goes on from its round.
  template <class Call>
  auto adopting_rollbacks(Call call) -> decltype(call());
  // The parameters into dst, for tower ti (ssp: its clock; -1: the slowest tower's).
  int64_t fetch(float* dst, int ti, std::vector<int64_t>* versions = nullptr);
  int tower_index(const Tower& t) const;

  RemoteConfig cfg_;
  const ParameterLayout& layout_;
  float* params_;
  Optimizer& opt_;
  UpdateAccess access_;
  uint64_t hash_;
  std::vector<Range> ranges_;
  int64_t piece_ = 0;  // join(): the shards' RunSpec.piece_floats
  std::unique_ptr<ShardSet> shards_;
  std::atomic<int64_t> version_{0};
  std::atomic<int64_t> generation_{0};
  std::atomic<bool> reads_as_worker_{false};
  std::mutex rollback_mu_;  // one roll_back at a time
  std::vector<Tower*> towers_;
  std::vector<HostBuffer> pulled_;         // per tower: the parameters as pulled
  // per tower: each shard's version at its last pull (async, ssp: the round of each shard's
  // push, from which the shard counts the staleness)
  std::vector<std::vector<int64_t>> shard_read_;
  std::unique_ptr<std::atomic<int64_t>[]> clocks_;  // per tower; read by other towers' pushes
  int n_clocks_ = 0;
  std::atomic<int64_t> worker_clock_{0};  // min_clock() at the last tick, for the heartbeats
  std::atomic<bool> stop_{false}, finished_{false};
  std::atomic<int64_t> pulls_{0}, pushes_{0}, pull_ns_{0}, push_ns_{0};
  std::atomic<int64_t> push_wait_ns_{0};  // sync: of push_ns_, the waits at the barrier
  std::thread heartbeat_;
};

}  // namespace towers::remote
