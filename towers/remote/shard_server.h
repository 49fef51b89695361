// shard_server.h — `towers ps`: one parameter-server shard of a remote tower group.
//
// A shard holds the range shard_ranges(total, shards)[index] of the flat parameter array and
// the optimizer slots of that range. The chief initialises it (Init); workers push gradients
// of the range and pull its parameters. How a push is applied is the run's mode, as in one
// process (DESIGN.md, "Modes of a run"):
//   sync     a round (a version) is applied once K workers' gradients for it have arrived
//            (K = --replicas-to-aggregate, or every worker), summed over the workers in rank
//            order by the fixed tree of kernels/reduce.h; pulls of the next round wait for it.
//            Gradients arrive in pieces (PushStream); with every worker counted, each piece is
//            applied as soon as every worker's copy of it is here, while later pieces are
//            still on the wire (README, decision 54).
//            Later gradients of an applied round are dropped and counted. A worker that is
//            lost while a round needs it fails the round's waiting calls with its name; a round
//            it left applied in part, or complete on some shards only, is taken back
//            (README, decision 79).
//   async    every push is applied at once (Hogwild: relaxed atomics; use_locking serialises
//            the apply per variable), concurrently with pulls.
//   ssp      as async, but a pull waits while the puller's clock is more than the bound
//            ahead of the slowest live worker's.
// A worker that makes no call (heartbeats included) for the heartbeat timeout is lost: out of
// the SSP minimum, no longer waited for by backup-worker rounds. The shard exits once every
// worker has said it is done or has been lost, or on Shutdown.
// With --checkpoint-dir the shard writes its range when the chief checkpoints (Save), and a
// shard killed and started again with the same flags restores its latest; the workers' calls
// retry an unreachable shard until their deadline, so they reconnect to the new one. Async
// and SSP go on from there (the shard's updates since its checkpoint are lost: more
// staleness). In sync the other shards are rounds ahead: the restarted shard refuses the
// workers' calls with a rollback to its round, and a worker asks every shard to restore its
// own checkpoint of that round (Restore; towers.proto, README decision 57).
#pragma once

#include <string>

#include "towers/remote/cluster.h"
#include "towers/remote/rpc.h"

namespace towers::remote {

struct ShardOptions {
  Cluster cluster;
  int index = 0;                    // ps:index
  std::string bind = "127.0.0.1";   // the address to listen on; the port is the cluster's
  std::string token;
  std::string read_token;  // optional: allows Info and readers' pulls only (towers pull / eval)
  TlsFiles tls;
  bool quiet = false;
  // Where Save writes this shard's checkpoints (ps-I-VERSION.ckpt, the last three), where a
  // restarted shard finds its latest (it then serves again from that version without the
  // chief's Init), and where a sync rollback finds the round it goes back to. Empty: no
  // checkpoints.
  std::string checkpoint_dir;
  // `towers ps`: once the shard has finished (every worker done, its checkpoint written), the
  // process exits at once, without gRPC's library teardown, whose backup poller may sleep for
  // up to 10 s before it lets the process go. Shards run as threads of a benchmark or a test
  // leave it off.
  bool exit_process_when_done = false;
};

// Serves until the run is over; returns the process's exit code.
int run_shard(const ShardOptions& o);

}  // namespace towers::remote
