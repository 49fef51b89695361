#include "core/check.h"

namespace towers {

[[noreturn]] void throw_error(const char* file, int line, const std::string& msg) {
  // The message comes first: it is what a user reads. The location helps whoever fixes it.
  throw Error(fmt::format("{} [{}:{}]", msg, file, line));
}

}  // namespace towers
