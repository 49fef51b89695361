// wire.h — the bulk calls of the shard protocol (Push and Pull) without copies of the floats.
//
// gRPC's protobuf path copies a `bytes` field of megabytes four times: into the message
// (set_grads), into the serialized buffer, out of the received buffer into the parsed message,
// and out of that into where the floats are used. These helpers keep towers.proto's wire format
// (so any protobuf client still talks to a shard) but move the one bulk field of a message as
// gRPC slices of its own:
//   - encode() serialises the small fields and appends the bulk field as a slice of the
//     caller's memory (lent, not copied) or of a buffer the slice owns;
//   - decode() parses the small fields and leaves the bulk field where it arrived, in the
//     received slices, to be copied once to where it is used.
// Protobuf allows a message's fields in any order, and for a field sent twice the last wins;
// decode() follows both rules.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <google/protobuf/message_lite.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

namespace towers::remote {

// The full names of the raw methods, as gRPC routes them.
inline constexpr const char* kPushMethod = "/towers.remote.Shard/Push";
inline constexpr const char* kPullMethod = "/towers.remote.Shard/Pull";
inline constexpr const char* kPushStreamMethod = "/towers.remote.Shard/PushStream";
inline constexpr const char* kPullStreamMethod = "/towers.remote.Shard/PullStream";
inline constexpr const char* kPushSessionMethod = "/towers.remote.Shard/PushSession";
inline constexpr const char* kPullSessionMethod = "/towers.remote.Shard/PullSession";
// RunSpec.piece_floats when the chief gives none: 1 MiB pieces.
inline constexpr int64_t kDefaultPieceFloats = 1 << 18;

// Calls f(lo, hi) for the pieces [lo, hi) of a range of n floats in order, pieces of `piece`
// floats and a shorter last one; an empty range is one empty piece (its message still carries
// the small fields). Stops early when f returns false.
template <class F>
void for_each_piece(int64_t n, int64_t piece, F f) {
  for (int64_t lo = 0; lo == 0 || lo < n; lo += piece)
    if (!f(lo, lo + piece < n ? lo + piece : n)) return;
}
// The same for the pieces of floats [begin, end) of a range (a stripe's: stripe_floats).
template <class F>
void for_each_piece(int64_t begin, int64_t end, int64_t piece, F f) {
  for (int64_t lo = begin; lo == begin || lo < end; lo += piece)
    if (!f(lo, lo + piece < end ? lo + piece : end)) return;
}

// A push to one shard, and a pull from it, may travel in stripes: PushStreams (PullStreams) at
// once, each on a TCP connection of its own (one gRPC stream to a process is bound by its
// connection's threads well below what TCP carries; decision 68). Stripe k of s carries the
// range's pieces [P k / s, P (k + 1) / s) of its P pieces, in order. Each stripe's call says
// which it is in the metadata entry kStripeKey: "ID K S", with the push's id (the same for its
// stripes, new for every attempt; a pull's is not read).
inline constexpr const char* kStripeKey = "towers-stripe";
inline constexpr int kMaxStripes = 16;
struct Stripe {
  uint64_t push = 0;
  int k = 0, s = 1;
};
// The messages a range of n floats travels in (for_each_piece): its pieces, or one empty
// message for an empty range.
inline int64_t messages_of(int64_t n, int64_t piece) { return n == 0 ? 1 : (n + piece - 1) / piece; }
// Floats [first, second) of a range of n floats (pieces of `piece`) that stripe k of s carries.
inline std::pair<int64_t, int64_t> stripe_floats(int64_t n, int64_t piece, int k, int s) {
  const int64_t pieces = messages_of(n, piece);
  const int64_t a = pieces * k / s, b = pieces * (k + 1) / s;
  return {a * piece < n ? a * piece : n, b * piece < n ? b * piece : n};
}
std::string stripe_metadata(const Stripe& s);
// Parses a kStripeKey entry; false (with *error saying why) for one that is not "ID K S" with
// 0 <= K < S <= kMaxStripes.
bool parse_stripe(const std::string& text, Stripe* out, std::string* error);

// Memory of the caller lent to gRPC as slices. A slice's memory must stay unchanged until gRPC
// lets go of it, which may be after the call's completion: wait_returned() (and the
// destructor) block until gRPC holds none of the slices lent. Declare the Lender before the
// ByteBuffers that hold its slices, so that they are destroyed first.
class Lender {
 public:
  Lender() = default;
  Lender(const Lender&) = delete;
  Lender& operator=(const Lender&) = delete;
  ~Lender() { wait_returned(); }
  grpc::Slice lend(const void* data, size_t bytes);
  void wait_returned();

 private:
  static void returned(void* self);
  std::mutex mu_;
  std::condition_variable cv_;
  int out_ = 0;
};

// A slice that owns a fresh, uninitialised buffer of `bytes`, and where to write it.
struct OwnedSlice {
  grpc::Slice slice;
  std::byte* data = nullptr;
};
OwnedSlice owned_slice(size_t bytes);

// `head` (whose bulk field must be empty) followed by field number `field` holding `bulk`.
// A null `bulk` pointer sends no bulk field at all.
grpc::ByteBuffer encode(const google::protobuf::MessageLite& head, int field,
                        const grpc::Slice* bulk);
inline grpc::ByteBuffer encode(const google::protobuf::MessageLite& head) {
  return encode(head, 0, nullptr);
}

// Where a decoded message's bulk field lies in the received buffer.
class Bulk {
 public:
  bool present() const { return present_; }
  size_t size() const { return size_; }
  // Copies the field's bytes to dst (size() of them).
  void copy_to(void* dst) const;
  // Copies bytes [from, from + bytes) of the field to dst.
  void copy_range(void* dst, size_t from, size_t bytes) const;
  // The field's bytes if they arrived in one slice, else nullptr.
  const std::byte* contiguous() const;

 private:
  friend bool decode(const grpc::ByteBuffer&, int, google::protobuf::MessageLite&, Bulk&,
                     std::string*);
  std::vector<grpc::Slice> slices_;
  size_t slice_ = 0, offset_ = 0, size_ = 0;
  bool present_ = false;
};

// Parses `buffer` into `head`, all fields but `field`, whose place goes to `bulk` (field 0: no
// bulk field). False, with *error saying why, for a buffer that is not such a message.
bool decode(const grpc::ByteBuffer& buffer, int field, google::protobuf::MessageLite& head,
            Bulk& bulk, std::string* error);
bool decode(const grpc::ByteBuffer& buffer, google::protobuf::MessageLite& head,
            std::string* error);

}  // namespace towers::remote
