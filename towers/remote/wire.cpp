#include "towers/remote/wire.h"

#include <cstdlib>
#include <cstring>
#include <new>
#include <sstream>

#include <fmt/format.h>

#include "core/check.h"

namespace towers::remote {

grpc::Slice Lender::lend(const void* data, size_t bytes) {
  {
    std::lock_guard<std::mutex> l(mu_);
    ++out_;
  }
  // gRPC never writes into the slices it sends.
  return grpc::Slice(const_cast<void*>(data), bytes, &Lender::returned, this);
}

void Lender::returned(void* self) {
  auto* l = static_cast<Lender*>(self);
  std::lock_guard<std::mutex> g(l->mu_);
  if (--l->out_ == 0) l->cv_.notify_all();
}

void Lender::wait_returned() {
  std::unique_lock<std::mutex> l(mu_);
  cv_.wait(l, [&] { return out_ == 0; });
}

OwnedSlice owned_slice(size_t bytes) {
  void* p = std::malloc(bytes == 0 ? 1 : bytes);
  if (p == nullptr) throw std::bad_alloc();
  return {grpc::Slice(p, bytes, &std::free), static_cast<std::byte*>(p)};
}

namespace {

void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

// A position in a list of slices, read forward.
struct Cursor {
  const std::vector<grpc::Slice>* slices;
  size_t slice = 0, offset = 0, pos = 0;  // pos: bytes read so far

  void settle() {
    while (slice < slices->size() && offset == (*slices)[slice].size()) ++slice, offset = 0;
  }
  bool done() {
    settle();
    return slice >= slices->size();
  }
  bool byte(uint8_t& b) {
    if (done()) return false;
    b = (*slices)[slice].begin()[offset++];
    ++pos;
    return true;
  }
  bool varint(uint64_t& v) {
    v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      uint8_t b;
      if (!byte(b)) return false;
      v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if ((b & 0x80) == 0) return true;
    }
    return false;
  }
  // Moves n bytes on, appending them to out unless it is null.
  bool take(size_t n, std::string* out) {
    while (n > 0) {
      if (done()) return false;
      const grpc::Slice& s = (*slices)[slice];
      const size_t k = std::min(n, s.size() - offset);
      if (out) out->append(reinterpret_cast<const char*>(s.begin()) + offset, k);
      offset += k;
      pos += k;
      n -= k;
    }
    return true;
  }
};

}  // namespace

grpc::ByteBuffer encode(const google::protobuf::MessageLite& head, int field,
                        const grpc::Slice* bulk) {
  std::string prefix;
  head.AppendToString(&prefix);
  if (bulk == nullptr) {
    grpc::Slice s(prefix);
    return grpc::ByteBuffer(&s, 1);
  }
  put_varint(prefix, (static_cast<uint64_t>(field) << 3) | 2);  // wire type 2: length-delimited
  put_varint(prefix, bulk->size());
  grpc::Slice parts[2] = {grpc::Slice(prefix), *bulk};
  return grpc::ByteBuffer(parts, bulk->size() > 0 ? 2 : 1);
}

void Bulk::copy_to(void* dst) const { copy_range(dst, 0, size_); }

void Bulk::copy_range(void* dst, size_t from, size_t bytes) const {
  TOWERS_CHECK(from <= size_ && bytes <= size_ - from, "bytes [{}, {}) of a bulk field of {}", from,
               from + bytes, size_);
  auto* out = static_cast<std::byte*>(dst);
  size_t n = bytes, s = slice_, off = offset_ + from;
  while (n > 0 && off >= slices_[s].size()) off -= slices_[s].size(), ++s;
  while (n > 0) {
    const grpc::Slice& sl = slices_[s];
    const size_t k = std::min(n, sl.size() - off);
    std::memcpy(out, sl.begin() + off, k);
    out += k;
    n -= k;
    ++s;
    off = 0;
  }
}

const std::byte* Bulk::contiguous() const {
  if (size_ == 0) return nullptr;
  const grpc::Slice& s = slices_[slice_];
  if (s.size() - offset_ < size_) return nullptr;
  return reinterpret_cast<const std::byte*>(s.begin() + offset_);
}

bool decode(const grpc::ByteBuffer& buffer, int field, google::protobuf::MessageLite& head,
            Bulk& bulk, std::string* error) {
  bulk = Bulk();
  if (!buffer.Dump(&bulk.slices_).ok()) {
    *error = "the message could not be read";
    return false;
  }
  Cursor c{&bulk.slices_};
  std::string rest;
  auto bad = [&](const char* why) {
    *error = fmt::format("not a {} message: {}", head.GetTypeName(), why);
    return false;
  };
  while (!c.done()) {
    const Cursor start = c;
    uint64_t tag, len;
    if (!c.varint(tag)) return bad("a field's tag is cut off");
    const uint64_t number = tag >> 3;
    switch (tag & 7) {
      case 0:
        if (!c.varint(len)) return bad("a varint is cut off");
        break;
      case 1:
        if (!c.take(8, nullptr)) return bad("a fixed64 is cut off");
        break;
      case 5:
        if (!c.take(4, nullptr)) return bad("a fixed32 is cut off");
        break;
      case 2:
        if (!c.varint(len)) return bad("a length is cut off");
        if (field != 0 && number == static_cast<uint64_t>(field)) {
          c.settle();
          bulk.slice_ = c.slice;
          bulk.offset_ = c.offset;
          bulk.size_ = len;
          bulk.present_ = true;
          if (!c.take(len, nullptr)) return bad("the bulk field is cut off");
          continue;
        }
        if (!c.take(len, nullptr)) return bad("a length-delimited field is cut off");
        break;
      default:
        return bad("a field of an unknown wire type");
    }
    // A small field: its bytes, tag and all, join the head's.
    Cursor copy = start;
    copy.take(c.pos - start.pos, &rest);
  }
  if (!head.ParseFromString(rest)) return bad("its small fields do not parse");
  return true;
}

bool decode(const grpc::ByteBuffer& buffer, google::protobuf::MessageLite& head,
            std::string* error) {
  Bulk unused;
  return decode(buffer, 0, head, unused, error);
}

std::string stripe_metadata(const Stripe& s) { return fmt::format("{} {} {}", s.push, s.k, s.s); }

bool parse_stripe(const std::string& text, Stripe* out, std::string* error) {
  std::istringstream in(text);
  Stripe s;
  std::string rest;
  if (!(in >> s.push >> s.k >> s.s) || (in >> rest) || s.s < 1 || s.s > kMaxStripes || s.k < 0 ||
      s.k >= s.s) {
    *error = fmt::format("'{}' is not \"ID K S\" with 0 <= K < S <= {}", text, kMaxStripes);
    return false;
  }
  *out = s;
  return true;
}

}  // namespace towers::remote
