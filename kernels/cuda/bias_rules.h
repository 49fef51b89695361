// bias_rules.h — the per-element rules of the bias kernels (kernels/cuda/bias.cu), shared with
// the CPU tests (tests/rules_conv_test.cpp). Plain C++17 with TOWERS_HD.
#pragma once

#include <cstdint>

#include "kernels/bias.h"
#include "kernels/divisor.h"
#include "kernels/hd.h"

namespace towers::kernels::cuda {

// The index type I is a parameter, as in conv_rules.h: the kernels take 32-bit arithmetic
// whenever the tensor's indices fit (fits_int32_indices), and the tests run both.

// y[idx] + bias[channel] of a (n, c, hw) tensor, then ReLU when relu (max(v, 0), as the CPU
// layers write it). The channel is (idx / hw) mod c, divided by multiply and shift in 32 bits
// (divisor.h).
template <class I = int64_t>
TOWERS_HD float bias_add_at(const Divisor<I>& c, const Divisor<I>& hw, const float* bias,
                            const float* y, bool relu, I idx) {
  const float v = y[idx] + bias[channel_of(c, hw, idx)];
  return relu && v < 0.0f ? 0.0f : v;
}

// One thread's share of a segment's sum for db[ch] = sum_{b, i} dy[b, ch, i]: thread t of
// `threads` sums, in double, the terms k = lo + t, lo + t + threads, ... below hi of the
// channel's n * hw terms in the CPU twin's order (k = b * hw + i). Consecutive threads read
// consecutive floats, and a dense layer (hw = 1) still spreads its batch over the threads.
template <class I = int64_t>
TOWERS_HD double bias_grad_segment_partial(I c, I hw, const float* dy, I ch, I lo, I hi, I t,
                                           I threads) {
  double s = 0.0;
  for (I k = lo + t; k < hi; k += threads) {
    const I b = k / hw, i = k - b * hw;
    s += dy[(b * c + ch) * hw + i];
  }
  return s;
}

// Segment j of k of a channel's `terms` terms: [lo, hi).
template <class I = int64_t>
TOWERS_HD void bias_grad_segment(I terms, I k, I j, I& lo, I& hi) {
  const I seg = (terms + k - 1) / k;
  lo = j * seg < terms ? j * seg : terms;
  hi = lo + seg < terms ? lo + seg : terms;
}

// The whole channel as one segment.
template <class I = int64_t>
TOWERS_HD double bias_grad_partial(I n, I c, I hw, const float* dy, I ch, I t, I threads) {
  return bias_grad_segment_partial<I>(c, hw, dy, ch, I{0}, n * hw, t, threads);
}

// db[ch] from the channel's total: = or += as the CPU twin does.
TOWERS_HD float bias_grad_finish(double total, float old, bool accumulate) {
  return accumulate ? old + static_cast<float>(total) : static_cast<float>(total);
}

}  // namespace towers::kernels::cuda
