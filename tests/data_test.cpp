// data_test.cpp — readers (round trips and every bad-input case), synthetic data,
// augmentation and the batch pipeline's reproducibility contract.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <oneapi/tbb/global_control.h>
#include <sys/resource.h>  // setrlimit
#include <unistd.h>
#include <zlib.h>

#include "core/check.h"
#include "core/rng.h"
#include "data/augment.h"
#include "data/cifar10.h"
#include "data/dataset.h"
#include "data/idx.h"
#include "data/load.h"
#include "data/pipeline.h"
#include "data/synthetic.h"

namespace towers::data {
namespace {

namespace fs = std::filesystem;

fs::path temp_root() {
  return fs::path(testing::TempDir()) / ("towers_data_" + std::to_string(getpid()));
}

// Removes this process's files once the suite is done.
class RemoveTempRoot : public testing::Environment {
 public:
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(temp_root(), ec);
  }
};
const auto* const kRemoveTempRoot = testing::AddGlobalTestEnvironment(new RemoveTempRoot);

// A fresh directory per test, so tests never see each other's files.
std::string temp_dir() {
  const auto* info = testing::UnitTest::GetInstance()->current_test_info();
  const fs::path dir = temp_root() / (std::string(info->test_suite_name()) + "." + info->name());
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir.string();
}

void write_file(const std::string& path, const std::vector<uint8_t>& bytes, bool gzip) {
  if (gzip) {
    gzFile f = gzopen(path.c_str(), "wb");
    ASSERT_NE(f, nullptr) << path;
    if (!bytes.empty()) {
      ASSERT_EQ(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())),
                static_cast<int>(bytes.size()));
    }
    ASSERT_EQ(gzclose(f), Z_OK);
  } else {
    std::ofstream out(path, std::ios::binary);
    out.write(reinterpret_cast<const char*>(bytes.data()),
              static_cast<std::streamsize>(bytes.size()));
    ASSERT_TRUE(out.good()) << path;
  }
}

std::vector<uint8_t> idx_bytes(uint32_t magic, const std::vector<uint32_t>& dims,
                               const std::vector<uint8_t>& payload) {
  std::vector<uint8_t> b;
  auto put = [&](uint32_t v) {
    for (int s = 24; s >= 0; s -= 8) b.push_back(static_cast<uint8_t>(v >> s));
  };
  put(magic);
  for (uint32_t d : dims) put(d);
  b.insert(b.end(), payload.begin(), payload.end());
  return b;
}

struct SmallIdx {
  std::vector<uint8_t> pixels, labels;  // 5 images of 3x4, labels < 10
};

SmallIdx small_idx() {
  SmallIdx s;
  for (int i = 0; i < 5 * 3 * 4; ++i) s.pixels.push_back(static_cast<uint8_t>(i * 37 % 256));
  s.labels = {3, 0, 9, 1, 3};
  return s;
}

// Writes the small set as IDX; returns {images path, labels path}.
std::pair<std::string, std::string> write_small_idx(const std::string& dir, bool gzip) {
  const SmallIdx s = small_idx();
  const std::string ext = gzip ? ".gz" : "";
  const std::string images = dir + "/images-idx3-ubyte" + ext;
  const std::string labels = dir + "/labels-idx1-ubyte" + ext;
  write_file(images, idx_bytes(0x803, {5, 3, 4}, s.pixels), gzip);
  write_file(labels, idx_bytes(0x801, {5}, s.labels), gzip);
  return {images, labels};
}

// Runs fn, which must throw towers::Error whose message contains every one of `parts`.
void expect_error(const std::function<void()>& fn, const std::vector<std::string>& parts) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one mentioning '" << parts.front() << "'";
  } catch (const Error& e) {
    const std::string msg = e.what();
    if (getenv("TOWERS_PRINT_ERRORS")) std::printf("  error: %s\n", msg.c_str());
    for (const std::string& p : parts)
      EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
  }
}

// ---- IDX --------------------------------------------------------------------------------------

TEST(Idx, RoundTripPlainAndGzip) {
  const std::string dir = temp_dir();
  const SmallIdx s = small_idx();
  for (bool gzip : {false, true}) {
    const auto [images, labels] = write_small_idx(dir, gzip);
    const Dataset d = read_idx_pair(images, labels, "small", 10);
    EXPECT_EQ(d.name, "small");
    EXPECT_EQ(d.size(), 5);
    EXPECT_EQ(d.channels, 1);
    EXPECT_EQ(d.height, 3);
    EXPECT_EQ(d.width, 4);
    EXPECT_EQ(d.num_classes, 10);
    EXPECT_EQ(d.images, s.pixels) << "gzip=" << gzip;
    EXPECT_EQ(d.labels, std::vector<int32_t>(s.labels.begin(), s.labels.end()));
    EXPECT_EQ(d.image(2)[0], s.pixels[2 * 12]);
  }
}

TEST(Idx, MissingFile) {
  const std::string dir = temp_dir();
  const auto [images, labels] = write_small_idx(dir, false);
  const std::string missing = dir + "/nope-idx3-ubyte";
  expect_error([&] { read_idx_pair(missing, labels, "x", 10); }, {missing, "no such file"});
  expect_error([&] { read_idx_pair(images, missing, "x", 10); }, {missing, "no such file"});
}

TEST(Idx, WrongMagic) {
  const std::string dir = temp_dir();
  const auto [images, labels] = write_small_idx(dir, false);
  // A label file given as images: the dim count is wrong.
  expect_error([&] { read_idx_pair(labels, labels, "x", 10); },
               {labels, "wrong IDX magic 0x00000801", "expected 0x00000803"});
  // Images given as labels.
  expect_error([&] { read_idx_pair(images, images, "x", 10); },
               {images, "wrong IDX magic 0x00000803", "expected 0x00000801"});
  // Right dim count, float type byte (0x0D).
  const std::string floats = dir + "/floats-idx3";
  write_file(floats, idx_bytes(0xD03, {5, 3, 4}, small_idx().pixels), false);
  expect_error([&] { read_idx_pair(floats, labels, "x", 10); },
               {floats, "wrong IDX magic 0x00000d03", "type byte 0x0d"});
  // Not IDX at all (a gzip file read as plain is still decompressed, so use text).
  const std::string text = dir + "/text";
  write_file(text, {'h', 'e', 'l', 'l', 'o', ' ', 'w', 'o', 'r', 'l', 'd', '!', '!', '!', '!', '!'},
             false);
  expect_error([&] { read_idx_pair(text, labels, "x", 10); }, {text, "wrong IDX magic"});
}

TEST(Idx, TruncatedHeaderAndPayload) {
  const std::string dir = temp_dir();
  const auto [images, labels] = write_small_idx(dir, false);
  const std::string short_header = dir + "/short-header";
  write_file(short_header, {0, 0, 8, 3, 0, 0}, false);
  expect_error([&] { read_idx_pair(short_header, labels, "x", 10); },
               {short_header, "truncated IDX header"});
  for (bool gzip : {false, true}) {
    const std::string cut = dir + (gzip ? "/cut.gz" : "/cut");
    std::vector<uint8_t> pixels = small_idx().pixels;
    pixels.resize(pixels.size() - 7);
    write_file(cut, idx_bytes(0x803, {5, 3, 4}, pixels), gzip);
    expect_error([&] { read_idx_pair(cut, labels, "x", 10); },
                 {cut, "truncated", "promises 60 data bytes", "only 53"});
  }
  // A header promising a huge payload must fail as truncated, not by allocating it.
  const std::string huge = dir + "/huge";
  write_file(huge, idx_bytes(0x803, {60000, 60000, 60000}, small_idx().pixels), false);
  expect_error([&] { read_idx_pair(huge, labels, "x", 10); }, {huge, "imply more than"});
  const std::string big = dir + "/big";
  write_file(big, idx_bytes(0x803, {1000000, 28, 28}, small_idx().pixels), false);
  expect_error([&] { read_idx_pair(big, labels, "x", 10); }, {big, "truncated"});
}

// Caps the address space of this process at what it maps now plus `extra` bytes, for good:
// call it only in a death test's child.
void cap_address_space(uint64_t extra) {
  uint64_t pages = 0;
  std::ifstream("/proc/self/statm") >> pages;
  rlimit cap{};
  getrlimit(RLIMIT_AS, &cap);
  cap.rlim_cur = std::min<rlim_t>(cap.rlim_max, pages * sysconf(_SC_PAGESIZE) + extra);
  setrlimit(RLIMIT_AS, &cap);
}

// Reads the pair with 64 MiB of address space to spare; exits 0 after printing the error.
[[noreturn]] void read_idx_pair_capped(const std::string& images, const std::string& labels) {
  cap_address_space(64 << 20);
  try {
    read_idx_pair(images, labels, "x", 10);
  } catch (const Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    std::exit(0);
  }
  std::exit(1);
}

// What a header claims is not allocated before the bytes arrive: a 13-byte label file claiming
// 2^32 - 1 labels, and a 76-byte image file claiming 1000000x28x28, fail as truncated with
// 64 MiB of address space to spare, plain and gzipped.
TEST(Idx, HeaderClaimsAreNotAllocated) {
  const std::string dir = temp_dir();
  const auto [images, labels] = write_small_idx(dir, false);
  const SmallIdx s = small_idx();
  for (bool gzip : {false, true}) {
    const std::string ext = gzip ? ".gz" : "";
    const std::string many_labels = dir + "/many-labels" + ext;
    write_file(many_labels, idx_bytes(0x801, {0xffffffffu}, s.labels), gzip);
    EXPECT_EXIT(read_idx_pair_capped(images, many_labels), testing::ExitedWithCode(0),
                "many-labels.*promises 4294967295 data bytes, the file holds only 5");
    const std::string many_images = dir + "/many-images" + ext;
    write_file(many_images, idx_bytes(0x803, {1000000, 28, 28}, s.pixels), gzip);
    EXPECT_EXIT(read_idx_pair_capped(many_images, labels), testing::ExitedWithCode(0),
                "many-images.*promises 784000000 data bytes, the file holds only 60");
  }
}

TEST(Idx, CorruptGzipStream) {
  const std::string dir = temp_dir();
  const auto [images, labels] = write_small_idx(dir, true);
  std::ifstream in(images, std::ios::binary);
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), {});
  bytes.resize(bytes.size() - 20);  // cuts the deflate stream and its trailer
  const std::string cut = dir + "/cut-stream.gz";
  write_file(cut, bytes, false);
  expect_error([&] { read_idx_pair(cut, labels, "x", 10); }, {cut});
  // Bad input, not a bug in towers: towers::Error, not InternalError. The gzip magic, then a
  // compression method byte that is not deflate's 8.
  const std::string method = dir + "/method.gz";
  write_file(method, {0x1f, 0x8b, 0x00, 0x80}, false);
  expect_error([&] { read_idx_pair(method, labels, "x", 10); },
               {method, "corrupt gzip data", "unknown compression method"});
}

TEST(Idx, ZeroDimAndTrailingGarbage) {
  const std::string dir = temp_dir();
  const auto [images, labels] = write_small_idx(dir, false);
  const std::string zero = dir + "/zero";
  write_file(zero, idx_bytes(0x803, {0, 3, 4}, {}), false);
  expect_error([&] { read_idx_pair(zero, labels, "x", 10); }, {zero, "dim of size 0"});
  for (bool gzip : {false, true}) {
    const std::string extra = dir + (gzip ? "/extra.gz" : "/extra");
    std::vector<uint8_t> payload = small_idx().labels;
    payload.push_back(1);
    write_file(extra, idx_bytes(0x801, {5}, payload), gzip);
    expect_error([&] { read_idx_pair(images, extra, "x", 10); }, {extra, "trailing garbage"});
  }
}

TEST(Idx, LabelOutOfRangeAndCountMismatch) {
  const std::string dir = temp_dir();
  const auto [images, labels] = write_small_idx(dir, false);
  expect_error([&] { read_idx_pair(images, labels, "x", 5); },
               {labels, "label 9 at index 2 is out of range", "< 5"});
  const std::string four = dir + "/four-labels";
  write_file(four, idx_bytes(0x801, {4}, {0, 1, 2, 3}), false);
  expect_error([&] { read_idx_pair(images, four, "x", 10); },
               {images, four, "5 images", "4 labels"});
}

TEST(Idx, FashionMnistLayoutWithAndWithoutGz) {
  const std::string dir = temp_dir();
  const SmallIdx s = small_idx();
  write_file(dir + "/train-images-idx3-ubyte.gz", idx_bytes(0x803, {5, 3, 4}, s.pixels), true);
  write_file(dir + "/train-labels-idx1-ubyte", idx_bytes(0x801, {5}, s.labels), false);
  write_file(dir + "/t10k-images-idx3-ubyte",
             idx_bytes(0x803, {2, 3, 4}, {s.pixels.begin(), s.pixels.begin() + 24}), false);
  write_file(dir + "/t10k-labels-idx1-ubyte.gz", idx_bytes(0x801, {2}, {7, 8}), true);
  const DataSplit split = load_fashion_mnist(dir);
  EXPECT_EQ(split.train.size(), 5);
  EXPECT_EQ(split.test.size(), 2);
  EXPECT_EQ(split.train.images, s.pixels);
  EXPECT_EQ(split.test.labels, (std::vector<int32_t>{7, 8}));
}

TEST(Idx, FashionMnistMissingFiles) {
  const std::string dir = temp_dir();
  expect_error([&] { load_fashion_mnist(dir + "/absent"); }, {dir + "/absent", "does not exist"});
  expect_error([&] { load_fashion_mnist(dir); },
               {dir, "'train-images-idx3-ubyte'", "'train-images-idx3-ubyte.gz'"});
  const SmallIdx s = small_idx();
  write_file(dir + "/train-images-idx3-ubyte.gz", idx_bytes(0x803, {5, 3, 4}, s.pixels), true);
  write_file(dir + "/train-labels-idx1-ubyte.gz", idx_bytes(0x801, {5}, s.labels), true);
  expect_error([&] { load_fashion_mnist(dir); }, {dir, "t10k-images-idx3-ubyte"});
}

TEST(Idx, RealFashionMnist) {
  if (!fs::is_directory(kFashionMnistDir))
    GTEST_SKIP() << kFashionMnistDir << " is absent (Debian package dataset-fashion-mnist)";
  const DataSplit split = load_fashion_mnist();
  for (const Dataset* d : {&split.train, &split.test}) {
    EXPECT_EQ(d->channels, 1);
    EXPECT_EQ(d->height, 28);
    EXPECT_EQ(d->width, 28);
    EXPECT_EQ(d->num_classes, 10);
    EXPECT_NO_THROW(d->validate());
    // Fashion-MNIST is exactly balanced.
    std::vector<int64_t> counts(10, 0);
    for (int32_t l : d->labels) ++counts[l];
    for (int64_t c : counts) EXPECT_EQ(c, d->size() / 10);
  }
  EXPECT_EQ(split.train.size(), 60000);
  EXPECT_EQ(split.test.size(), 10000);
  // Pixels span the full range; not all zero, not a constant.
  const auto [lo, hi] = std::minmax_element(split.train.images.begin(), split.train.images.end());
  EXPECT_EQ(*lo, 0);
  EXPECT_EQ(*hi, 255);
}

// ---- CIFAR-10 ---------------------------------------------------------------------------------

std::vector<uint8_t> cifar_records(const std::vector<uint8_t>& labels) {
  std::vector<uint8_t> b;
  for (size_t r = 0; r < labels.size(); ++r) {
    b.push_back(labels[r]);
    for (int i = 0; i < 3072; ++i) b.push_back(static_cast<uint8_t>((i + 31 * r) % 251));
  }
  return b;
}

TEST(Cifar10, ReadsRecordsAndSubfolder) {
  const std::string dir = temp_dir();
  const std::string sub = dir + "/cifar-10-batches-bin";
  fs::create_directories(sub);
  for (int k = 1; k <= 5; ++k)
    write_file(sub + "/data_batch_" + std::to_string(k) + ".bin",
               cifar_records({static_cast<uint8_t>(k), static_cast<uint8_t>(9 - k)}), false);
  write_file(sub + "/test_batch.bin", cifar_records({0, 1, 2}), false);
  for (const std::string& root : {dir, sub}) {
    const DataSplit split = load_cifar10(root);
    EXPECT_EQ(split.train.size(), 10);
    EXPECT_EQ(split.test.size(), 3);
    EXPECT_EQ(split.train.channels, 3);
    EXPECT_EQ(split.train.height, 32);
    EXPECT_EQ(split.train.width, 32);
    EXPECT_EQ(split.train.labels, (std::vector<int32_t>{1, 8, 2, 7, 3, 6, 4, 5, 5, 4}));
    // Record r of a file holds pixel i = (i + 31 r) % 251; the CHW bytes are copied as is.
    EXPECT_EQ(split.test.image(2)[0], 62);
    EXPECT_EQ(split.test.image(2)[3071], (3071 + 62) % 251);
    EXPECT_EQ(split.train.image(3)[1024], (1024 + 31) % 251);  // file 2, record 1, G plane
  }
}

TEST(Cifar10, BadFiles) {
  const std::string dir = temp_dir();
  const std::string odd = dir + "/odd.bin";
  std::vector<uint8_t> bytes = cifar_records({1, 2});
  bytes.resize(bytes.size() + 5);
  write_file(odd, bytes, false);
  expect_error([&] { read_cifar10_files({odd}, "x"); },
               {odd, "size 6151 bytes", "not a nonzero multiple of 3073"});
  const std::string empty = dir + "/empty.bin";
  write_file(empty, {}, false);
  expect_error([&] { read_cifar10_files({empty}, "x"); }, {empty, "size 0 bytes"});
  const std::string bad_label = dir + "/label.bin";
  write_file(bad_label, cifar_records({3, 10}), false);
  expect_error([&] { read_cifar10_files({bad_label}, "x"); },
               {bad_label, "record 1 has label 10", "< 10"});
  const std::string missing = dir + "/missing.bin";
  expect_error([&] { read_cifar10_files({missing}, "x"); }, {missing, "no such file"});
  expect_error([&] { load_cifar10(dir); }, {dir, "data_batch_1.bin", "cifar-10-batches-bin"});
  expect_error([&] { load_cifar10(dir + "/absent"); }, {dir + "/absent", "does not exist"});
}

// ---- synthetic --------------------------------------------------------------------------------

TEST(Synthetic, DeterministicAndBalancedIsh) {
  const DataSplit a = make_synthetic(3, 8, 8, 10, 5000, 500, 42);
  const DataSplit b = make_synthetic(3, 8, 8, 10, 5000, 500, 42);
  const DataSplit c = make_synthetic(3, 8, 8, 10, 5000, 500, 43);
  EXPECT_EQ(a.train.images, b.train.images);
  EXPECT_EQ(a.train.labels, b.train.labels);
  EXPECT_EQ(a.test.images, b.test.images);
  EXPECT_NE(a.train.images, c.train.images);
  EXPECT_NE(a.train.images, a.test.images);
  EXPECT_NO_THROW(a.train.validate());
  std::vector<int64_t> counts(10, 0);
  for (int32_t l : a.train.labels) ++counts[l];
  for (int64_t n : counts) EXPECT_NEAR(n, 500, 100);
}

TEST(Synthetic, ThreadCountDoesNotMatter) {
  const DataSplit a = make_synthetic(1, 16, 16, 4, 3000, 10, 7);
  oneapi::tbb::global_control one(oneapi::tbb::global_control::max_allowed_parallelism, 1);
  const DataSplit b = make_synthetic(1, 16, 16, 4, 3000, 10, 7);
  EXPECT_EQ(a.train.images, b.train.images);
}

// Learnable: nearest class centroid of the training set classifies the test set well, even
// after the training transform (crop, flip, brightness, contrast, standardize).
TEST(Synthetic, Learnable) {
  const DataSplit s = make_synthetic(3, 12, 12, 10, 2000, 500, 5);
  const AugmentConfig eval = tutorial_eval_config(10);
  const AugmentConfig train = tutorial_train_config(10);
  const int64_t m = example_floats(eval, s.train);
  std::vector<double> centroid(10 * m, 0.0);
  std::vector<int64_t> counts(10, 0);
  std::vector<float> x(m);
  for (int64_t i = 0; i < s.train.size(); ++i) {
    Rng rng(1, 0, i);
    augment_train(train, s.train, i, rng, x.data());
    const int32_t l = s.train.labels[i];
    ++counts[l];
    for (int64_t k = 0; k < m; ++k) centroid[l * m + k] += x[k];
  }
  int64_t correct = 0;
  for (int64_t i = 0; i < s.test.size(); ++i) {
    transform_eval(eval, s.test, i, x.data());
    int best = -1;
    double best_d = 1e300;
    for (int c = 0; c < 10; ++c) {
      double d = 0;
      for (int64_t k = 0; k < m; ++k) {
        const double diff = x[k] - centroid[c * m + k] / counts[c];
        d += diff * diff;
      }
      if (d < best_d) best_d = d, best = c;
    }
    correct += best == s.test.labels[i];
  }
  EXPECT_GT(correct, s.test.size() * 8 / 10) << correct << " of " << s.test.size();
}

// ---- augmentation -----------------------------------------------------------------------------

// A one-example dataset whose pixel (c, y, x) is c*100 + y*10 + x.
Dataset grid_dataset(int64_t c, int64_t h, int64_t w) {
  Dataset d;
  d.name = "grid";
  d.channels = c;
  d.height = h;
  d.width = w;
  d.num_classes = 1;
  for (int64_t k = 0; k < c; ++k)
    for (int64_t y = 0; y < h; ++y)
      for (int64_t x = 0; x < w; ++x)
        d.images.push_back(static_cast<uint8_t>(k * 100 + y * 10 + x));
  d.labels = {0};
  return d;
}

TEST(Augment, EvalCenterCropExactPixels) {
  const Dataset d = grid_dataset(2, 5, 6);
  AugmentConfig c = tutorial_eval_config(0);
  c.out_h = 3;
  c.out_w = 4;
  c.standardize = false;
  std::vector<float> out(2 * 3 * 4);
  transform_eval(c, d, 0, out.data());
  // Offsets (5-3)/2 = 1 and (6-4)/2 = 1.
  for (int k = 0; k < 2; ++k)
    for (int y = 0; y < 3; ++y)
      for (int x = 0; x < 4; ++x)
        EXPECT_EQ(out[(k * 3 + y) * 4 + x], k * 100 + (y + 1) * 10 + (x + 1)) << k << y << x;
  // Larger than the image: centred zero padding, as resize_image_with_crop_or_pad.
  c.out_h = 7;
  c.out_w = 9;
  out.assign(2 * 7 * 9, -1.0f);
  transform_eval(c, d, 0, out.data());
  for (int y = 0; y < 7; ++y)
    for (int x = 0; x < 9; ++x) {
      const int sy = y - 1, sx = x - 1;  // pad offsets (7-5)/2 = 1 and (9-6)/2 = 1
      const float want = sy >= 0 && sy < 5 && sx >= 0 && sx < 6 ? sy * 10 + sx : 0.0f;
      EXPECT_EQ(out[y * 9 + x], want) << y << " " << x;
    }
}

// Without photometric distortions, a random crop is some window of the zero-padded image,
// possibly mirrored; every offset and both flips occur.
TEST(Augment, RandomCropIsAWindowOfThePaddedImage) {
  const Dataset d = grid_dataset(1, 6, 6);
  AugmentConfig c = tutorial_train_config(4);
  c.pad = 1;
  c.brightness = c.contrast = c.standardize = false;
  std::vector<int> seen(5 * 5 * 2, 0);
  std::vector<float> out(16);
  for (int t = 0; t < 500; ++t) {
    Rng rng(3, 0, t);
    augment_train(c, d, 0, rng, out.data());
    int matches = 0;
    for (int top = -1; top <= 1 + 6 - 4; ++top)
      for (int left = -1; left <= 1 + 6 - 4; ++left)
        for (int flip = 0; flip < 2; ++flip) {
          bool ok = true;
          for (int y = 0; y < 4 && ok; ++y)
            for (int x = 0; x < 4 && ok; ++x) {
              const int sy = top + y, sx = left + (flip ? 3 - x : x);
              const float want = sy >= 0 && sy < 6 && sx >= 0 && sx < 6 ? sy * 10 + sx : 0.0f;
              ok = out[y * 4 + x] == want;
            }
          if (ok) ++matches, ++seen[((top + 1) * 5 + (left + 1)) * 2 + flip];
        }
    EXPECT_GE(matches, 1) << "draw " << t;
  }
  for (int n : seen) EXPECT_GT(n, 0);
}

// --augment airbench on a full-size image: a translation by -2..2 pixels each way (zeros
// come in at the edge) and a flip; every one of the 5 x 5 x 2 outcomes occurs.
TEST(Augment, AirbenchTranslatesByUpToTwoPixelsAndFlips) {
  const Dataset d = grid_dataset(1, 6, 6);
  Transforms t = transforms_for("airbench", "grid", {1, 6, 6}, d, "m");
  EXPECT_FALSE(t.eval.random_crop || t.eval.flip);
  t.train.standardize = false;
  std::vector<int> seen(5 * 5 * 2, 0);
  std::vector<float> out(36);
  for (int k = 0; k < 600; ++k) {
    Rng rng(5, 0, k);
    augment_train(t.train, d, 0, rng, out.data());
    int matches = 0;
    for (int dy = -2; dy <= 2; ++dy)
      for (int dx = -2; dx <= 2; ++dx)
        for (int flip = 0; flip < 2; ++flip) {
          bool ok = true;
          for (int y = 0; y < 6 && ok; ++y)
            for (int x = 0; x < 6 && ok; ++x) {
              const int sy = y + dy, sx = dx + (flip ? 5 - x : x);
              ok = out[y * 6 + x] == (sy >= 0 && sy < 6 && sx >= 0 && sx < 6 ? sy * 10 + sx : 0.0f);
            }
          if (ok) ++matches, ++seen[((dy + 2) * 5 + dx + 2) * 2 + flip];
        }
    EXPECT_GE(matches, 1) << "draw " << k;
  }
  for (int n : seen) EXPECT_GT(n, 0);
  EXPECT_THROW(transforms_for("jitter", "grid", {1, 6, 6}, d, "m"), Error);
}

TEST(Augment, StandardizedOutputHasZeroMeanUnitStd) {
  const DataSplit s = make_synthetic(3, 32, 32, 10, 20, 1, 9);
  const AugmentConfig c = tutorial_train_config(24);
  std::vector<float> out(3 * 24 * 24);
  for (int64_t i = 0; i < s.train.size(); ++i) {
    Rng rng(11, 0, i);
    augment_train(c, s.train, i, rng, out.data());
    double sum = 0, sq = 0;
    for (float v : out) sum += v, sq += double(v) * v;
    const double mean = sum / out.size();
    EXPECT_NEAR(mean, 0.0, 1e-4);
    EXPECT_NEAR(std::sqrt(sq / out.size() - mean * mean), 1.0, 1e-3);
  }
}

TEST(Augment, BrightnessAndContrastFollowTheTutorial) {
  const Dataset d = grid_dataset(2, 4, 4);
  AugmentConfig c = tutorial_train_config(4);
  c.random_crop = c.flip = c.standardize = false;
  c.contrast = false;
  std::vector<float> plain(32), out(32);
  AugmentConfig none = c;
  none.brightness = false;
  Rng r0(1, 2, 3);
  augment_train(none, d, 0, r0, plain.data());
  Rng r1(1, 2, 3);
  augment_train(c, d, 0, r1, out.data());
  const float delta = out[0] - plain[0];
  EXPECT_LE(std::abs(delta), 63.0f);
  for (int i = 0; i < 32; ++i) EXPECT_FLOAT_EQ(out[i] - plain[i], delta);
  // Contrast keeps each channel's mean and scales deviations by one factor in [0.2, 1.8].
  c.brightness = false;
  c.contrast = true;
  Rng r2(1, 2, 3);
  augment_train(c, d, 0, r2, out.data());
  for (int k = 0; k < 2; ++k) {
    double mp = 0, mo = 0;
    for (int i = 0; i < 16; ++i) mp += plain[k * 16 + i], mo += out[k * 16 + i];
    EXPECT_NEAR(mo / 16, mp / 16, 1e-3);
    const float f = (out[k * 16 + 15] - float(mo / 16)) / (plain[k * 16 + 15] - float(mp / 16));
    EXPECT_GE(f, 0.2f - 1e-4f);
    EXPECT_LE(f, 1.8f + 1e-4f);
  }
}

TEST(Augment, BadConfigNamesTheDataset) {
  const Dataset d = grid_dataset(1, 6, 6);
  AugmentConfig c = tutorial_train_config(9);
  expect_error([&] { validate(c, d); }, {"'grid'", "9x9", "6x6"});
  c.pad = 2;
  EXPECT_NO_THROW(validate(c, d));
  c.contrast_lower = 2.0f;
  expect_error([&] { validate(c, d); }, {"contrast range"});
}

// ---- pipeline ---------------------------------------------------------------------------------

TEST(Pipeline, PermutationDependsOnlyOnSeedAndEpoch) {
  const std::vector<int64_t> p = epoch_permutation(1000, 5, 3);
  std::vector<int64_t> sorted = p;
  std::sort(sorted.begin(), sorted.end());
  std::vector<int64_t> iota(1000);
  std::iota(iota.begin(), iota.end(), 0);
  EXPECT_EQ(sorted, iota);
  EXPECT_NE(p, iota);
  EXPECT_EQ(p, epoch_permutation(1000, 5, 3));
  EXPECT_NE(p, epoch_permutation(1000, 5, 4));
  EXPECT_NE(p, epoch_permutation(1000, 6, 3));
  EXPECT_EQ(epoch_permutation(1, 5, 3), std::vector<int64_t>{0});
}

// Example i of this dataset is the constant image i, so an un-augmented batch shows which
// examples it holds.
Dataset index_dataset(int64_t n) {
  Dataset d;
  d.name = "index";
  d.channels = 1;
  d.height = d.width = 2;
  d.num_classes = 256;
  for (int64_t i = 0; i < n; ++i) {
    d.images.insert(d.images.end(), 4, static_cast<uint8_t>(i));
    d.labels.push_back(static_cast<int32_t>(i));
  }
  return d;
}

TEST(Pipeline, StreamIsConcatenatedEpochPermutations) {
  const int64_t n = 20, batch = 7;  // batches straddle epoch boundaries
  const Dataset d = index_dataset(n);
  AugmentConfig c = tutorial_eval_config(2);
  c.standardize = false;
  BatchPipeline pipe(d, c, batch, 99, 0, 2);
  std::vector<int64_t> stream;
  for (int t = 0; t < 9; ++t) {
    const Batch b = pipe.next();
    EXPECT_EQ(b.step, t);
    EXPECT_DOUBLE_EQ(b.epoch_end, double((t + 1) * batch) / n);
    ASSERT_EQ(b.images.size(), batch * 4);
    ASSERT_EQ(static_cast<int64_t>(b.labels.size()), batch);
    for (int64_t i = 0; i < batch; ++i) {
      EXPECT_EQ(b.images[i * 4], b.labels[i]);
      stream.push_back(b.labels[i]);
    }
  }
  for (int64_t e = 0; e < 3; ++e) {
    const std::vector<int64_t> want = epoch_permutation(n, 99, e);
    EXPECT_EQ(std::vector<int64_t>(stream.begin() + e * n, stream.begin() + (e + 1) * n), want);
  }
}

TEST(Pipeline, BatchLargerThanTheDataset) {
  const Dataset d = index_dataset(5);
  AugmentConfig c = tutorial_eval_config(2);
  c.standardize = false;
  BatchPipeline pipe(d, c, 12, 1, 0, 1);
  std::vector<int32_t> stream;
  for (int t = 0; t < 5; ++t) {
    const Batch b = pipe.next();
    stream.insert(stream.end(), b.labels.begin(), b.labels.end());
  }
  for (int64_t e = 0; e < 12; ++e) {
    const std::vector<int64_t> want = epoch_permutation(5, 1, e);
    for (int64_t i = 0; i < 5; ++i) EXPECT_EQ(stream[e * 5 + i], want[i]);
  }
}

std::vector<Batch> take(const Dataset& d, int64_t start, int depth, int count) {
  BatchPipeline pipe(d, tutorial_train_config(24), 16, 1234, start, depth);
  std::vector<Batch> out;
  for (int i = 0; i < count; ++i) out.push_back(pipe.next());
  return out;
}

void expect_bitwise_equal(const Batch& a, const Batch& b) {
  EXPECT_EQ(a.step, b.step);
  EXPECT_EQ(a.labels, b.labels);
  EXPECT_EQ(a.epoch_end, b.epoch_end);
  ASSERT_EQ(a.images.size(), b.images.size());
  EXPECT_EQ(std::memcmp(a.images.data(), b.images.data(), a.images.size() * sizeof(float)), 0)
      << "step " << a.step;
}

TEST(Pipeline, StartingAtStepKEqualsTheKthBatch) {
  const DataSplit s = make_synthetic(3, 32, 32, 10, 50, 1, 3);
  const std::vector<Batch> from0 = take(s.train, 0, 2, 12);
  const std::vector<Batch> from7 = take(s.train, 7, 2, 5);
  for (int i = 0; i < 5; ++i) expect_bitwise_equal(from0[7 + i], from7[i]);
}

TEST(Pipeline, PrefetchDepthAndThreadCountDoNotChangeTheBytes) {
  const DataSplit s = make_synthetic(3, 32, 32, 10, 50, 1, 3);
  const std::vector<Batch> ref = take(s.train, 2, 0, 8);
  for (int depth : {1, 3, 4}) {
    const std::vector<Batch> got = take(s.train, 2, depth, 8);
    for (int i = 0; i < 8; ++i) expect_bitwise_equal(ref[i], got[i]);
  }
  oneapi::tbb::global_control one(oneapi::tbb::global_control::max_allowed_parallelism, 1);
  for (int depth : {0, 3}) {
    const std::vector<Batch> got = take(s.train, 2, depth, 8);
    for (int i = 0; i < 8; ++i) expect_bitwise_equal(ref[i], got[i]);
  }
}

TEST(Pipeline, DestroyWithBatchesInFlight) {
  const DataSplit s = make_synthetic(3, 32, 32, 10, 200, 1, 3);
  for (int i = 0; i < 5; ++i) {
    BatchPipeline pipe(s.train, tutorial_train_config(24), 64, 1, 0, 4);
    if (i % 2) pipe.next();
  }
}

TEST(Pipeline, BadArguments) {
  const Dataset d = index_dataset(5);
  const AugmentConfig c = tutorial_eval_config(2);
  expect_error([&] { BatchPipeline(d, c, 0, 1, 0); }, {"batch size 0"});
  expect_error([&] { BatchPipeline(d, c, 4, 1, -1); }, {"start step -1"});
  expect_error([&] { BatchPipeline(d, c, 4, 1, 0, -2); }, {"prefetch depth -2"});
  expect_error([&] { BatchPipeline(d, tutorial_train_config(3), 4, 1, 0); }, {"'index'"});
  Dataset empty = d;
  empty.images.clear();
  empty.labels.clear();
  expect_error([&] { BatchPipeline(empty, c, 4, 1, 0); }, {"'index'", "no examples"});
}

TEST(Pipeline, EvalBatchIsSequentialEvalTransform) {
  const DataSplit s = make_synthetic(3, 32, 32, 10, 10, 100, 8);
  const AugmentConfig c = tutorial_eval_config(24);
  const int64_t m = example_floats(c, s.test);
  std::vector<float> out(30 * m), one(m);
  std::vector<int32_t> labels(30);
  make_eval_batch(s.test, c, 40, 70, out.data(), labels.data());
  for (int64_t i = 0; i < 30; ++i) {
    transform_eval(c, s.test, 40 + i, one.data());
    EXPECT_EQ(std::memcmp(one.data(), out.data() + i * m, m * sizeof(float)), 0) << i;
    EXPECT_EQ(labels[i], s.test.labels[40 + i]);
  }
}

}  // namespace
}  // namespace towers::data
