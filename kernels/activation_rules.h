// activation_rules.h — GELU's per-element rules, run by the CPU loop (kernels/cpu/activation.cpp),
// the CUDA kernel (kernels/cuda/activation.cu) and the emulator alike. Plain C++17 with TOWERS_HD.
// GELU is its tanh form (Hendrycks & Gimpel; PyTorch's approximate='tanh', TF's
// approximate=True), evaluated in double and rounded once to float, so the twins differ only
// where the device's double tanh (or an fma nvcc contracts) moves a result across a float
// rounding boundary.
#pragma once

#include <cmath>

#include "kernels/hd.h"

namespace towers::kernels {

// gelu(x) = x / 2 * (1 + tanh(u)),  u = sqrt(2 / pi) * (x + 0.044715 x^3).
TOWERS_HD float gelu_at(float x) {
  const double k = 0.7978845608028654, c = 0.044715;  // sqrt(2 / pi), the cubic's weight
  const double v = x;
  const double t = tanh(k * (v + c * v * v * v));
  return static_cast<float>(0.5 * v * (1.0 + t));
}

// dx = dy * gelu'(x),  gelu'(x) = (1 + t) / 2 + x / 2 * (1 - t^2) * sqrt(2 / pi) * (1 + 3 *
// 0.044715 x^2),  t = tanh(u).
TOWERS_HD float gelu_backward_at(float x, float dy) {
  const double k = 0.7978845608028654, c = 0.044715;
  const double v = x;
  const double t = tanh(k * (v + c * v * v * v));
  const double d = 0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * k * (1.0 + 3.0 * c * v * v);
  return static_cast<float>(static_cast<double>(dy) * d);
}

}  // namespace towers::kernels
