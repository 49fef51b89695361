// bias_rules.h — the per-element rules of the bias kernels (kernels/cuda/bias.cu), shared with
// the CPU tests (tests/rules_conv_test.cpp). Plain C++17 with TOWERS_HD.
#pragma once

#include <cstdint>

#include "kernels/hd.h"

namespace towers::kernels::cuda {

// y[idx] + bias[channel] of a (n, c, hw) tensor, then ReLU when relu (max(v, 0), as the CPU
// layers write it).
TOWERS_HD float bias_add_at(int64_t c, int64_t hw, const float* bias, const float* y, bool relu,
                            int64_t idx) {
  const float v = y[idx] + bias[(idx / hw) % c];
  return relu && v < 0.0f ? 0.0f : v;
}

// One thread's share of db[ch] = sum_{b, i} dy[b, ch, i]: thread t of `threads` sums, in double,
// the terms k = t, t + threads, ... of the channel's n * hw terms in the CPU twin's order
// (k = b * hw + i). Consecutive threads read consecutive floats, and a dense layer (hw = 1)
// still spreads its batch over the threads.
TOWERS_HD double bias_grad_partial(int64_t n, int64_t c, int64_t hw, const float* dy, int64_t ch,
                                   int64_t t, int64_t threads) {
  double s = 0.0;
  for (int64_t k = t; k < n * hw; k += threads) {
    const int64_t b = k / hw, i = k - b * hw;
    s += dy[(b * c + ch) * hw + i];
  }
  return s;
}

// db[ch] from the channel's total: = or += as the CPU twin does.
TOWERS_HD float bias_grad_finish(double total, float old, bool accumulate) {
  return accumulate ? old + static_cast<float>(total) : static_cast<float>(total);
}

}  // namespace towers::kernels::cuda
