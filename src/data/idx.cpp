#include "data/idx.h"

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <exception>
#include <filesystem>
#include <string_view>

#include <fmt/ranges.h>
#include <oneapi/tbb/parallel_invoke.h>
#include <zlib.h>

#include "core/check.h"

namespace towers::data {
namespace {

namespace fs = std::filesystem;

// gzread reads plain files transparently, so one path serves both forms.
class GzFile {
 public:
  explicit GzFile(const std::string& path) : path_(path) {
    std::error_code ec;
    TOWERS_REQUIRE(fs::exists(path, ec), "'{}': no such file", path);
    TOWERS_REQUIRE(!fs::is_directory(path, ec), "'{}': is a directory, expected a file", path);
    const auto size = fs::file_size(path, ec);
    size_ = ec ? 0 : static_cast<int64_t>(std::min<uintmax_t>(size, uintmax_t{1} << 40));
    file_ = gzopen(path.c_str(), "rb");
    TOWERS_REQUIRE(file_ != nullptr, "'{}': cannot open: {}", path, std::strerror(errno));
    gzbuffer(file_, 1 << 20);  // the 8 KiB default makes decompression call-bound
  }
  ~GzFile() { gzclose(file_); }
  GzFile(const GzFile&) = delete;
  GzFile& operator=(const GzFile&) = delete;

  // Up to n bytes; fewer only at the end of the data. A corrupt stream throws.
  int64_t read(void* dst, int64_t n) {
    int64_t got = 0;
    while (got < n) {
      const unsigned want = static_cast<unsigned>(std::min<int64_t>(n - got, 1 << 30));
      const int r = gzread(file_, static_cast<char*>(dst) + got, want);
      if (r < 0) {
        int errnum = 0;
        std::string_view msg = gzerror(file_, &errnum);
        if (errnum == Z_ERRNO)
          TOWERS_SYSTEM_FAIL("'{}': read error: {}", path_, std::strerror(errno));
        // zlib's message starts with the path again.
        if (msg.starts_with(path_ + ": ")) msg.remove_prefix(path_.size() + 2);
        TOWERS_BAD_INPUT("'{}': corrupt gzip data: {}", path_, msg);
      }
      if (r == 0) break;
      got += r;
    }
    return got;
  }

  // The most bytes the file can yield: its size, or 1032 times that when it is gzip (the most
  // a deflate stream expands); 0 when unknown (not a regular file). Valid after a read.
  int64_t max_bytes() const { return gzdirect(file_) ? size_ : size_ * 1032; }

 private:
  std::string path_;
  int64_t size_ = 0;  // on disk
  gzFile file_ = nullptr;
};

uint32_t big_endian(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | p[3];
}

// Reads the magic and dims; the dims come back as the IDX header states them.
std::vector<int64_t> read_header(GzFile& in, const std::string& path, int ndims, const char* what) {
  // The magic first: a file of the wrong kind is reported as such, even when it is short.
  std::array<uint8_t, 4 + 4 * 3> header{};
  const int64_t want = 4 + 4 * ndims;
  int64_t got = in.read(header.data(), 4);
  if (got == 4) {
    const uint32_t magic = big_endian(header.data());
    const uint32_t expected = 0x0800u | static_cast<uint32_t>(ndims);
    TOWERS_REQUIRE(magic == expected,
                   "'{}': wrong IDX magic 0x{:08x} (type byte 0x{:02x}, dim count {}), expected "
                   "0x{:08x} (type byte 0x08 = unsigned byte, dim count {}) for {}",
                   path, magic, header[2], header[3], expected, ndims, what);
    got += in.read(header.data() + 4, want - 4);
  }
  TOWERS_REQUIRE(got == want, "'{}': truncated IDX header: {} of {} bytes", path, got, want);
  std::vector<int64_t> dims(ndims);
  for (int d = 0; d < ndims; ++d) dims[d] = big_endian(header.data() + 4 + 4 * d);
  for (int64_t d : dims)
    TOWERS_REQUIRE(d > 0, "'{}': IDX header dim of size 0 ({})", path, fmt::join(dims, "x"));
  return dims;
}

// Exactly `want` bytes must follow the header: fewer is a truncated file, more is garbage.
std::vector<uint8_t> read_payload(GzFile& in, const std::string& path,
                                  const std::vector<int64_t>& dims) {
  // A header is 32-bit dims; a bound keeps a corrupt one from overflowing int64.
  constexpr int64_t kMaxBytes = int64_t{1} << 40;
  int64_t want = 1;
  for (int64_t d : dims) {
    TOWERS_REQUIRE(want <= kMaxBytes / d, "'{}': IDX header dims {} imply more than {} bytes", path,
                   fmt::join(dims, "x"), kMaxBytes);
    want *= d;
  }
  // A header may claim more than the file holds: reserve no more than the file can yield, and
  // read in steps no larger than what has arrived so far (64 KiB at first, 16 MiB at most).
  std::vector<uint8_t> out;
  out.reserve(static_cast<size_t>(std::min(want, in.max_bytes())));
  int64_t got = 0;
  while (got < want) {
    const int64_t n = std::min({want - got, std::max<int64_t>(got, 64 << 10), int64_t{16} << 20});
    out.resize(static_cast<size_t>(got + n));
    const int64_t r = in.read(out.data() + got, n);
    got += r;
    if (r < n) break;
  }
  TOWERS_REQUIRE(got == want,
                 "'{}': truncated: the IDX header ({}) promises {} data bytes, the file holds "
                 "only {}",
                 path, fmt::join(dims, "x"), want, got);
  uint8_t extra[64];
  const int64_t more = in.read(extra, sizeof extra);
  TOWERS_REQUIRE(more == 0,
                 "'{}': trailing garbage: bytes after the {} data bytes the IDX header ({}) "
                 "promises",
                 path, want, fmt::join(dims, "x"));
  return out;
}

struct IdxImages {
  int64_t count, height, width;
  std::vector<uint8_t> pixels;
};

IdxImages read_images(const std::string& path) {
  GzFile in(path);
  const std::vector<int64_t> dims = read_header(in, path, 3, "images");
  return {dims[0], dims[1], dims[2], read_payload(in, path, dims)};
}

std::vector<int32_t> read_labels(const std::string& path, int num_classes) {
  GzFile in(path);
  const std::vector<int64_t> dims = read_header(in, path, 1, "labels");
  const std::vector<uint8_t> bytes = read_payload(in, path, dims);
  std::vector<int32_t> labels(bytes.begin(), bytes.end());
  for (size_t i = 0; i < labels.size(); ++i)
    TOWERS_REQUIRE(labels[i] < num_classes,
                   "'{}': label {} at index {} is out of range: expected a value < {} "
                   "(the number of classes)",
                   path, labels[i], i, num_classes);
  return labels;
}

// The file itself, or its ".gz" form; a miss names the directory and both names tried.
std::string find_file(const std::string& dir, const std::string& base) {
  std::error_code ec;
  TOWERS_REQUIRE(fs::is_directory(dir, ec), "Fashion-MNIST directory '{}' does not exist", dir);
  for (const std::string& name : {base, base + ".gz"}) {
    const fs::path p = fs::path(dir) / name;
    if (fs::exists(p, ec)) return p.string();
  }
  throw Error(
      fmt::format("Fashion-MNIST: neither '{}' nor '{}.gz' found in '{}'", base, base, dir));
}

}  // namespace

Dataset read_idx_pair(const std::string& images_path, const std::string& labels_path,
                      const std::string& name, int num_classes) {
  TOWERS_CHECK(num_classes > 0 && num_classes <= 256, "num_classes {} for uint8 labels",
               num_classes);
  IdxImages images = read_images(images_path);
  std::vector<int32_t> labels = read_labels(labels_path, num_classes);
  TOWERS_REQUIRE(images.count == static_cast<int64_t>(labels.size()),
                 "'{}' holds {} images but '{}' holds {} labels", images_path, images.count,
                 labels_path, labels.size());
  Dataset d;
  d.name = name;
  d.channels = 1;
  d.height = images.height;
  d.width = images.width;
  d.num_classes = num_classes;
  d.images = std::move(images.pixels);
  d.labels = std::move(labels);
  return d;
}

DataSplit load_fashion_mnist(const std::string& dir) {
  // Look up every file first, so a missing one is reported before any decompression.
  const std::string train_images = find_file(dir, "train-images-idx3-ubyte");
  const std::string train_labels = find_file(dir, "train-labels-idx1-ubyte");
  const std::string test_images = find_file(dir, "t10k-images-idx3-ubyte");
  const std::string test_labels = find_file(dir, "t10k-labels-idx1-ubyte");

  // Decompressing is CPU-bound, so the two halves run side by side; errors are rethrown
  // train first, so which one a user sees does not depend on scheduling.
  DataSplit split;
  std::exception_ptr train_error, test_error;
  oneapi::tbb::parallel_invoke(
      [&] {
        try {
          split.train = read_idx_pair(train_images, train_labels, "fashion-mnist/train", 10);
        } catch (...) {
          train_error = std::current_exception();
        }
      },
      [&] {
        try {
          split.test = read_idx_pair(test_images, test_labels, "fashion-mnist/test", 10);
        } catch (...) {
          test_error = std::current_exception();
        }
      });
  if (train_error) std::rethrow_exception(train_error);
  if (test_error) std::rethrow_exception(test_error);
  return split;
}

}  // namespace towers::data
