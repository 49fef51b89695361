// check.h — the one error type of towers and the macros that raise it.
// Every failure names what failed (the call or condition as text) and where (file:line);
// library errors add the library's own message. Callers catch towers::Error at the CLI boundary.
#pragma once

#include <stdexcept>
#include <string>

#include <fmt/format.h>

namespace towers {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

[[noreturn]] void throw_error(const char* file, int line, const std::string& msg);

}  // namespace towers

// TOWERS_CHECK(cond, fmt, args...) throws towers::Error with a formatted message.
#define TOWERS_CHECK(cond, ...)                                                     \
  do {                                                                              \
    if (!(cond)) ::towers::throw_error(__FILE__, __LINE__, fmt::format(__VA_ARGS__)); \
  } while (0)

// TOWERS_FAIL(fmt, args...) throws unconditionally.
#define TOWERS_FAIL(...) ::towers::throw_error(__FILE__, __LINE__, fmt::format(__VA_ARGS__))

// TOWERS_REQUIRE(cond, fmt, args...) is for bad input from a user (a flag, a file): the
// message must name the flag or file and say what is wrong; no source location is added,
// since the user, not the code, has to act on it.
#define TOWERS_REQUIRE(cond, ...)                                  \
  do {                                                             \
    if (!(cond)) throw ::towers::Error(fmt::format(__VA_ARGS__));  \
  } while (0)

// TOWERS_BAD_INPUT(fmt, args...) throws a user-facing error unconditionally.
#define TOWERS_BAD_INPUT(...) throw ::towers::Error(fmt::format(__VA_ARGS__))
