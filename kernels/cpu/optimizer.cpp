#include "kernels/optimizer.h"

#include "kernels/optimizer_rules.h"  // the per-element formulas shared with the CUDA twins

namespace towers::kernels::cpu {

void sgd_update(int64_t n, float* w, const float* g, float lr, float wd) {
  for (int64_t i = 0; i < n; ++i) sgd_rule(w[i], g[i], lr, wd);
}

void momentum_update(int64_t n, float* w, float* a, const float* g, float lr, float mu,
                     bool nesterov, float wd) {
  for (int64_t i = 0; i < n; ++i) momentum_rule(w[i], a[i], g[i], lr, mu, nesterov, wd);
}

void adagrad_update(int64_t n, float* w, float* acc, const float* g, float lr, float wd) {
  for (int64_t i = 0; i < n; ++i) adagrad_rule(w[i], acc[i], g[i], lr, wd);
}

void adam_update(int64_t n, float* w, float* m, float* v, const float* g, float lr_t, float b1,
                 float b2, float eps, float wd) {
  for (int64_t i = 0; i < n; ++i) adam_rule(w[i], m[i], v[i], g[i], lr_t, b1, b2, eps, wd);
}

void rmsprop_update(int64_t n, float* w, float* ms, float* mom, const float* g, float lr, float rho,
                    float mu, float eps, float wd) {
  for (int64_t i = 0; i < n; ++i) rmsprop_rule(w[i], ms[i], mom[i], g[i], lr, rho, mu, eps, wd);
}

}  // namespace towers::kernels::cpu
