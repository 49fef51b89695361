#include "kernels/lrn.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace towers::kernels::cpu {

// Calls f with s -> s^-beta as a functor of its own type: beta = 0.75 (the CIFAR-10 net) and
// 0.5 avoid powf, and a loop over elements with the choice made outside it vectorizes (the
// vector square roots and divisions round as the scalar ones).
template <class F>
static void with_pow_neg(float beta, F&& f) {
  if (beta == 0.75f) {
    f([](float s) {
      float r = std::sqrt(s);
      return 1.0f / (r * std::sqrt(r));
    });
  } else if (beta == 0.5f) {
    f([](float s) { return 1.0f / std::sqrt(s); });
  } else {
    f([beta](float s) { return std::pow(s, -beta); });
  }
}

// out[c] = sum_{c' in window(c)} in[c'] over planes of hw floats.
static void window_sum(int64_t c, int64_t hw, int64_t r, const float* in, float* out) {
  for (int64_t ch = 0; ch < c; ++ch) {
    float* o = out + ch * hw;
    std::fill(o, o + hw, 0.0f);
    int64_t lo = std::max<int64_t>(0, ch - r), hi = std::min<int64_t>(c - 1, ch + r);
    for (int64_t k = lo; k <= hi; ++k) {
      const float* s = in + k * hw;
      for (int64_t i = 0; i < hw; ++i) o[i] += s[i];
    }
  }
}

void lrn_forward(const LrnParams& p, int64_t n, int64_t c, int64_t hw, const float* x, float* y,
                 float* scale) {
  std::vector<float> sq(c * hw);
  for (int64_t b = 0; b < n; ++b) {
    const float* xb = x + b * c * hw;
    float* yb = y + b * c * hw;
    float* sb = scale + b * c * hw;
    for (int64_t i = 0; i < c * hw; ++i) sq[i] = xb[i] * xb[i];
    window_sum(c, hw, p.depth_radius, sq.data(), sb);
    with_pow_neg(p.beta, [&](auto pow_neg) {
      for (int64_t i = 0; i < c * hw; ++i) {
        sb[i] = p.bias + p.alpha * sb[i];
        yb[i] = xb[i] * pow_neg(sb[i]);
      }
    });
  }
}

void lrn_backward(const LrnParams& p, int64_t n, int64_t c, int64_t hw, const float* x,
                  const float* y, const float* scale, const float* dy, float* dx) {
  std::vector<float> t(c * hw), acc(c * hw);
  const float k = -2.0f * p.alpha * p.beta;
  for (int64_t b = 0; b < n; ++b) {
    const int64_t off = b * c * hw;
    for (int64_t i = 0; i < c * hw; ++i) t[i] = dy[off + i] * y[off + i] / scale[off + i];
    window_sum(c, hw, p.depth_radius, t.data(), acc.data());
    with_pow_neg(p.beta, [&](auto pow_neg) {
      for (int64_t i = 0; i < c * hw; ++i)
        dx[off + i] = dy[off + i] * pow_neg(scale[off + i]) + k * x[off + i] * acc[i];
    });
  }
}

}  // namespace towers::kernels::cpu
