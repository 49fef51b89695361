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
// The CPU twin's sums (double, fixed order), one channel per block.
void bias_grad(CUstream_st* s, int64_t n, int64_t c, int64_t hw, const float* dy, float* db,
               bool accumulate);
}  // namespace cuda

}  // namespace towers::kernels
