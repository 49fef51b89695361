// lrn.cu — local response normalisation on the GPU, one thread per element, each summing its
// own channel window. Rules in kernels/cuda/lrn_rules.h.
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/lrn_rules.h"
#include "kernels/lrn.h"

namespace towers::kernels::cuda {

__global__ void lrn_forward_kernel(LrnParams p, int64_t c, int64_t hw, int64_t count,
                                   const float* __restrict__ x, float* __restrict__ y,
                                   float* __restrict__ scale) {
  TOWERS_GRID_STRIDE(i, count) {
    float yv, sv;
    lrn_forward_at(p, c, hw, x, i, yv, sv);
    y[i] = yv;
    scale[i] = sv;
  }
}

__global__ void lrn_backward_kernel(LrnParams p, int64_t c, int64_t hw, int64_t count,
                                    const float* __restrict__ x, const float* __restrict__ y,
                                    const float* __restrict__ scale, const float* __restrict__ dy,
                                    float* __restrict__ dx) {
  TOWERS_GRID_STRIDE(i, count) { dx[i] = lrn_backward_at(p, c, hw, x, y, scale, dy, i); }
}

void lrn_forward(CUstream_st* s, const LrnParams& p, int64_t n, int64_t c, int64_t hw,
                 const float* x, float* y, float* scale) {
  const int64_t count = n * c * hw;
  if (count == 0) return;
  lrn_forward_kernel<<<grid_for(count), kBlock, 0, s>>>(p, c, hw, count, x, y, scale);
  CUDA_CHECK_LAUNCH();
}

void lrn_backward(CUstream_st* s, const LrnParams& p, int64_t n, int64_t c, int64_t hw,
                  const float* x, const float* y, const float* scale, const float* dy, float* dx) {
  const int64_t count = n * c * hw;
  if (count == 0) return;
  lrn_backward_kernel<<<grid_for(count), kBlock, 0, s>>>(p, c, hw, count, x, y, scale, dy, dx);
  CUDA_CHECK_LAUNCH();
}

}  // namespace towers::kernels::cuda
