// lrn.h — local response normalisation across channels, tf.nn.lrn semantics:
//   scale[c] = bias + alpha * sum_{c' = c-r .. c+r} x[c']^2,   y[c] = x[c] * scale[c]^-beta
// (alpha is NOT divided by the window size, unlike PyTorch's LocalResponseNorm).
#pragma once

#include <cstdint>

#include "kernels/hd.h"

namespace towers::kernels {

struct LrnParams {
  int64_t depth_radius = 5;
  float bias = 1.0f, alpha = 1.0f, beta = 0.5f;
};

namespace cpu {
// x, y, scale: (n, C, HW). scale is saved for backward.
void lrn_forward(const LrnParams& p, int64_t n, int64_t c, int64_t hw, const float* x, float* y,
                 float* scale);
// dx = dy * scale^-beta - 2 alpha beta x * sum_{window} dy * y / scale. dx is overwritten.
void lrn_backward(const LrnParams& p, int64_t n, int64_t c, int64_t hw, const float* x,
                  const float* y, const float* scale, const float* dy, float* dx);
}  // namespace cpu

namespace cuda {
void lrn_forward(CUstream_st* s, const LrnParams& p, int64_t n, int64_t c, int64_t hw,
                 const float* x, float* y, float* scale);
void lrn_backward(CUstream_st* s, const LrnParams& p, int64_t n, int64_t c, int64_t hw,
                  const float* x, const float* y, const float* scale, const float* dy, float* dx);
}  // namespace cuda

}  // namespace towers::kernels
