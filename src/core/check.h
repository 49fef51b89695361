// check.h — the error types of towers and the one set of macros that raise them:
//   TOWERS_REQUIRE / TOWERS_BAD_INPUT  bad input from a user (a flag, a file): towers::Error,
//                                      the message names the flag or file; no location
//   TOWERS_SYSTEM_FAIL                 the system under towers failed (a file read, CUDA, cuBLAS,
//                                      NCCL, GPU memory): towers::Error, with file:line
//   TOWERS_CHECK / TOWERS_FAIL         a broken invariant of towers itself, that is a bug:
//                                      towers::InternalError, with file:line
// The CLI exits 1 for towers::Error and 3 for InternalError (or any other exception), so an
// exit code of 3 means a bug in towers.
#pragma once

#include <stdexcept>
#include <string>

#include <fmt/format.h>

namespace towers {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// A bug: an invariant of towers does not hold.
class InternalError : public std::logic_error {
 public:
  explicit InternalError(const std::string& what) : std::logic_error(what) {}
};

[[noreturn]] void throw_internal(const char* file, int line, const std::string& msg);
[[noreturn]] void throw_system(const char* file, int line, const std::string& msg);

}  // namespace towers

// TOWERS_CHECK(cond, fmt, args...) throws towers::InternalError with a formatted message.
#define TOWERS_CHECK(cond, ...)                                                        \
  do {                                                                                 \
    if (!(cond)) ::towers::throw_internal(__FILE__, __LINE__, fmt::format(__VA_ARGS__)); \
  } while (0)

// TOWERS_FAIL(fmt, args...) throws InternalError unconditionally.
#define TOWERS_FAIL(...) ::towers::throw_internal(__FILE__, __LINE__, fmt::format(__VA_ARGS__))

// TOWERS_SYSTEM_FAIL(fmt, args...) throws towers::Error with the location: the call that failed
// and the system's own message.
#define TOWERS_SYSTEM_FAIL(...) ::towers::throw_system(__FILE__, __LINE__, fmt::format(__VA_ARGS__))

// TOWERS_REQUIRE(cond, fmt, args...) is for bad input from a user (a flag, a file): the
// message must name the flag or file and say what is wrong; no source location is added,
// since the user, not the code, has to act on it.
#define TOWERS_REQUIRE(cond, ...)                                  \
  do {                                                             \
    if (!(cond)) throw ::towers::Error(fmt::format(__VA_ARGS__));  \
  } while (0)

// TOWERS_BAD_INPUT(fmt, args...) throws a user-facing error unconditionally.
#define TOWERS_BAD_INPUT(...) throw ::towers::Error(fmt::format(__VA_ARGS__))
