// relaxed.h — element-wise relaxed atomic copies of float arrays that other threads write
// concurrently (the Hogwild modes). A reader may see a mix of old and new values, never a torn
// float, and the race is well-defined C++.
#pragma once

#include <atomic>
#include <cstdint>

namespace towers {

inline void load_relaxed(const float* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    dst[i] = std::atomic_ref<float>(const_cast<float&>(src[i])).load(std::memory_order_relaxed);
}

inline void store_relaxed(const float* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    std::atomic_ref<float>(dst[i]).store(src[i], std::memory_order_relaxed);
}

}  // namespace towers
