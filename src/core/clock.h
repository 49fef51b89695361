// clock.h — the one clock of step times, bubbles and run times: monotonic wall time.
#pragma once

#include <chrono>

namespace towers {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

}  // namespace towers
