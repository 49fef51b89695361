#include "kernels/activation.h"

#include "kernels/activation_rules.h"

namespace towers::kernels::cpu {

void relu_forward(int64_t n, const float* x, float* y) {
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] > 0.0f ? x[i] : 0.0f;
}

void relu_backward(int64_t n, const float* y, const float* dy, float* dx) {
  for (int64_t i = 0; i < n; ++i) dx[i] = y[i] > 0.0f ? dy[i] : 0.0f;
}

void gelu_forward(int64_t n, const float* x, float* y) {
  for (int64_t i = 0; i < n; ++i) y[i] = gelu_at(x[i]);
}

void gelu_backward(int64_t n, const float* x, const float* dy, float* dx) {
  for (int64_t i = 0; i < n; ++i) dx[i] = gelu_backward_at(x[i], dy[i]);
}

}  // namespace towers::kernels::cpu
