#include "io/safetensors.h"

#include <fcntl.h>     // open
#include <sys/stat.h>  // fstat
#include <unistd.h>    // pread, write, fsync, close, unlink, getpid

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <set>
#include <tuple>
#include <utility>

#include <nlohmann/json.hpp>

#include "core/check.h"

namespace towers::io {
namespace {

static_assert(std::endian::native == std::endian::little,
              "safetensors is little-endian; towers writes host floats as they are");

constexpr int64_t kMaxHeaderBytes = 100'000'000;  // the limit of the reference implementation

std::string errno_text() { return std::strerror(errno); }

// An owned file descriptor; closes on scope exit.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& other) noexcept : fd_(other.release()) {}
  Fd& operator=(Fd&&) = delete;
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }

 private:
  int fd_;
};

void write_all(int fd, const void* data, size_t bytes, const std::string& path,
               const std::string& tmp) {
  const auto* p = static_cast<const unsigned char*>(data);
  while (bytes > 0) {
    ssize_t n = ::write(fd, p, bytes);
    if (n < 0 && errno == EINTR) continue;
    TOWERS_REQUIRE(n > 0, "cannot write '{}': writing temporary file '{}' failed: {}", path, tmp,
                   errno_text());
    p += n;
    bytes -= static_cast<size_t>(n);
  }
}

// Reads exactly `bytes` at `offset`; a short read means the file changed under us.
void read_all(int fd, void* out, size_t bytes, int64_t offset, const std::string& path) {
  auto* p = static_cast<unsigned char*>(out);
  while (bytes > 0) {
    ssize_t n = ::pread(fd, p, bytes, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    TOWERS_REQUIRE(n >= 0, "safetensors file '{}': read failed: {}", path, errno_text());
    TOWERS_REQUIRE(n > 0, "safetensors file '{}': unexpected end of file at byte {}", path, offset);
    p += n;
    offset += n;
    bytes -= static_cast<size_t>(n);
  }
}

void fsync_directory(const std::string& dir, const std::string& path) {
  Fd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  TOWERS_REQUIRE(fd.get() >= 0, "wrote '{}' but cannot open its directory '{}' to fsync it: {}",
                 path, dir, errno_text());
  // EINVAL: the file system does not support fsync on directories; nothing more can be done.
  TOWERS_REQUIRE(::fsync(fd.get()) == 0 || errno == EINVAL,
                 "wrote '{}' but fsync of its directory '{}' failed: {}", path, dir, errno_text());
}

std::string header_json(const std::vector<TensorView>& tensors, const Metadata& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::set<std::string> names;
  int64_t offset = 0;
  for (const TensorView& t : tensors) {
    TOWERS_CHECK(!t.name.empty() && t.name != "__metadata__", "bad tensor name '{}'", t.name);
    TOWERS_CHECK(names.insert(t.name).second, "duplicate tensor name '{}'", t.name);
    for (int64_t d : t.shape)
      TOWERS_CHECK(d >= 0, "tensor '{}' has shape {}", t.name, to_string(t.shape));
    int64_t bytes = numel(t.shape) * static_cast<int64_t>(sizeof(float));
    TOWERS_CHECK(bytes == 0 || t.data != nullptr, "tensor '{}' has no data", t.name);
    header[t.name] = {
        {"dtype", "F32"}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  // `replace`: a name or value that is not valid UTF-8 must not abort a save.
  std::string text = header.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
  text.resize((text.size() + 7) / 8 * 8, ' ');  // so the data section starts 8-byte aligned
  return text;
}

// The non-negative integer in `j`, or -1.
int64_t as_count(const nlohmann::json& j) {
  if (j.is_number_unsigned()) {
    uint64_t v = j.get<uint64_t>();
    return v <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ? static_cast<int64_t>(v)
                                                                           : -1;
  }
  if (j.is_number_integer()) return std::max<int64_t>(j.get<int64_t>(), -1);
  return -1;
}

TensorEntry parse_entry(const std::string& path, const std::string& name, const nlohmann::json& j,
                        int64_t data_size) {
  TOWERS_REQUIRE(
      j.is_object() && j.contains("dtype") && j.contains("shape") && j.contains("data_offsets"),
      "safetensors file '{}': header entry for tensor '{}' is not an object with dtype, "
      "shape and data_offsets",
      path, name);
  const nlohmann::json& dtype = j["dtype"];
  TOWERS_REQUIRE(dtype.is_string(),
                 "safetensors file '{}': tensor '{}' has a dtype that is not a string", path, name);
  TOWERS_REQUIRE(dtype.get<std::string>() == "F32",
                 "safetensors file '{}': tensor '{}' has dtype {}; towers reads only F32", path,
                 name, dtype.get<std::string>());

  TensorEntry e;
  e.name = name;
  const nlohmann::json& shape = j["shape"];
  TOWERS_REQUIRE(shape.is_array(),
                 "safetensors file '{}': tensor '{}' has a shape that is not an array", path, name);
  int64_t elements = 1;
  for (const nlohmann::json& d : shape) {
    int64_t dim = as_count(d);
    TOWERS_REQUIRE(dim >= 0,
                   "safetensors file '{}': tensor '{}' has shape {} with a dimension that is "
                   "not a non-negative integer",
                   path, name, shape.dump());
    e.shape.push_back(dim);
    TOWERS_REQUIRE(dim == 0 || elements <= std::numeric_limits<int64_t>::max() / 8 / dim,
                   "safetensors file '{}': tensor '{}' has shape {} with too many elements", path,
                   name, shape.dump());
    elements *= dim;
  }

  const nlohmann::json& offsets = j["data_offsets"];
  TOWERS_REQUIRE(
      offsets.is_array() && offsets.size() == 2 && as_count(offsets[0]) >= 0 &&
          as_count(offsets[1]) >= 0,
      "safetensors file '{}': tensor '{}' has data_offsets {}; expected [begin, end] in bytes",
      path, name, offsets.dump());
  e.begin = as_count(offsets[0]);
  e.end = as_count(offsets[1]);
  TOWERS_REQUIRE(
      e.begin <= e.end && e.end <= data_size,
      "safetensors file '{}': tensor '{}' has data_offsets [{}, {}] outside the data section "
      "of {} bytes (is the file truncated?)",
      path, name, e.begin, e.end, data_size);
  TOWERS_REQUIRE(
      e.end - e.begin == elements * 4,
      "safetensors file '{}': tensor '{}' of shape {} needs {} bytes but data_offsets [{}, {}] "
      "span {}",
      path, name, to_string(e.shape), elements * 4, e.begin, e.end, e.end - e.begin);
  return e;
}

SafetensorsHeader parse_header(const std::string& path, const std::string& text,
                               int64_t data_size) {
  const nlohmann::json j =
      parse_file_json(text, fmt::format("safetensors file '{}': header", path));
  TOWERS_REQUIRE(j.is_object(), "safetensors file '{}': header is JSON but not an object", path);

  SafetensorsHeader h;
  h.data_size = data_size;
  for (const auto& [name, value] : j.items()) {
    if (name == "__metadata__") {
      TOWERS_REQUIRE(value.is_object(), "safetensors file '{}': __metadata__ is not an object",
                     path);
      for (const auto& [key, v] : value.items()) {
        TOWERS_REQUIRE(v.is_string(),
                       "safetensors file '{}': __metadata__ value '{}' is not a string", path, key);
        h.metadata[key] = v.get<std::string>();
      }
      continue;
    }
    h.tensors.push_back(parse_entry(path, name, value, data_size));
  }

  std::sort(h.tensors.begin(), h.tensors.end(), [](const TensorEntry& a, const TensorEntry& b) {
    return std::tie(a.begin, a.end) < std::tie(b.begin, b.end);
  });
  for (size_t i = 1; i < h.tensors.size(); ++i) {
    const TensorEntry& a = h.tensors[i - 1];
    const TensorEntry& b = h.tensors[i];
    TOWERS_REQUIRE(b.begin >= a.end,
                   "safetensors file '{}': tensors '{}' [{}, {}] and '{}' [{}, {}] overlap", path,
                   a.name, a.begin, a.end, b.name, b.begin, b.end);
  }
  return h;
}

Fd open_for_reading(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TOWERS_REQUIRE(fd >= 0 || errno != ENOENT, "safetensors file '{}' does not exist", path);
  TOWERS_REQUIRE(fd >= 0, "cannot open safetensors file '{}': {}", path, errno_text());
  return Fd(fd);
}

SafetensorsHeader read_header(const Fd& fd, const std::string& path) {
  struct stat st {};
  TOWERS_REQUIRE(::fstat(fd.get(), &st) == 0, "cannot stat safetensors file '{}': {}", path,
                 errno_text());
  TOWERS_REQUIRE(S_ISREG(st.st_mode), "safetensors file '{}' is not a regular file", path);
  const int64_t file_size = st.st_size;
  TOWERS_REQUIRE(file_size >= 8,
                 "safetensors file '{}' has {} bytes, too short for the 8-byte header length", path,
                 file_size);

  uint64_t n = 0;
  read_all(fd.get(), &n, sizeof n, 0, path);
  TOWERS_REQUIRE(
      n < static_cast<uint64_t>(kMaxHeaderBytes),
      "safetensors file '{}': header length {} is over the 100 MB limit (not a safetensors file?)",
      path, n);
  TOWERS_REQUIRE(n <= static_cast<uint64_t>(file_size - 8),
                 "safetensors file '{}': header length {} runs past the end of the {}-byte file "
                 "(truncated, or not a safetensors file)",
                 path, n, file_size);

  std::string text(n, '\0');
  read_all(fd.get(), text.data(), text.size(), 8, path);
  SafetensorsHeader h = parse_header(path, text, file_size - 8 - static_cast<int64_t>(n));
  h.data_offset = 8 + static_cast<int64_t>(n);
  return h;
}

}  // namespace

void write_safetensors(const std::string& path, const std::vector<TensorView>& tensors,
                       const Metadata& metadata) {
  const std::string header = header_json(tensors, metadata);
  std::string dir = std::filesystem::path(path).parent_path().string();
  if (dir.empty()) dir = ".";
  const std::string tmp = fmt::format("{}.tmp-{}", path, ::getpid());

  int raw = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  TOWERS_REQUIRE(raw >= 0, "cannot write '{}': cannot create temporary file '{}': {}", path, tmp,
                 errno_text());
  bool renamed = false;
  try {
    Fd fd(raw);
    const uint64_t n = header.size();
    write_all(fd.get(), &n, sizeof n, path, tmp);
    write_all(fd.get(), header.data(), header.size(), path, tmp);
    for (const TensorView& t : tensors)
      if (numel(t.shape) > 0)
        write_all(fd.get(), t.data, static_cast<size_t>(numel(t.shape)) * sizeof(float), path, tmp);
    // Raw write(2) has no user-space buffer to flush; fsync puts the bytes on disk before the
    // rename makes them visible under `path`.
    TOWERS_REQUIRE(::fsync(fd.get()) == 0, "cannot write '{}': fsync of '{}' failed: {}", path, tmp,
                   errno_text());
    TOWERS_REQUIRE(::close(fd.release()) == 0, "cannot write '{}': closing '{}' failed: {}", path,
                   tmp, errno_text());
    TOWERS_REQUIRE(::rename(tmp.c_str(), path.c_str()) == 0,
                   "cannot write '{}': renaming '{}' over it failed: {}", path, tmp, errno_text());
    renamed = true;
    fsync_directory(dir, path);
  } catch (...) {
    if (!renamed) ::unlink(tmp.c_str());
    throw;
  }
}

nlohmann::json parse_file_json(const std::string& text, const std::string& what) {
  // depth: the number of arrays and objects around the value (0 at the top level). A value
  // too deep is dropped at once and the parse goes on: the parser itself does not recurse.
  bool too_deep = false;
  nlohmann::json j = nlohmann::json::parse(
      text,
      [&](int depth, nlohmann::json::parse_event_t, nlohmann::json&) {
        if (depth > kMaxJsonDepth) too_deep = true;
        return !too_deep;
      },
      /*allow_exceptions=*/false);
  TOWERS_REQUIRE(!j.is_discarded(), "{} is not valid JSON", what);
  TOWERS_REQUIRE(!too_deep, "{} nests arrays and objects more than {} deep", what, kMaxJsonDepth);
  return j;
}

const TensorEntry* SafetensorsHeader::find(const std::string& name) const {
  for (const TensorEntry& t : tensors)
    if (t.name == name) return &t;
  return nullptr;
}

SafetensorsHeader read_safetensors_header(const std::string& path) {
  return read_header(open_for_reading(path), path);
}

SafetensorsFile read_safetensors(const std::string& path) {
  Fd fd = open_for_reading(path);
  SafetensorsFile f;
  f.header = read_header(fd, path);
  f.data.resize(static_cast<size_t>(f.header.data_size));
  read_all(fd.get(), f.data.data(), f.data.size(), f.header.data_offset, path);
  return f;
}

void SafetensorsFile::copy_to(const TensorEntry& tensor, float* out) const {
  TOWERS_CHECK(tensor.end <= static_cast<int64_t>(data.size()), "tensor '{}' is outside the data",
               tensor.name);
  if (tensor.end > tensor.begin)
    std::memcpy(out, data.data() + tensor.begin, static_cast<size_t>(tensor.end - tensor.begin));
}

}  // namespace towers::io
