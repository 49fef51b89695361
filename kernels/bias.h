// bias.h — per-channel bias for (n, C, HW) tensors (a dense layer is HW = 1).
#pragma once

#include <cstdint>

#include "kernels/hd.h"

namespace towers::kernels {

namespace cpu {

// y[b, c, :] += bias[c]
void bias_add(int64_t n, int64_t c, int64_t hw, const float* bias, float* y);
// db[c] (+)= sum_{b, i} dy[b, c, i]; accumulate selects += over =.
void bias_grad(int64_t n, int64_t c, int64_t hw, const float* dy, float* db, bool accumulate);

}  // namespace cpu

namespace cuda {
// y[b, c, :] += bias[c], then ReLU when relu (in place).
void bias_add(CUstream_st* s, int64_t n, int64_t c, int64_t hw, const float* bias, float* y,
              bool relu = false);

// The segments the n x HW terms of each of c channels are split into for bias_grad, a block
// each, so that a layer with few channels and many terms still fills the GPU: enough for
// about 512 blocks, each with at least 2048 terms (8 per thread), at most 64. A function of
// the shape alone, so the sums (and their bits) do not depend on the GPU.
inline int64_t bias_grad_segments(int64_t c, int64_t terms) {
  if (c <= 0 || terms <= 0) return 1;
  int64_t k = terms / 2048;
  const int64_t by_blocks = (512 + c - 1) / c;
  if (k > by_blocks) k = by_blocks;
  if (k > 64) k = 64;
  return k < 1 ? 1 : k;
}
// The device doubles bias_grad needs for the segments' sums (0: one segment per channel).
inline int64_t bias_grad_partials(int64_t n, int64_t c, int64_t hw) {
  const int64_t k = bias_grad_segments(c, n * hw);
  return k > 1 ? c * k : 0;
}
// db[c] (+)= the channel's sum in double, in a fixed order: each segment's terms by the
// threads of a block (kernels/cuda/bias_rules.h) and CUB's block tree, then the segments in
// order. partials: bias_grad_partials(n, c, hw) doubles of device scratch (null when 0).
void bias_grad(CUstream_st* s, int64_t n, int64_t c, int64_t hw, const float* dy, float* db,
               bool accumulate, double* partials);
}  // namespace cuda

}  // namespace towers::kernels
