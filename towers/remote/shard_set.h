// shard_set.h — a client's channels to every shard of a remote tower group, and calls to all
// of them at once: what the worker's store (remote_store.h) and the readers of the live model
// (reader.h) share.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <grpcpp/generic/generic_stub.h>

#include "towers/remote/cluster.h"
#include "towers/remote/rpc.h"
#include "towers/remote/towers.grpc.pb.h"
#include "towers/remote/wire.h"

namespace towers::remote {

class ShardSession;   // a worker's stream of calls to one connection of a shard (shard_set.cpp)
struct SessionCount;  // the sessions of a ShardSet still alive

class ShardSet {
 public:
  // addresses: the cluster's ps entries; token: what every call carries; stripes: how many
  // TCP connections to each shard a push or pull may use at once (wire.h, kStripeKey);
  // sessions: pushes and pulls go on sessions that stay open (PushSession, PullSession).
  ShardSet(std::vector<std::string> addresses, std::string token, const TlsFiles& tls,
           int stripes = 1, bool sessions = false);
  // Closes the sessions (a shard ends them too when it exits).
  ~ShardSet();
  ShardSet(const ShardSet&) = delete;
  ShardSet& operator=(const ShardSet&) = delete;
  int size() const { return static_cast<int>(stubs_.size()); }
  Shard::Stub& stub(int i) { return *stubs_[i]; }
  // Streams started by push and pull_streams (a striped call's count one each; a push on
  // sessions counts its stripes too, whether a session was opened for it or not).
  int64_t streams() const { return streams_.load(); }
  // Sessions opened so far, pushes' and pulls' (one a stripe and kind at first; another after
  // each that failed).
  int64_t sessions_opened() const { return sessions_opened_.load(); }
  // For the raw calls (wire.h: Push and Pull without copies of their floats); connection k of
  // shard i (0: the one every other call uses).
  grpc::GenericStub& generic(int i, int k = 0) { return *generics_[i][k]; }
  const std::string& token() const { return token_; }

  // The error of shard i's call, naming the shard, what was asked and what to check.
  [[noreturn]] void fail(int i, const char* what, const grpc::Status& s) const;

 private:
  // The replies of pushes (a stripe's buffers per shard) into replies; throws for a reply
  // that does not decode, or a push that no stripe (or more than one) ended.
  void decode_replies(const std::vector<std::vector<grpc::ByteBuffer>>& in,
                      std::vector<PushReply>& replies) const;
  // Sessions carry pushes (PushSession) or pulls (PullSession), each kind in a pool of its own.
  enum SessionKind { kPushes = 0, kPulls = 1 };
  std::shared_ptr<ShardSession> take_session(SessionKind kind, int i, int k);
  void keep_session(SessionKind kind, int i, int k, std::shared_ptr<ShardSession> s);
  // One stripe's part of a call on a session: its messages, and what takes its replies (true
  // once it has them all; an error refuses a reply, and fails the stripe with it).
  struct Job {
    std::vector<grpc::ByteBuffer> messages;
    std::function<bool(grpc::ByteBuffer&, grpc::Status*)> take;
  };
  // Stripe k of shard i's s, in an attempt of id (new for every attempt) with timeout_ms
  // left to its deadline.
  using MakeJob = std::function<Job(int i, int k, int s, uint64_t id, int64_t timeout_ms)>;
  // A call to every shard at once on sessions (all(), with its retries and rollbacks): shard
  // i's in stripes[i] jobs, each on a session of its own, taken from the pool and given back
  // once its job succeeded.
  void on_sessions(SessionKind kind, const char* what, double timeout,
                   const std::vector<int>& stripes, const MakeJob& make_job);

 public:
  // Starts call(i, contexts, done) on every shard at once (the stub's callback API) and waits
  // for all; throws the first failure. Shard i's call gets calls[i] contexts (default 1; a
  // striped call's streams, one each), with the token and the deadline; a rollback cancels
  // every one of them. A shard that is unreachable (down, or restarting) is called again
  // every 200 ms until the deadline: a restarted shard is reconnected to.
  // Calls that do not run on the contexts (pushes on sessions) give `cancel`: all() calls it
  // where it cancels the contexts, and at the deadline (plus a margin for the shards' own
  // answers), after which a call that ends CANCELLED counts as DEADLINE_EXCEEDED.
  using Contexts = std::span<grpc::ClientContext* const>;
  using Start = std::function<void(int, Contexts, std::function<void(grpc::Status)>)>;
  void all(const char* what, double timeout, const Start& start, const std::vector<int>& calls = {},
           const std::function<void()>& cancel = {});

  // Pulls every shard's range at once, as `request` asks (a reader's pull: worker -1). With
  // one_round (sync mode), every shard is read at the same version: a round may complete
  // between two shards' replies, and then all are read again, waiting for the highest.
  // Each reply's parameters stay in its received slices (Pulled::params) until copied.
  struct Pulled {
    PullReply head;  // all but the parameters
    Bulk params;
  };
  std::vector<Pulled> pull_all(PullRequest request, bool one_round, double timeout);

  // A push to one shard: the small fields of its messages, and its floats in pieces (offset in
  // the range, floats); no pieces: one message without floats (a push that skips its round).
  struct PushOut {
    PushRequest head;
    std::vector<std::pair<int64_t, grpc::Slice>> pieces;
  };
  // Pushes to every shard at once: out[i] is shard i's; each reply is decoded into
  // replies[i]. With stripes, a shard's pieces travel as that many streams on connections of
  // their own (fewer for a range of fewer pieces): PushSessions kept open from push to push
  // (sessions), or a PushStream each. The pieces' slices may be lent: they stay in use until
  // gRPC lets go of them.
  void push(const std::vector<PushOut>& out, std::vector<PushReply>& replies, double timeout);
  // PushStream to every shard at once: messages[i] are shard i's (its pieces, in order, one a
  // message), as push() sends them without sessions.
  void push_streams(const std::vector<std::vector<grpc::ByteBuffer>>& messages,
                    std::vector<PushReply>& replies, double timeout);
  // PullStream from every shard at once (in stripes, as pushes are; pieces of `piece` floats):
  // shard i's range, ranges[i], is copied into dst (the flat array) piece by piece as the
  // pieces arrive, on the gRPC thread that received each
  // (handing the copies to the waiting thread instead cost a wake-up per piece: 4 MiB pulls
  // were 8% slower from one shard and 25% from two on a 2-core machine). Returns each
  // shard's version.
  std::vector<int64_t> pull_streams(const PullRequest& request, const std::vector<Range>& ranges,
                                    int64_t piece, float* dst, double timeout);

 private:
  std::vector<std::string> addresses_;
  std::string token_;
  std::vector<std::atomic<bool>> unreachable_;
  std::vector<std::atomic<bool>> answered_;  // [shard]: a call of all() to it has succeeded
  int stripes_ = 1;
  std::atomic<uint64_t> next_push_;  // the id of a striped push's next attempt
  std::atomic<int64_t> streams_{0};  // PushStreams and PullStreams started
  std::atomic<int64_t> sessions_opened_{0};
  bool sessions_ = false;
  // Sessions between calls: [kind * shards + shard][connection], any number (pushes of several
  // towers at once each take their own). Held by shared pointers: a session lives until its
  // call is over.
  std::mutex idle_mu_;
  std::vector<std::vector<std::vector<std::shared_ptr<ShardSession>>>> idle_;
  std::vector<std::weak_ptr<ShardSession>> opened_;  // every session alive (under idle_mu_)
  // The destructor waits until no session is alive: a session's call holds a reference to
  // its channel, and the channel must not be destroyed on one of gRPC's callback threads
  // (the last reference going there shuts down the callbacks' queue from its own thread).
  std::shared_ptr<SessionCount> live_;
  std::vector<std::vector<std::shared_ptr<grpc::Channel>>> channels_;  // [shard][connection]
  std::vector<std::unique_ptr<Shard::Stub>> stubs_;
  std::vector<std::vector<std::unique_ptr<grpc::GenericStub>>> generics_;
};

}  // namespace towers::remote
