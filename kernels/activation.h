// activation.h — ReLU and GELU, CPU and CUDA twins. The CUDA twin takes its stream first.
// GELU's per-element rules are in kernels/activation_rules.h (its tanh form).
#pragma once

#include <cstdint>

#include "kernels/hd.h"

namespace towers::kernels {

namespace cpu {
void relu_forward(int64_t n, const float* x, float* y);
// dx = dy where y > 0, else 0 (y may alias x's storage: only y is read).
void relu_backward(int64_t n, const float* y, const float* dy, float* dx);
void gelu_forward(int64_t n, const float* x, float* y);
// dx = dy * gelu'(x), from the forward input.
void gelu_backward(int64_t n, const float* x, const float* dy, float* dx);
}  // namespace cpu

namespace cuda {
void relu_forward(CUstream_st* stream, int64_t n, const float* x, float* y);
void relu_backward(CUstream_st* stream, int64_t n, const float* y, const float* dy, float* dx);
void gelu_forward(CUstream_st* stream, int64_t n, const float* x, float* y);
void gelu_backward(CUstream_st* stream, int64_t n, const float* x, const float* dy, float* dx);
}  // namespace cuda

}  // namespace towers::kernels
