// activation.cu — ReLU and GELU on the GPU, one thread per element. GELU's rules are in
// kernels/activation_rules.h.
#include "kernels/activation.h"
#include "kernels/activation_rules.h"
#include "kernels/cuda/launch.cuh"

namespace towers::kernels::cuda {

__global__ void relu_forward_kernel(int64_t n, const float* __restrict__ x, float* __restrict__ y) {
  TOWERS_GRID_STRIDE(i, n) { y[i] = x[i] > 0.0f ? x[i] : 0.0f; }
}

__global__ void relu_backward_kernel(int64_t n, const float* __restrict__ y,
                                     const float* __restrict__ dy, float* __restrict__ dx) {
  TOWERS_GRID_STRIDE(i, n) { dx[i] = y[i] > 0.0f ? dy[i] : 0.0f; }
}

__global__ void gelu_forward_kernel(int64_t n, const float* __restrict__ x, float* __restrict__ y) {
  TOWERS_GRID_STRIDE(i, n) { y[i] = gelu_at(x[i]); }
}

__global__ void gelu_backward_kernel(int64_t n, const float* __restrict__ x,
                                     const float* __restrict__ dy, float* __restrict__ dx) {
  TOWERS_GRID_STRIDE(i, n) { dx[i] = gelu_backward_at(x[i], dy[i]); }
}

void relu_forward(CUstream_st* stream, int64_t n, const float* x, float* y) {
  if (n == 0) return;
  relu_forward_kernel<<<grid_for(n), kBlock, 0, stream>>>(n, x, y);
  CUDA_CHECK_LAUNCH();
}

void relu_backward(CUstream_st* stream, int64_t n, const float* y, const float* dy, float* dx) {
  if (n == 0) return;
  relu_backward_kernel<<<grid_for(n), kBlock, 0, stream>>>(n, y, dy, dx);
  CUDA_CHECK_LAUNCH();
}

void gelu_forward(CUstream_st* stream, int64_t n, const float* x, float* y) {
  if (n == 0) return;
  gelu_forward_kernel<<<grid_for(n), kBlock, 0, stream>>>(n, x, y);
  CUDA_CHECK_LAUNCH();
}

void gelu_backward(CUstream_st* stream, int64_t n, const float* x, const float* dy, float* dx) {
  if (n == 0) return;
  gelu_backward_kernel<<<grid_for(n), kBlock, 0, stream>>>(n, x, dy, dx);
  CUDA_CHECK_LAUNCH();
}

}  // namespace towers::kernels::cuda
