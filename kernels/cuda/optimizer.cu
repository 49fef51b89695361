#include "kernels/cuda/launch.cuh"
#include "kernels/optimizer.h"
#include "kernels/optimizer_rules.h"  // the per-element formulas shared with the CPU twins

namespace towers::kernels::cuda {

// One element per thread (grid-stride); the parameter, its slots and the gradient are
// distinct buffers.
__global__ void sgd_kernel(int64_t n, float* __restrict__ w, const float* __restrict__ g, float lr,
                           float wd) {
  TOWERS_GRID_STRIDE(i, n) { sgd_rule(w[i], g[i], lr, wd); }
}

__global__ void momentum_kernel(int64_t n, float* __restrict__ w, float* __restrict__ a,
                                const float* __restrict__ g, float lr, float mu, bool nesterov,
                                float wd) {
  TOWERS_GRID_STRIDE(i, n) { momentum_rule(w[i], a[i], g[i], lr, mu, nesterov, wd); }
}

__global__ void adagrad_kernel(int64_t n, float* __restrict__ w, float* __restrict__ acc,
                               const float* __restrict__ g, float lr, float wd) {
  TOWERS_GRID_STRIDE(i, n) { adagrad_rule(w[i], acc[i], g[i], lr, wd); }
}

__global__ void adam_kernel(int64_t n, float* __restrict__ w, float* __restrict__ m,
                            float* __restrict__ v, const float* __restrict__ g, float lr_t,
                            float b1, float b2, float eps, float wd) {
  TOWERS_GRID_STRIDE(i, n) { adam_rule(w[i], m[i], v[i], g[i], lr_t, b1, b2, eps, wd); }
}

__global__ void rmsprop_kernel(int64_t n, float* __restrict__ w, float* __restrict__ ms,
                               float* __restrict__ mom, const float* __restrict__ g, float lr,
                               float rho, float mu, float eps, float wd) {
  TOWERS_GRID_STRIDE(i, n) { rmsprop_rule(w[i], ms[i], mom[i], g[i], lr, rho, mu, eps, wd); }
}

void sgd_update(CUstream_st* s, int64_t n, float* w, const float* g, float lr, float wd) {
  if (n == 0) return;
  sgd_kernel<<<grid_for(n), kBlock, 0, s>>>(n, w, g, lr, wd);
  CUDA_CHECK_LAUNCH();
}

void momentum_update(CUstream_st* s, int64_t n, float* w, float* a, const float* g, float lr,
                     float mu, bool nesterov, float wd) {
  if (n == 0) return;
  momentum_kernel<<<grid_for(n), kBlock, 0, s>>>(n, w, a, g, lr, mu, nesterov, wd);
  CUDA_CHECK_LAUNCH();
}

void adagrad_update(CUstream_st* s, int64_t n, float* w, float* acc, const float* g, float lr,
                    float wd) {
  if (n == 0) return;
  adagrad_kernel<<<grid_for(n), kBlock, 0, s>>>(n, w, acc, g, lr, wd);
  CUDA_CHECK_LAUNCH();
}

void adam_update(CUstream_st* s, int64_t n, float* w, float* m, float* v, const float* g,
                 float lr_t, float b1, float b2, float eps, float wd) {
  if (n == 0) return;
  adam_kernel<<<grid_for(n), kBlock, 0, s>>>(n, w, m, v, g, lr_t, b1, b2, eps, wd);
  CUDA_CHECK_LAUNCH();
}

void rmsprop_update(CUstream_st* s, int64_t n, float* w, float* ms, float* mom, const float* g,
                    float lr, float rho, float mu, float eps, float wd) {
  if (n == 0) return;
  rmsprop_kernel<<<grid_for(n), kBlock, 0, s>>>(n, w, ms, mom, g, lr, rho, mu, eps, wd);
  CUDA_CHECK_LAUNCH();
}

}  // namespace towers::kernels::cuda
