// parallel.h — the one place that splits work over oneTBB threads.
// Splits are fixed by the problem size, never by the thread count, so a result that is
// reduced over chunks is bitwise the same whatever the number of threads.
#pragma once

#include <cstdint>

#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>

namespace towers {

constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Calls fn(chunk_index, begin, end) for the chunks [k*chunk, min((k+1)*chunk, n)).
template <class Fn>
void for_chunks(int64_t n, int64_t chunk, Fn&& fn) {
  const int64_t count = ceil_div(n, chunk);
  oneapi::tbb::parallel_for(
      oneapi::tbb::blocked_range<int64_t>(0, count, 1),
      [&](const oneapi::tbb::blocked_range<int64_t>& r) {
        for (int64_t k = r.begin(); k != r.end(); ++k) {
          int64_t b = k * chunk;
          int64_t e = b + chunk < n ? b + chunk : n;
          fn(k, b, e);
        }
      },
      oneapi::tbb::simple_partitioner());
}

}  // namespace towers
