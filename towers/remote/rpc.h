// rpc.h — what every process of a remote tower group shares about its gRPC calls: the token
// in each call's metadata, TLS credentials, message limits, and errors that name the peer.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include <grpcpp/grpcpp.h>

#include "core/check.h"

namespace towers::remote {

// The metadata entry that carries the run's token in every call.
inline constexpr const char* kTokenKey = "towers-token";
// Messages up to 1 GiB: a shard's range of a large model travels in one message.
inline constexpr int kMaxMessageBytes = 1 << 30;

// --tls-cert/--tls-key/--tls-ca: PEM files. All three, or none (plain TCP).
struct TlsFiles {
  std::string cert, key, ca;
  bool enabled() const { return !cert.empty() || !key.empty() || !ca.empty(); }
};
// Checks the three are given together and readable; errors name the flag.
void check_tls(const TlsFiles& tls);
std::shared_ptr<grpc::ServerCredentials> server_credentials(const TlsFiles& tls);
// The HTTP/2 settings of both sides for messages of megabytes on fast links: a large flow-control
// lookahead and frame size, so that a message is not sent in 64 KiB windows of round trips.
void tune(grpc::ChannelArguments& args);
void tune(grpc::ServerBuilder& builder);
// connection: channels to one address with different numbers get TCP connections of their own
// (gRPC otherwise shares one connection between channels with the same settings).
std::shared_ptr<grpc::Channel> open_channel(const std::string& address, const TlsFiles& tls,
                                            int connection = 0);

// Message buffers of megabytes are allocated and freed on every call. glibc would map and
// unmap each one (and fault in and clear every page again), which costs more than sending it;
// this makes the process keep freed memory for reuse instead (mallopt: no mmap below 1 GiB,
// no trimming below 2 GiB, the heap grown 256 MiB at a time). Called by every shard and remote worker process.
void keep_message_buffers();

// A client context with the token and a deadline of `seconds` from now.
std::unique_ptr<grpc::ClientContext> call_context(const std::string& token, double seconds);

// "UNAVAILABLE: failed to connect ..." for an error message.
std::string describe(const grpc::Status& s);

// A sync run's rollback (towers.proto, RestoreRequest): every shard goes back to `version`,
// the restored checkpoint of a restarted shard, at rollback generation `generation`.
struct Rollback {
  int64_t version = 0;
  int64_t generation = 0;
};
// The status a shard refuses a call with when the caller must adopt rollback r first: ABORTED,
// with `why` as its message and r in its details.
grpc::Status rollback_status(const Rollback& r, const std::string& why);
// The rollback a status asks for, if it is one.
std::optional<Rollback> rollback_of(const grpc::Status& s);

// A worker's call refused with a rollback: the worker's store asks every shard to restore it
// (RemoteParameterStore), and its run goes on from that round.
class RollbackError : public Error {
 public:
  RollbackError(const std::string& what, Rollback r) : Error(what), rollback(r) {}
  Rollback rollback;
};

}  // namespace towers::remote
