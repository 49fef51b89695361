#include "data/cifar10.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>

#include "core/check.h"

namespace towers::data {
namespace {

namespace fs = std::filesystem;

constexpr int64_t kImageBytes = kCifar10RecordBytes - 1;

// Validates the size first, so a wrong file is rejected before anything is read or allocated.
int64_t record_count(const std::string& path) {
  std::error_code ec;
  TOWERS_REQUIRE(fs::exists(path, ec), "'{}': no such file", path);
  TOWERS_REQUIRE(fs::is_regular_file(path, ec), "'{}': not a regular file", path);
  const auto size = static_cast<int64_t>(fs::file_size(path, ec));
  TOWERS_REQUIRE(!ec, "'{}': cannot read its size: {}", path, ec.message());
  TOWERS_REQUIRE(size > 0 && size % kCifar10RecordBytes == 0,
                 "'{}': size {} bytes is not a nonzero multiple of {} (CIFAR-10 records are "
                 "1 label byte + 3072 pixel bytes)",
                 path, size, kCifar10RecordBytes);
  return size / kCifar10RecordBytes;
}

void read_records(const std::string& path, int64_t count, uint8_t* images, int32_t* labels) {
  std::unique_ptr<FILE, int (*)(FILE*)> f(std::fopen(path.c_str(), "rb"), &std::fclose);
  TOWERS_REQUIRE(f != nullptr, "'{}': cannot open: {}", path, std::strerror(errno));
  uint8_t record[kCifar10RecordBytes];
  for (int64_t i = 0; i < count; ++i) {
    TOWERS_REQUIRE(std::fread(record, 1, sizeof record, f.get()) == sizeof record,
                   "'{}': read failed at record {}: {}", path, i,
                   std::ferror(f.get()) ? std::strerror(errno) : "unexpected end of file");
    TOWERS_REQUIRE(record[0] < 10, "'{}': record {} has label {}, expected a value < 10", path, i,
                   record[0]);
    labels[i] = record[0];
    std::memcpy(images + i * kImageBytes, record + 1, kImageBytes);
  }
}

std::string find_dir(const std::string& dir) {
  std::error_code ec;
  TOWERS_REQUIRE(fs::is_directory(dir, ec), "CIFAR-10 directory '{}' does not exist", dir);
  // The official archive unpacks into this subfolder; accept the parent as well.
  const fs::path sub = fs::path(dir) / "cifar-10-batches-bin";
  if (!fs::exists(fs::path(dir) / "test_batch.bin", ec) && fs::is_directory(sub, ec))
    return sub.string();
  return dir;
}

}  // namespace

Dataset read_cifar10_files(const std::vector<std::string>& paths, const std::string& name) {
  TOWERS_CHECK(!paths.empty(), "read_cifar10_files: no files for '{}'", name);
  std::vector<int64_t> counts;
  int64_t total = 0;
  for (const std::string& p : paths) total += counts.emplace_back(record_count(p));
  Dataset d;
  d.name = name;
  d.channels = 3;
  d.height = 32;
  d.width = 32;
  d.num_classes = 10;
  d.images.resize(static_cast<size_t>(total * kImageBytes));
  d.labels.resize(static_cast<size_t>(total));
  int64_t at = 0;
  for (size_t k = 0; k < paths.size(); ++k) {
    read_records(paths[k], counts[k], d.images.data() + at * kImageBytes, d.labels.data() + at);
    at += counts[k];
  }
  return d;
}

DataSplit load_cifar10(const std::string& dir) {
  const std::string root = find_dir(dir);
  auto path = [&](const std::string& file) {
    const fs::path p = fs::path(root) / file;
    std::error_code ec;
    TOWERS_REQUIRE(fs::exists(p, ec),
                   "CIFAR-10: '{}' not found in '{}' (nor in '{}/cifar-10-batches-bin'); "
                   "expected data_batch_1.bin .. data_batch_5.bin and test_batch.bin",
                   file, dir, dir);
    return p.string();
  };
  std::vector<std::string> train;
  for (int k = 1; k <= 5; ++k) train.push_back(path(fmt::format("data_batch_{}.bin", k)));
  const std::string test = path("test_batch.bin");  // a missing file is found before reading
  DataSplit split;
  split.train = read_cifar10_files(train, "cifar10/train");
  split.test = read_cifar10_files({test}, "cifar10/test");
  return split;
}

}  // namespace towers::data
