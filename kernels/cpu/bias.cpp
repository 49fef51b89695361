#include "kernels/bias.h"

namespace towers::kernels::cpu {

void bias_add(int64_t n, int64_t c, int64_t hw, const float* bias, float* y) {
  for (int64_t b = 0; b < n; ++b)
    for (int64_t ch = 0; ch < c; ++ch) {
      float* p = y + (b * c + ch) * hw;
      const float v = bias[ch];
      for (int64_t i = 0; i < hw; ++i) p[i] += v;
    }
}

void bias_grad(int64_t n, int64_t c, int64_t hw, const float* dy, float* db, bool accumulate) {
  for (int64_t ch = 0; ch < c; ++ch) {
    double s = 0.0;  // double: a batch of 128 x 576 terms loses bits in float
    for (int64_t b = 0; b < n; ++b) {
      const float* p = dy + (b * c + ch) * hw;
      for (int64_t i = 0; i < hw; ++i) s += p[i];
    }
    db[ch] = accumulate ? db[ch] + static_cast<float>(s) : static_cast<float>(s);
  }
}

}  // namespace towers::kernels::cpu
