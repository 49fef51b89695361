// remote_wire_test.cpp — the copy-free encoding of the shard protocol's bulk calls
// (towers/remote/wire.h), held to protobuf itself: what encode() writes parses as the ordinary
// message, and decode() reads any serialisation of it, split into slices anywhere, exactly as
// protobuf's parser does, failing where it fails.
#include <atomic>
#include <chrono>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "towers/remote/towers.pb.h"
#include "towers/remote/wire.h"

namespace towers::remote {
namespace {

std::string flatten(const grpc::ByteBuffer& b) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(b.Dump(&slices).ok());
  std::string s;
  for (const grpc::Slice& x : slices) s.append(reinterpret_cast<const char*>(x.begin()), x.size());
  return s;
}

// `bytes` cut at the given offsets into separate slices.
grpc::ByteBuffer split(const std::string& bytes, std::vector<size_t> cuts) {
  cuts.push_back(bytes.size());
  std::vector<grpc::Slice> slices;
  size_t at = 0;
  for (size_t c : cuts) {
    if (c <= at || c > bytes.size()) continue;
    slices.emplace_back(bytes.data() + at, c - at);
    at = c;
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

PushRequest sample_push(size_t floats) {
  PushRequest r;
  r.set_layout_hash(0x0123456789abcdefULL);
  r.set_worker(3);
  r.set_round(1234567);
  r.set_lr(0.05f);
  r.set_loss_sum(-17.25);
  r.set_correct(99);
  r.set_examples(128);
  r.set_towers(2);
  r.set_clock(-5);
  std::string g(floats * sizeof(float), '\0');
  for (size_t i = 0; i < g.size(); ++i) g[i] = static_cast<char>(i * 131 + 7);
  r.set_grads(g);
  return r;
}

// decode()'s view of `buffer`, as a PushRequest with its grads put back.
bool decode_push(const grpc::ByteBuffer& buffer, PushRequest& out, std::string* error) {
  Bulk grads;
  out.Clear();
  if (!decode(buffer, PushRequest::kGradsFieldNumber, out, grads, error)) return false;
  EXPECT_TRUE(out.grads().empty()) << "the bulk field stays out of the head";
  if (grads.present()) {
    std::string g(grads.size(), '\0');
    grads.copy_to(g.data());
    if (const std::byte* c = grads.contiguous())
      EXPECT_EQ(0, std::memcmp(c, g.data(), g.size()));
    out.set_grads(g);
  }
  return true;
}

TEST(RemoteWire, EncodedMessageIsTheOrdinaryProtobufMessage) {
  const PushRequest want = sample_push(1000);
  PushRequest head = want;
  head.clear_grads();
  Lender lender;
  const grpc::Slice lent = lender.lend(want.grads().data(), want.grads().size());
  const grpc::ByteBuffer b = encode(head, PushRequest::kGradsFieldNumber, &lent);
  PushRequest got;
  ASSERT_TRUE(got.ParseFromString(flatten(b)));
  EXPECT_EQ(got.SerializeAsString(), want.SerializeAsString());
  // A message without its bulk field, and one whose bulk field is empty.
  const grpc::ByteBuffer none = encode(head);
  ASSERT_TRUE(got.ParseFromString(flatten(none)));
  EXPECT_EQ(got.SerializeAsString(), head.SerializeAsString());
  const grpc::Slice empty = lender.lend(want.grads().data(), 0);
  Bulk bulk;
  std::string error;
  ASSERT_TRUE(decode(encode(head, PushRequest::kGradsFieldNumber, &empty),
                     PushRequest::kGradsFieldNumber, got, bulk, &error)) << error;
  EXPECT_TRUE(bulk.present());
  EXPECT_EQ(bulk.size(), 0u);
}

TEST(RemoteWire, DecodesEverySplitOfAnyFieldOrderLikeProtobuf) {
  const PushRequest want = sample_push(37);
  // protobuf's own order (grads between small fields), and the bulk field first or last
  PushRequest head = want;
  head.clear_grads();
  PushRequest grads_only;
  grads_only.set_grads(want.grads());
  const std::vector<std::string> orders = {want.SerializeAsString(),
                                           grads_only.SerializeAsString() + head.SerializeAsString(),
                                           head.SerializeAsString() + grads_only.SerializeAsString()};
  std::mt19937 rng(7);
  for (const std::string& bytes : orders) {
    std::vector<std::vector<size_t>> splits;
    for (size_t at = 0; at <= bytes.size(); ++at) splits.push_back({at});  // one cut, anywhere
    for (size_t step = 1; step <= 9; ++step) {  // every `step` bytes
      std::vector<size_t> c;
      for (size_t at = step; at < bytes.size(); at += step) c.push_back(at);
      splits.push_back(c);
    }
    for (int k = 0; k < 50; ++k) {  // random cuts
      std::vector<size_t> c(rng() % 8);
      for (size_t& x : c) x = rng() % (bytes.size() + 1);
      std::sort(c.begin(), c.end());
      splits.push_back(c);
    }
    for (const auto& cuts : splits) {
      PushRequest got;
      std::string error;
      ASSERT_TRUE(decode_push(split(bytes, cuts), got, &error)) << error;
      EXPECT_EQ(got.SerializeAsString(), want.SerializeAsString());
    }
  }
}

TEST(RemoteWire, TheLastBulkFieldWinsAsInProtobuf) {
  const PushRequest first = sample_push(8);
  PushRequest second;
  second.set_grads(std::string(12, 'x'));
  second.set_worker(5);
  const std::string bytes = first.SerializeAsString() + second.SerializeAsString();
  PushRequest want;
  ASSERT_TRUE(want.ParseFromString(bytes));
  PushRequest got;
  std::string error;
  ASSERT_TRUE(decode_push(split(bytes, {3, 40}), got, &error)) << error;
  EXPECT_EQ(got.SerializeAsString(), want.SerializeAsString());
  EXPECT_EQ(got.grads(), std::string(12, 'x'));
}

TEST(RemoteWire, CutOrCorruptMessagesFailWhereProtobufFails) {
  const std::string bytes = sample_push(5).SerializeAsString();
  int failed = 0;
  for (size_t n = 0; n <= bytes.size(); ++n) {
    const std::string prefix = bytes.substr(0, n);
    PushRequest want, got;
    const bool ok = want.ParseFromString(prefix);
    std::string error;
    ASSERT_EQ(decode_push(split(prefix, {n / 2}), got, &error), ok) << "prefix of " << n;
    if (ok) {
      EXPECT_EQ(got.SerializeAsString(), want.SerializeAsString());
    } else {
      ++failed;
      EXPECT_NE(error.find("not a towers.remote.PushRequest message"), std::string::npos) << error;
    }
  }
  EXPECT_GT(failed, 0);
  // An unknown wire type (7) and a length beyond the end.
  PushRequest got;
  std::string error;
  EXPECT_FALSE(decode_push(split(std::string("\x0f", 1), {}), got, &error));
  EXPECT_NE(error.find("unknown wire type"), std::string::npos) << error;
  EXPECT_FALSE(decode_push(split(std::string("\x32\x7f" "abc", 5), {}), got, &error));
  EXPECT_NE(error.find("bulk field is cut off"), std::string::npos) << error;
}

TEST(RemoteWire, LenderWaitsUntilEverySliceIsLetGo) {
  std::vector<float> data(256, 1.0f);
  auto lender = std::make_unique<Lender>();
  auto held = std::make_unique<grpc::Slice>(lender->lend(data.data(), data.size() * sizeof(float)));
  grpc::Slice copy = *held;  // a second reference, as gRPC's transport takes one
  held.reset();
  std::atomic<bool> returned{false};
  std::thread waiter([&] {
    lender->wait_returned();
    returned = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(returned.load()) << "a slice is still held";
  copy = grpc::Slice();  // the last reference goes
  waiter.join();
  EXPECT_TRUE(returned.load());
}

}  // namespace
}  // namespace towers::remote
