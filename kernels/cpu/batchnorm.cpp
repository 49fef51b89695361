#include "kernels/batchnorm.h"

#include "kernels/batchnorm_rules.h"

namespace towers::kernels::cpu {

void batchnorm_forward_train(const BnShape& s, int64_t c0, int64_t c1, const float* x,
                             const float* gamma, const float* beta, float* y) {
  for (int64_t ch = c0; ch < c1; ++ch) bn_channel_forward_train(s, ch, x, gamma, beta, y);
}

void batchnorm_forward_eval(const BnShape& s, int64_t c0, int64_t c1, const float* x,
                            const float* gamma, const float* beta, const float* mean,
                            const float* var, float* y) {
  for (int64_t ch = c0; ch < c1; ++ch) bn_channel_forward_eval(s, ch, x, gamma, beta, mean, var, y);
}

void batchnorm_backward(const BnShape& s, int64_t c0, int64_t c1, const float* x, const float* dy,
                        const float* gamma, const float* running_mean, const float* running_var,
                        const BnGrads& g) {
  for (int64_t ch = c0; ch < c1; ++ch)
    bn_channel_backward(s, ch, x, dy, gamma, running_mean, running_var, g);
}

}  // namespace towers::kernels::cpu
