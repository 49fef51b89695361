#include "kernels/batchnorm.h"

#include "kernels/batchnorm_rules.h"

namespace towers::kernels::cpu {

void batchnorm_forward_train(const BnShape& s, int64_t c0, int64_t c1, const float* x,
                             const float* gamma, const float* beta, float* y, double* mean,
                             double* var) {
  for (int64_t ch = c0; ch < c1; ++ch)
    bn_channel_forward_train(s, ch, x, gamma, beta, y, mean[ch], var[ch]);
}

void batchnorm_forward_eval(const BnShape& s, int64_t c0, int64_t c1, const float* x,
                            const float* gamma, const float* beta, const float* mean,
                            const float* var, float* y) {
  for (int64_t ch = c0; ch < c1; ++ch) bn_channel_forward_eval(s, ch, x, gamma, beta, mean, var, y);
}

void batchnorm_backward(const BnShape& s, int64_t c0, int64_t c1, const float* x, const float* dy,
                        const float* gamma, const double* mean, const double* var,
                        const float* running_mean, const float* running_var, const BnGrads& g) {
  for (int64_t ch = c0; ch < c1; ++ch)
    bn_channel_backward(s, ch, x, dy, gamma, mean[ch], var[ch], running_mean, running_var, g);
}

void batchnorm_channel_sums(const BnShape& s, int64_t c0, int64_t c1, const float* x,
                            const double* center, double* out) {
  double lanes[kBnLanes];
  for (int64_t ch = c0; ch < c1; ++ch) {
    bn_channel_lanes(s, ch, x, center != nullptr ? center[ch] : 0.0, center != nullptr, lanes);
    out[ch] = bn_lanes_total(lanes);
  }
}

void batchnorm_forward_with(const BnShape& s, int64_t c0, int64_t c1, const float* x,
                            const float* gamma, const float* beta, const double* mean,
                            const double* var, float* y) {
  for (int64_t ch = c0; ch < c1; ++ch)
    bn_channel_normalize(s, ch, x, mean[ch], bn_invstd(var[ch], s.eps), gamma, beta, y);
}

void batchnorm_backward_sums(const BnShape& s, int64_t c0, int64_t c1, const float* x,
                             const float* dy, const double* mean, const double* var,
                             double* sdy, double* sdyx) {
  for (int64_t ch = c0; ch < c1; ++ch)
    bn_channel_backward_sums(s, ch, x, dy, mean[ch], bn_invstd(var[ch], s.eps), sdy[ch], sdyx[ch]);
}

void batchnorm_backward_with(const BnShape& s, int64_t c0, int64_t c1, double m, const float* x,
                             const float* dy, const float* gamma, const double* mean,
                             const double* var, const double* sdy, const double* sdyx,
                             const double* own_sdy, const double* own_sdyx,
                             const float* running_mean, const float* running_var,
                             const BnGrads& g) {
  // The state deltas' unbiased variance counts the global batch's elements.
  BnShape global = s;
  global.n = static_cast<int64_t>(m) / s.hw;
  for (int64_t ch = c0; ch < c1; ++ch) {
    bn_channel_outputs(global, ch, mean[ch], var[ch], own_sdy[ch], own_sdyx[ch], running_mean,
                       running_var, g);
    if (g.dx != nullptr)
      bn_channel_dx(s, ch, x, dy, mean[ch], bn_invstd(var[ch], s.eps), m, gamma[ch], sdy[ch],
                    sdyx[ch], g.dx);
  }
}

}  // namespace towers::kernels::cpu
