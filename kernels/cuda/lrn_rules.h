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

// The index type I is a parameter, as in conv_rules.h: the kernels take 32-bit arithmetic
// whenever the tensor's indices fit (fits_int32_indices), and the tests run both.

// Element idx of (n, c, hw): the channels c' = ch - r .. ch + r within [0, c) of its pixel.
template <class I = int64_t>
TOWERS_HD void lrn_window(I r, I c, I hw, I idx, I& first, I& lo, I& hi) {
  const I pix = idx % hw, ch = (idx / hw) % c, b = idx / (c * hw);
  lo = ch - r > 0 ? ch - r : 0;
  hi = ch + r < c - 1 ? ch + r : c - 1;
  first = b * c * hw + pix;  // element (b, 0, pix); channel k is at first + k * hw
}

// y and scale of element idx: scale = bias + alpha * sum x[c']^2, y = x * scale^-beta.
template <class I = int64_t>
TOWERS_HD void lrn_forward_at(const LrnParams& p, I c, I hw, const float* x, I idx, float& y,
                              float& scale) {
  I first, lo, hi;
  lrn_window<I>(static_cast<I>(p.depth_radius), c, hw, idx, first, lo, hi);
  float sum = 0.0f;
  for (I k = lo; k <= hi; ++k) {
    const float v = x[first + k * hw];
    sum += lrn_mul(v, v);
  }
  scale = p.bias + lrn_mul(p.alpha, sum);
  y = lrn_mul(x[idx], lrn_pow_neg(scale, p.beta));
}

// dx of element idx: dy * scale^-beta - 2 alpha beta x * sum_{window} dy * y / scale.
template <class I = int64_t>
TOWERS_HD float lrn_backward_at(const LrnParams& p, I c, I hw, const float* x, const float* y,
                                const float* scale, const float* dy, I idx) {
  I first, lo, hi;
  lrn_window<I>(static_cast<I>(p.depth_radius), c, hw, idx, first, lo, hi);
  float acc = 0.0f;
  for (I k = lo; k <= hi; ++k) {
    const I j = first + k * hw;
    acc += lrn_mul(dy[j], y[j]) / scale[j];
  }
  const float kk = lrn_mul(lrn_mul(-2.0f, p.alpha), p.beta);
  return lrn_mul(dy[idx], lrn_pow_neg(scale[idx], p.beta)) + lrn_mul(lrn_mul(kk, x[idx]), acc);
}

}  // namespace towers::kernels::cuda
