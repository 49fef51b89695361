// lrn_rules.h — the per-element rules of the LRN kernels (kernels/cuda/lrn.cu), shared with the
// CPU tests (tests/rules_conv_test.cpp). Plain C++17 with TOWERS_HD. Each element sums its own
// channel window in the CPU twin's order with the CPU twin's float operations; they differ only
// in rounding (powf's, and fma contraction where the host compiler chooses it).
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/divisor.h"
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

// Channels per thread of the chunked kernels, and the largest radius they take (the CIFAR-10
// net's is 4); a larger radius takes the per-element kernels.
constexpr int kLrnChunk = 8;
constexpr int kLrnMaxRadius = 4;
TOWERS_HD bool lrn_chunked(const LrnParams& p) {
  return p.depth_radius >= 0 && p.depth_radius <= kLrnMaxRadius;
}

// An LRN call's sizes in the index type of the call, with the divisors its rules divide by
// (divisor.h: a multiply and a shift in 32 bits). Built once per launch.
template <class I>
struct LrnShape {
  I r, c, hw;
  Divisor<I> c_div, hw_div, chunks;  // chunks: of kLrnChunk channels, the last one short
  TOWERS_HD LrnShape(const LrnParams& p, int64_t c_, int64_t hw_)
      : r(static_cast<I>(p.depth_radius)), c(static_cast<I>(c_)), hw(static_cast<I>(hw_)),
        c_div(static_cast<I>(c_)), hw_div(static_cast<I>(hw_)),
        chunks(static_cast<I>((c_ + kLrnChunk - 1) / kLrnChunk)) {}
  // The chunked kernels' thread count.
  TOWERS_HD static int64_t chunk_threads(int64_t n, int64_t c_, int64_t hw_) {
    return n * ((c_ + kLrnChunk - 1) / kLrnChunk) * hw_;
  }
};

// Element idx of (n, c, hw): the channels c' = ch - r .. ch + r within [0, c) of its pixel.
template <class I = int64_t>
TOWERS_HD void lrn_window(const LrnShape<I>& s, I idx, I& first, I& lo, I& hi) {
  I q, pix, b, ch;
  s.hw_div.divmod(idx, q, pix);
  s.c_div.divmod(q, b, ch);
  lo = ch - s.r > 0 ? ch - s.r : 0;
  hi = ch + s.r < s.c - 1 ? ch + s.r : s.c - 1;
  first = b * s.c * s.hw + pix;  // element (b, 0, pix); channel k is at first + k * hw
}

// y and scale of element idx: scale = bias + alpha * sum x[c']^2, y = x * scale^-beta.
template <class I = int64_t>
TOWERS_HD void lrn_forward_at(const LrnParams& p, const LrnShape<I>& s, const float* x, I idx,
                              float& y, float& scale) {
  I first, lo, hi;
  lrn_window<I>(s, idx, first, lo, hi);
  float sum = 0.0f;
  for (I k = lo; k <= hi; ++k) {
    const float v = x[first + k * s.hw];
    sum += lrn_mul(v, v);
  }
  scale = p.bias + lrn_mul(p.alpha, sum);
  y = lrn_mul(x[idx], lrn_pow_neg(scale, p.beta));
}

// dx of element idx: dy * scale^-beta - 2 alpha beta x * sum_{window} dy * y / scale.
template <class I = int64_t>
TOWERS_HD float lrn_backward_at(const LrnParams& p, const LrnShape<I>& s, const float* x,
                                const float* y, const float* scale, const float* dy, I idx) {
  I first, lo, hi;
  lrn_window<I>(s, idx, first, lo, hi);
  float acc = 0.0f;
  for (I k = lo; k <= hi; ++k) {
    const I j = first + k * s.hw;
    acc += lrn_mul(dy[j], y[j]) / scale[j];
  }
  const float kk = lrn_mul(lrn_mul(-2.0f, p.alpha), p.beta);
  return lrn_mul(dy[idx], lrn_pow_neg(scale[idx], p.beta)) + lrn_mul(lrn_mul(kk, x[idx]), acc);
}

// ---- the chunked rules: one thread per (image, chunk of kLrnChunk channels, pixel) ----------
// A thread reads each input of its chunk and of the chunk's window margins once, into
// registers, and forms every element's window sum from them: the terms (and the divisions of
// the backward's terms) are computed once per channel instead of once per window they fall
// in. Each element's sum still adds its own window's terms from 0 in channel order, the order
// and the float operations of the rules above, so the results are theirs bit for bit (the
// CPU tests check it). Pixels are the fastest-moving index, so a warp reads consecutive floats.
// The loops over the register arrays have fixed bounds (unrolled by nvcc, the arrays kept in
// registers).

// Thread t's first element (image b, channel c0 of its chunk, its pixel) and c0.
template <class I>
TOWERS_HD void lrn_chunk(const LrnShape<I>& s, I t, I& first, I& c0) {
  I q, pix, b, chunk;
  s.hw_div.divmod(t, q, pix);
  s.chunks.divmod(q, b, chunk);
  c0 = chunk * static_cast<I>(kLrnChunk);
  first = b * s.c * s.hw + pix;
}

// Whether register slot j of the chunk at c0 (channel c0 - kLrnMaxRadius + j) is a channel of
// the tensor that some element of the chunk has in its window.
template <class I>
TOWERS_HD bool lrn_slot_used(const LrnShape<I>& s, I c0, int j) {
  const I ch = c0 - kLrnMaxRadius + j;
  return ch >= 0 && ch < s.c && ch >= c0 - s.r && ch <= c0 + (kLrnChunk - 1) + s.r;
}

// The register slots of a chunk: its channels and the window margins on either side.
constexpr int kLrnSlots = kLrnChunk + 2 * kLrnMaxRadius;

// Element i of the chunk (channel ch): the sum of the slots in its window, from 0 in channel
// order; channels outside the window or the tensor are skipped, never added as zeros.
template <class I>
TOWERS_HD float lrn_window_sum(const LrnShape<I>& s, const float (&slot)[kLrnSlots], I ch, int i) {
  float sum = 0.0f;
  TOWERS_UNROLL
  for (int d = -kLrnMaxRadius; d <= kLrnMaxRadius; ++d)
    if (d >= -s.r && d <= s.r && ch + d >= 0 && ch + d < s.c) sum += slot[kLrnMaxRadius + i + d];
  return sum;
}

// lrn_forward_at for the elements of thread t's chunk.
template <class I>
TOWERS_HD void lrn_forward_chunk(const LrnParams& p, const LrnShape<I>& s, const float* x,
                                 float* y, float* scale, I t) {
  I first, c0;
  lrn_chunk<I>(s, t, first, c0);
  float sq[kLrnSlots];  // slot j: channel c0 - kLrnMaxRadius + j, squared
  float xv[kLrnChunk];
  TOWERS_UNROLL
  for (int j = 0; j < kLrnSlots; ++j) {
    const float v = lrn_slot_used<I>(s, c0, j) ? x[first + (c0 - kLrnMaxRadius + j) * s.hw] : 0.0f;
    sq[j] = lrn_mul(v, v);
    if (j >= kLrnMaxRadius && j < kLrnMaxRadius + kLrnChunk) xv[j - kLrnMaxRadius] = v;
  }
  TOWERS_UNROLL
  for (int i = 0; i < kLrnChunk; ++i) {
    const I ch = c0 + i;
    if (ch >= s.c) break;
    const float sc = p.bias + lrn_mul(p.alpha, lrn_window_sum<I>(s, sq, ch, i));
    y[first + ch * s.hw] = lrn_mul(xv[i], lrn_pow_neg(sc, p.beta));
    scale[first + ch * s.hw] = sc;
  }
}

// lrn_backward_at for the elements of thread t's chunk.
template <class I>
TOWERS_HD void lrn_backward_chunk(const LrnParams& p, const LrnShape<I>& s, const float* x,
                                  const float* y, const float* scale, const float* dy, float* dx,
                                  I t) {
  I first, c0;
  lrn_chunk<I>(s, t, first, c0);
  float term[kLrnSlots];  // slot j: dy * y / scale of channel c0 - kLrnMaxRadius + j
  float dyv[kLrnChunk], sv[kLrnChunk];
  TOWERS_UNROLL
  for (int j = 0; j < kLrnSlots; ++j) {
    float d = 0.0f, yy = 0.0f, sc = 1.0f;
    if (lrn_slot_used<I>(s, c0, j)) {
      const I at = first + (c0 - kLrnMaxRadius + j) * s.hw;
      d = dy[at], yy = y[at], sc = scale[at];
    }
    term[j] = lrn_mul(d, yy) / sc;
    if (j >= kLrnMaxRadius && j < kLrnMaxRadius + kLrnChunk)
      dyv[j - kLrnMaxRadius] = d, sv[j - kLrnMaxRadius] = sc;
  }
  const float kk = lrn_mul(lrn_mul(-2.0f, p.alpha), p.beta);
  TOWERS_UNROLL
  for (int i = 0; i < kLrnChunk; ++i) {
    const I ch = c0 + i;
    if (ch >= s.c) break;
    const I at = first + ch * s.hw;
    dx[at] = lrn_mul(dyv[i], lrn_pow_neg(sv[i], p.beta)) +
             lrn_mul(lrn_mul(kk, x[at]), lrn_window_sum<I>(s, term, ch, i));
  }
}

}  // namespace towers::kernels::cuda
