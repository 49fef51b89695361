#include "core/check.h"

namespace towers {

// The message comes first: it is what a user reads. The location helps whoever fixes it.
[[noreturn]] void throw_internal(const char* file, int line, const std::string& msg) {
  throw InternalError(fmt::format("{} [{}:{}]", msg, file, line));
}

[[noreturn]] void throw_system(const char* file, int line, const std::string& msg) {
  throw Error(fmt::format("{} [{}:{}]", msg, file, line));
}

}  // namespace towers
