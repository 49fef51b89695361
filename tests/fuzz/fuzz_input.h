// fuzz_input.h — what the fuzz targets share: the readers take paths, so each input is written
// to a file of this process (in /dev/shm when it exists, so no disk is touched) and the real
// reader opens it; and an input is split into the parts a two-file reader needs.
#pragma once

#include <fcntl.h>   // open
#include <unistd.h>  // write, close, unlink, getpid

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <string_view>

namespace towers::fuzz {

// A file named after the process and `name`, rewritten with each input; removed on exit.
class ScratchFile {
 public:
  explicit ScratchFile(const std::string& name) {
    std::error_code ec;
    const char* dir = std::filesystem::is_directory("/dev/shm", ec) ? "/dev/shm" : "/tmp";
    path_ = std::string(dir) + "/towers-fuzz-" + std::to_string(::getpid()) + "-" + name;
  }
  ~ScratchFile() { ::unlink(path_.c_str()); }
  ScratchFile(const ScratchFile&) = delete;
  ScratchFile& operator=(const ScratchFile&) = delete;

  // Replaces the file's contents with `bytes`; returns its path. A failed write is the harness's
  // fault, not the reader's, so it aborts rather than letting the reader see a partial file.
  const std::string& write(std::string_view bytes) {
    const int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) die("cannot create");
    size_t done = 0;
    while (done < bytes.size()) {
      const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
      if (n <= 0) die("cannot write");
      done += static_cast<size_t>(n);
    }
    ::close(fd);
    return path_;
  }

 private:
  [[noreturn]] void die(const char* what) const {
    std::perror((std::string(what) + " " + path_).c_str());
    std::abort();
  }
  std::string path_;
};

// The whole input as bytes.
inline std::string_view as_bytes(const uint8_t* data, size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

// An input for two files: a 2-byte little-endian length L, then the first file (L bytes, or
// what remains if fewer), then the second file (the rest).
struct TwoFiles {
  std::string_view first, second;
};

inline TwoFiles split_two(std::string_view in) {
  if (in.size() < 2) return {{}, {}};
  const size_t len =
      static_cast<uint8_t>(in[0]) | (static_cast<size_t>(static_cast<uint8_t>(in[1])) << 8);
  in.remove_prefix(2);
  const size_t first = len < in.size() ? len : in.size();
  return {in.substr(0, first), in.substr(first)};
}

}  // namespace towers::fuzz
