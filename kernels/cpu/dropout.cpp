#include "kernels/dropout.h"

#include <cmath>

#include "kernels/dropout_rules.h"

namespace towers::kernels {

// The layer (src/layers/dropout.cpp) checks the rate and the size, naming itself.
DropoutParams dropout_params(double rate, int64_t per_example, uint64_t salt) {
  DropoutParams p;
  p.per_example = per_example;
  p.salt = salt;
  p.threshold = static_cast<uint32_t>(std::llround(rate * 16777216.0));  // 2^24
  p.scale = static_cast<float>(1.0 / (1.0 - rate));
  return p;
}

namespace cpu {

namespace {
// Forward (x -> y) and backward (dy -> dx) are the same map: src scaled where the mask keeps.
void apply(const DropoutParams& p, const StepNoise& noise, int64_t e0, int64_t e1,
           const float* src, float* dst) {
  const uint64_t key = dropout_key(noise.key, p.salt);
  const int64_t m = p.per_example;
  for (int64_t e = e0; e < e1; ++e) {
    const uint64_t example = static_cast<uint64_t>(noise.first_example + e);
    for (int64_t j = 0; j < m; ++j)
      dst[e * m + j] = dropout_at(p, key, example, static_cast<uint64_t>(j), src[e * m + j]);
  }
}
}  // namespace

void dropout_forward(const DropoutParams& p, const StepNoise& noise, int64_t e0, int64_t e1,
                     const float* x, float* y) {
  apply(p, noise, e0, e1, x, y);
}

void dropout_backward(const DropoutParams& p, const StepNoise& noise, int64_t e0, int64_t e1,
                      const float* dy, float* dx) {
  apply(p, noise, e0, e1, dy, dx);
}

}  // namespace cpu
}  // namespace towers::kernels
