#include "kernels/optimizer.h"

#include <cmath>

namespace towers::kernels::cpu {

void sgd_update(int64_t n, float* w, const float* g, float lr, float wd) {
  for (int64_t i = 0; i < n; ++i) w[i] -= lr * (g[i] + wd * w[i]);
}

void momentum_update(int64_t n, float* w, float* a, const float* g, float lr, float mu,
                     bool nesterov, float wd) {
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i] + wd * w[i];
    a[i] = mu * a[i] + gi;
    w[i] -= nesterov ? lr * (gi + mu * a[i]) : lr * a[i];
  }
}

void adagrad_update(int64_t n, float* w, float* acc, const float* g, float lr, float wd) {
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i] + wd * w[i];
    acc[i] += gi * gi;
    w[i] -= lr * gi / std::sqrt(acc[i]);
  }
}

void adam_update(int64_t n, float* w, float* m, float* v, const float* g, float lr_t, float b1,
                 float b2, float eps, float wd) {
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i] + wd * w[i];
    m[i] = b1 * m[i] + (1.0f - b1) * gi;
    v[i] = b2 * v[i] + (1.0f - b2) * gi * gi;
    w[i] -= lr_t * m[i] / (std::sqrt(v[i]) + eps);
  }
}

void rmsprop_update(int64_t n, float* w, float* ms, float* mom, const float* g, float lr,
                    float rho, float mu, float eps, float wd) {
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i] + wd * w[i];
    ms[i] = rho * ms[i] + (1.0f - rho) * gi * gi;
    mom[i] = mu * mom[i] + lr * gi / std::sqrt(ms[i] + eps);
    w[i] -= mom[i];
  }
}

}  // namespace towers::kernels::cpu
