// lrn_rules.h — the per-element rules of the LRN kernels (kernels/cuda/lrn.cu), shared with the
// CPU tests (tests/rules_conv_test.cpp). Plain C++17 with TOWERS_HD. Each element sums its own
// channel window in the CPU twin's order with the CPU twin's float operations; they differ only
// in rounding (powf's, and fma contraction where the host compiler chooses it).
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/hd.h"
#include "kernels/lrn.h"

namespace towers::kernels::cuda {

// a * b rounded on its own: nvcc would otherwise fuse a product and the sum that follows into
// one fma, and the GPU would no longer compute what these rules compute on the host (without
// FMA instructions) in the CPU tests.
TOWERS_HD float lrn_mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

// s^-beta, as kernels/cpu/lrn.cpp computes it: beta = 0.75 (the CIFAR-10 net) and 0.5 avoid
// powf.
TOWERS_HD float lrn_pow_neg(float s, float beta) {
  if (beta == 0.75f) {
    const float r = sqrtf(s);
    return 1.0f / lrn_mul(r, sqrtf(r));
  }
  if (beta == 0.5f) return 1.0f / sqrtf(s);
  return powf(s, -beta);
}

// Element idx of (n, c, hw): the channels c' = ch - r .. ch + r within [0, c) of its pixel.
TOWERS_HD void lrn_window(int64_t r, int64_t c, int64_t hw, int64_t idx, int64_t& first,
                          int64_t& lo, int64_t& hi) {
  const int64_t pix = idx % hw, ch = (idx / hw) % c, b = idx / (c * hw);
  lo = ch - r > 0 ? ch - r : 0;
  hi = ch + r < c - 1 ? ch + r : c - 1;
  first = b * c * hw + pix;  // element (b, 0, pix); channel k is at first + k * hw
}

// y and scale of element idx: scale = bias + alpha * sum x[c']^2, y = x * scale^-beta.
TOWERS_HD void lrn_forward_at(const LrnParams& p, int64_t c, int64_t hw, const float* x,
                              int64_t idx, float& y, float& scale) {
  int64_t first, lo, hi;
  lrn_window(p.depth_radius, c, hw, idx, first, lo, hi);
  float sum = 0.0f;
  for (int64_t k = lo; k <= hi; ++k) {
    const float v = x[first + k * hw];
    sum += lrn_mul(v, v);
  }
  scale = p.bias + lrn_mul(p.alpha, sum);
  y = lrn_mul(x[idx], lrn_pow_neg(scale, p.beta));
}

// dx of element idx: dy * scale^-beta - 2 alpha beta x * sum_{window} dy * y / scale.
TOWERS_HD float lrn_backward_at(const LrnParams& p, int64_t c, int64_t hw, const float* x,
                                const float* y, const float* scale, const float* dy, int64_t idx) {
  int64_t first, lo, hi;
  lrn_window(p.depth_radius, c, hw, idx, first, lo, hi);
  float acc = 0.0f;
  for (int64_t k = lo; k <= hi; ++k) {
    const int64_t j = first + k * hw;
    acc += lrn_mul(dy[j], y[j]) / scale[j];
  }
  const float kk = lrn_mul(lrn_mul(-2.0f, p.alpha), p.beta);
  return lrn_mul(dy[idx], lrn_pow_neg(scale[idx], p.beta)) + lrn_mul(lrn_mul(kk, x[idx]), acc);
}

}  // namespace towers::kernels::cuda
