#include "towers/remote/rpc.h"

#include <malloc.h>

#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include <algorithm>

#include "core/check.h"

namespace towers::remote {

namespace {

std::string read_pem(const std::string& path, const char* flag) {
  std::ifstream in(path);
  TOWERS_REQUIRE(in.good(), "{}: cannot read '{}'", flag, path);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  TOWERS_REQUIRE(text.find("-----BEGIN ") != std::string::npos,
                 "{}: '{}' is not a PEM file (no -----BEGIN line)", flag, path);
  return text;
}

}  // namespace

void check_tls(const TlsFiles& tls) {
  if (!tls.enabled()) return;
  TOWERS_REQUIRE(!tls.cert.empty() && !tls.key.empty() && !tls.ca.empty(),
                 "TLS needs all of --tls-cert, --tls-key and --tls-ca (given: {}{}{})",
                 tls.cert.empty() ? "" : "--tls-cert ", tls.key.empty() ? "" : "--tls-key ",
                 tls.ca.empty() ? "" : "--tls-ca");
  read_pem(tls.cert, "--tls-cert");
  read_pem(tls.key, "--tls-key");
  read_pem(tls.ca, "--tls-ca");
}

std::shared_ptr<grpc::ServerCredentials> server_credentials(const TlsFiles& tls) {
  if (!tls.enabled()) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions o(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  o.pem_root_certs = read_pem(tls.ca, "--tls-ca");
  o.pem_key_cert_pairs.push_back({read_pem(tls.key, "--tls-key"), read_pem(tls.cert, "--tls-cert")});
  return grpc::SslServerCredentials(o);
}

namespace {
constexpr int kLookaheadBytes = 64 << 20;
constexpr int kMaxFrameBytes = 16 << 20;  // HTTP/2's largest
}  // namespace

void tune(grpc::ChannelArguments& args) {
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, kLookaheadBytes);
  args.SetInt(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, kMaxFrameBytes);
  // A shard that is starting, or restarting, is connected to within a second of listening,
  // not after gRPC's default backoff (1 s, growing to two minutes).
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
}

void tune(grpc::ServerBuilder& builder) {
  builder.AddChannelArgument(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, kLookaheadBytes);
  // A shard receives pushes: its streams' windows stay at the lookahead. gRPC's BDP probing
  // would keep them near its estimate of the link's bandwidth-delay product, which on loopback
  // (a round trip of microseconds) is far below a 1 MiB piece, so that the worker waits for
  // window updates (decision 66). 64 MiB is more than a fast network's product (10 Gbit/s x
  // 50 ms is 62 MB). A worker receives pulls, and keeps the probing: with it off, a pull from
  // one shard process measured 5-10% slower.
  builder.AddChannelArgument(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, kMaxFrameBytes);
}

std::shared_ptr<grpc::Channel> open_channel(const std::string& address, const TlsFiles& tls,
                                            int connection) {
  grpc::ChannelArguments args;
  tune(args);
  if (connection > 0) args.SetInt("towers.connection", connection);
  args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  args.SetMaxSendMessageSize(kMaxMessageBytes);
  std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
  if (tls.enabled()) {
    grpc::SslCredentialsOptions o;
    o.pem_root_certs = read_pem(tls.ca, "--tls-ca");
    o.pem_private_key = read_pem(tls.key, "--tls-key");
    o.pem_cert_chain = read_pem(tls.cert, "--tls-cert");
    creds = grpc::SslCredentials(o);
  }
  return grpc::CreateCustomChannel(address, creds, args);
}

void keep_message_buffers() {
  mallopt(M_MMAP_THRESHOLD, 1 << 30);
  mallopt(M_TRIM_THRESHOLD, 0x7fffffff);
  mallopt(M_TOP_PAD, 256 << 20);
}

std::unique_ptr<grpc::ClientContext> call_context(const std::string& token, double seconds) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->AddMetadata(kTokenKey, token);
  ctx->set_deadline(std::chrono::system_clock::now() +
                    std::chrono::microseconds(static_cast<int64_t>(seconds * 1e6)));
  return ctx;
}

std::string describe(const grpc::Status& s) {
  static const char* names[] = {"OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT",
                                "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
                                "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
                                "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL",
                                "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED"};
  const int c = static_cast<int>(s.error_code());
  return fmt::format("{}: {}", c >= 0 && c <= 16 ? names[c] : "?", s.error_message());
}

namespace {
constexpr const char* kRollbackTag = "towers-rollback";
}  // namespace

grpc::Status rollback_status(const Rollback& r, const std::string& why) {
  return {grpc::StatusCode::ABORTED, why,
          fmt::format("{} {} {}", kRollbackTag, r.version, r.generation)};
}

std::optional<Rollback> rollback_of(const grpc::Status& s) {
  if (s.error_code() != grpc::StatusCode::ABORTED) return std::nullopt;
  std::istringstream in(s.error_details());
  std::string tag;
  Rollback r;
  if (!(in >> tag >> r.version >> r.generation) || tag != kRollbackTag || r.version < 0 ||
      r.generation < 1)
    return std::nullopt;
  return r;
}

}  // namespace towers::remote
