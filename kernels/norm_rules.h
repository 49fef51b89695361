// norm_rules.h — the L2 norm of a gradient over its trainable variables and the clip scale
// taken from it (--clip-grad-norm, --on-divergence skip-step), in an order that the host and
// a GPU block both keep, so that the norm, and so the clipped update, is the same bits on
// either side:
//   - the array is cut into chunks of kNormChunk floats;
//   - in chunk [b, e), lane l of kNormLanes adds x[j]^2 in double for j = b + l,
//     b + l + kNormLanes, ... in order, over the elements of the kept ranges only (the
//     trainable variables: not the state variables, whose deltas travel with the gradient but
//     are no gradient, nor the padding between variables);
//   - the chunk's total is its lanes added in order 0, 1, ...;
//   - the norm is the square root of the chunk totals added in chunk order.
// The host walks a chunk row by row (norm_chunk, so that it vectorises), the CUDA kernel runs
// a block per chunk and a thread per lane (norm_lane), the emulator calls norm_lane per lane.
// The square of a float is exact in double, so an FMA (s + v * v contracted) rounds as the
// separate multiply and add do.
// Kept ranges are nkeep [begin, end) pairs, flattened (keep[2 r], keep[2 r + 1]), sorted and
// disjoint. Plain C++17 with TOWERS_HD: compiled by g++ without CUDA headers as well as by nvcc.
#pragma once

#include <cmath>  // sqrt (host); nvcc provides the device sqrt
#include <cstdint>

#include "kernels/hd.h"

namespace towers::kernels {

constexpr int kNormLanes = 256;
constexpr int64_t kNormChunk = int64_t{1} << 15;
static_assert(kNormChunk % kNormLanes == 0, "a chunk is whole rows of lanes");
// The largest finite double (DBL_MAX, written out: a host header may spell it as a long double).
constexpr double kNormFiniteMax = 1.7976931348623157e308;

// The chunks of an array of n floats.
TOWERS_HD int64_t norm_chunks(int64_t n) { return (n + kNormChunk - 1) / kNormChunk; }

// Lane l's sum of squares over chunk [b, e).
TOWERS_HD double norm_lane(const float* x, int64_t b, int64_t e, int l, const int64_t* keep,
                           int64_t nkeep) {
  double s = 0.0;
  int64_t r = 0;
  for (int64_t j = b + l; j < e; j += kNormLanes) {
    while (r < nkeep && j >= keep[2 * r + 1]) ++r;
    if (r == nkeep) break;
    if (j < keep[2 * r]) {  // before the next kept range: on to this lane's first element in it
      j += (keep[2 * r] - j - 1) / kNormLanes * kNormLanes;
      continue;
    }
    const double v = x[j];
    s += v * v;
  }
  return s;
}

// A chunk's total from its lanes, in lane order.
TOWERS_HD double norm_lanes_total(const double* lanes) {
  double t = 0.0;
  for (int l = 0; l < kNormLanes; ++l) t += lanes[l];
  return t;
}

// The factor a clipped update scales its gradient by: bound / norm where the norm is finite
// and above a positive bound, else 1 (a product with 1 leaves every float as it is). An update
// whose norm is not finite is skipped, never clipped.
TOWERS_HD float norm_clip_scale(double norm, double bound) {
  return bound > 0.0 && norm > bound && norm <= kNormFiniteMax ? static_cast<float>(bound / norm)
                                                                : 1.0f;
}

// The guard's last step from the chunks' totals (partials[0, chunks)): their sum in chunk
// order and its root into *norm, the clip factor into *scale, and *flag = 1 where flag is not
// null and the norm is not finite (else *flag is left as it is).
TOWERS_HD void norm_finish(int64_t chunks, const double* partials, double bound, double* norm,
                           float* scale, int32_t* flag) {
  double t = 0.0;
  for (int64_t k = 0; k < chunks; ++k) t += partials[k];
  const double r = sqrt(t);
  *norm = r;
  *scale = norm_clip_scale(r, bound);
  if (flag != nullptr && !(r <= kNormFiniteMax)) *flag = 1;
}

// ---- the host's walk of one chunk ---------------------------------------------------------

// Chunk [b, e)'s total: the kept runs of elements, each cut where the lanes wrap, so that a
// run's elements land on consecutive lanes (each lane still adds its elements in order).
inline double norm_chunk(const float* x, int64_t b, int64_t e, const int64_t* keep,
                         int64_t nkeep) {
  double lanes[kNormLanes] = {};
  for (int64_t r = 0; r < nkeep; ++r) {
    int64_t j = keep[2 * r] > b ? keep[2 * r] : b;
    const int64_t stop = keep[2 * r + 1] < e ? keep[2 * r + 1] : e;
    while (j < stop) {
      const int64_t l0 = (j - b) % kNormLanes;
      const int64_t k = j + (kNormLanes - l0) < stop ? j + (kNormLanes - l0) : stop;
      double* a = lanes + l0;
      const float* v = x + j;
      for (int64_t i = 0; i < k - j; ++i) a[i] += static_cast<double>(v[i]) * v[i];
      j = k;
    }
  }
  return norm_lanes_total(lanes);
}

}  // namespace towers::kernels
