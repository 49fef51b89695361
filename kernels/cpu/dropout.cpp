#include "kernels/dropout.h"

#include <cmath>

#include "core/check.h"
#include "kernels/dropout_rules.h"

namespace towers::kernels {

DropoutParams dropout_params(double rate, int64_t per_example, uint64_t salt) {
  TOWERS_CHECK(rate >= 0.0 && rate < 1.0, "dropout rate must be in [0, 1), got {}", rate);
  TOWERS_CHECK(per_example > 0 && per_example < (int64_t{1} << 32),
               "dropout needs 1 to 2^32 - 1 elements per example, got {}", per_example);
  DropoutParams p;
  p.per_example = per_example;
  p.salt = salt;
  p.threshold = static_cast<uint32_t>(std::llround(rate * 16777216.0));  // 2^24
  p.scale = static_cast<float>(1.0 / (1.0 - rate));
  return p;
}

namespace cpu {

namespace {
template <class F>
void each_element(const DropoutParams& p, const StepNoise& noise, int64_t e0, int64_t e1, F f) {
  const uint64_t key = dropout_key(noise.key, p.salt);
  const int64_t m = p.per_example;
  for (int64_t e = e0; e < e1; ++e) {
    const uint64_t example = static_cast<uint64_t>(noise.first_example + e);
    for (int64_t j = 0; j < m; ++j)
      f(e * m + j, dropout_keep(key, example, static_cast<uint64_t>(j), p.threshold));
  }
}
}  // namespace

void dropout_forward(const DropoutParams& p, const StepNoise& noise, int64_t e0, int64_t e1,
                     const float* x, float* y) {
  each_element(p, noise, e0, e1, [&](int64_t i, bool keep) { y[i] = keep ? x[i] * p.scale : 0.0f; });
}

void dropout_backward(const DropoutParams& p, const StepNoise& noise, int64_t e0, int64_t e1,
                      const float* dy, float* dx) {
  each_element(p, noise, e0, e1,
               [&](int64_t i, bool keep) { dx[i] = keep ? dy[i] * p.scale : 0.0f; });
}

}  // namespace cpu
}  // namespace towers::kernels
