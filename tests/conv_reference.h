// conv_reference.h — the element-wise steps around the convolution GEMM, written as
// src/layers/conv2d.cpp does them, for the rule tests and the GPU tests to compare with.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace towers::testing {

// y (n, co, P) from the GEMM's out (co, n * P): + bias[c], then ReLU when relu.
inline std::vector<float> conv_output_reference(int64_t n, int64_t co, int64_t P,
                                                const std::vector<float>& out,
                                                const std::vector<float>& bias, bool relu) {
  const int64_t cols = n * P;
  std::vector<float> y(n * co * P);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = 0; c < co; ++c) {
      const float* s = out.data() + c * cols + i * P;
      float* d = y.data() + i * co * P + c * P;
      for (int64_t q = 0; q < P; ++q) d[q] = relu ? std::max(s[q] + bias[c], 0.0f) : s[q] + bias[c];
    }
  return y;
}

// g (co, n * P) = dy (n, co, P) masked where y <= 0 when relu, and db[c] = the sum of row c of
// g in double, as one chunk of n images.
inline void conv_grad_output_reference(int64_t n, int64_t co, int64_t P,
                                       const std::vector<float>& y, const std::vector<float>& dy,
                                       bool relu, std::vector<float>& g, std::vector<float>& db) {
  const int64_t cols = n * P;
  g.assign(co * cols, 0.0f);
  db.assign(co, 0.0f);
  for (int64_t c = 0; c < co; ++c) {
    double bsum = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      const float* dyp = dy.data() + i * co * P + c * P;
      const float* yp = y.data() + i * co * P + c * P;
      float* d = g.data() + c * cols + i * P;
      for (int64_t q = 0; q < P; ++q) d[q] = !relu || yp[q] > 0.0f ? dyp[q] : 0.0f;
      for (int64_t q = 0; q < P; ++q) bsum += d[q];
    }
    db[c] = static_cast<float>(bsum);
  }
}

}  // namespace towers::testing
