// pool.cu — max-pooling on the GPU. Forward: one thread per output element; backward: one
// thread per input element, gathering (no atomics). Rules in kernels/cuda/pool_rules.h.
// Global average pooling: one thread per plane forward, one per input element backward; rules
// in kernels/global_pool_rules.h.
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/pool_rules.h"
#include "kernels/global_pool_rules.h"
#include "kernels/pool.h"

namespace towers::kernels::cuda {

__global__ void maxpool_forward_kernel(int64_t count, int64_t h, int64_t w, Window rows,
                                       Window cols, const float* __restrict__ x,
                                       float* __restrict__ y, float* __restrict__ argmax) {
  TOWERS_GRID_STRIDE(i, count) {
    float m;
    int64_t at;
    maxpool_at(rows, cols, h, w, x, i, m, at);
    y[i] = m;
    if (argmax != nullptr) argmax[i] = static_cast<float>(at);
  }
}

__global__ void maxpool_backward_kernel(int64_t count, int64_t h, int64_t w, Window rows,
                                        Window cols, const float* __restrict__ argmax,
                                        const float* __restrict__ dy, float* __restrict__ dx) {
  TOWERS_GRID_STRIDE(i, count) { dx[i] = maxpool_backward_at(rows, cols, h, w, argmax, dy, i); }
}

void maxpool_forward(CUstream_st* s, int64_t planes, int64_t h, int64_t w, const Window& rows,
                     const Window& cols, const float* x, float* y, float* argmax) {
  const int64_t count = planes * rows.out * cols.out;
  if (count == 0) return;
  maxpool_forward_kernel<<<grid_for(count), kBlock, 0, s>>>(count, h, w, rows, cols, x, y, argmax);
  CUDA_CHECK_LAUNCH();
}

void maxpool_backward(CUstream_st* s, int64_t planes, int64_t h, int64_t w, const Window& rows,
                      const Window& cols, const float* argmax, const float* dy, float* dx) {
  const int64_t count = planes * h * w;
  if (count == 0) return;
  maxpool_backward_kernel<<<grid_for(count), kBlock, 0, s>>>(count, h, w, rows, cols, argmax, dy,
                                                             dx);
  CUDA_CHECK_LAUNCH();
}

__global__ void global_avg_pool_forward_kernel(int64_t planes, int64_t hw,
                                               const float* __restrict__ x, float* __restrict__ y) {
  TOWERS_GRID_STRIDE(p, planes) { y[p] = global_avg_pool_at(hw, x, p); }
}

__global__ void global_avg_pool_backward_kernel(int64_t count, int64_t hw,
                                                const float* __restrict__ dy,
                                                float* __restrict__ dx) {
  TOWERS_GRID_STRIDE(i, count) { dx[i] = global_avg_pool_backward_at(hw, dy, i); }
}

void global_avg_pool_forward(CUstream_st* s, int64_t planes, int64_t hw, const float* x, float* y) {
  if (planes == 0) return;
  global_avg_pool_forward_kernel<<<grid_for(planes), kBlock, 0, s>>>(planes, hw, x, y);
  CUDA_CHECK_LAUNCH();
}

void global_avg_pool_backward(CUstream_st* s, int64_t planes, int64_t hw, const float* dy,
                              float* dx) {
  const int64_t count = planes * hw;
  if (count == 0) return;
  global_avg_pool_backward_kernel<<<grid_for(count), kBlock, 0, s>>>(count, hw, dy, dx);
  CUDA_CHECK_LAUNCH();
}

}  // namespace towers::kernels::cuda
