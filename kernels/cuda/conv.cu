// conv.cu — the convolution's data movers on the GPU: batched im2col/col2im and the two
// element-wise kernels around the GEMM. The per-element rules are in kernels/cuda/conv_rules.h.
#include "kernels/bias.h"
#include "kernels/conv.h"
#include "kernels/cuda/conv_rules.h"
#include "kernels/cuda/launch.cuh"

namespace towers::kernels::cuda {

__global__ void im2col_kernel(ConvGeometry g, int64_t n, int64_t count, const float* __restrict__ x,
                              float* __restrict__ col) {
  TOWERS_GRID_STRIDE(i, count) { col[i] = im2col_at(g, n, x, i); }
}

__global__ void col2im_kernel(ConvGeometry g, int64_t n, int64_t count,
                              const float* __restrict__ col, float* __restrict__ dx) {
  TOWERS_GRID_STRIDE(i, count) { dx[i] = col2im_at(g, n, col, i); }
}

__global__ void conv_output_kernel(int64_t n, int64_t co, int64_t p, const float* __restrict__ out,
                                   const float* __restrict__ bias, bool relu,
                                   float* __restrict__ y) {
  TOWERS_GRID_STRIDE(i, n * co * p) { y[i] = conv_output_at(n, co, p, out, bias, relu, i); }
}

__global__ void conv_grad_output_kernel(int64_t n, int64_t co, int64_t p,
                                        const float* __restrict__ y, const float* __restrict__ dy,
                                        bool relu, float* __restrict__ g) {
  TOWERS_GRID_STRIDE(i, n * co * p) { g[i] = conv_grad_output_at(n, co, p, y, dy, relu, i); }
}

void im2col(CUstream_st* s, const ConvGeometry& g, int64_t n, const float* x, float* col) {
  const int64_t count = g.patch() * n * g.out_pixels();  // col (patch, n * P)
  if (count == 0) return;
  im2col_kernel<<<grid_for(count), kBlock, 0, s>>>(g, n, count, x, col);
  CUDA_CHECK_LAUNCH();
}

void col2im(CUstream_st* s, const ConvGeometry& g, int64_t n, const float* col, float* dx) {
  const int64_t count = n * g.channels * g.height * g.width;  // dx (n, C, H, W)
  if (count == 0) return;
  col2im_kernel<<<grid_for(count), kBlock, 0, s>>>(g, n, count, col, dx);
  CUDA_CHECK_LAUNCH();
}

void conv_output(CUstream_st* s, int64_t n, int64_t co, int64_t p, const float* out,
                 const float* bias, bool relu, float* y) {
  const int64_t count = n * co * p;
  if (count == 0) return;
  conv_output_kernel<<<grid_for(count), kBlock, 0, s>>>(n, co, p, out, bias, relu, y);
  CUDA_CHECK_LAUNCH();
}

void conv_grad_output(CUstream_st* s, int64_t n, int64_t co, int64_t p, const float* y,
                      const float* dy, bool relu, float* g, float* db) {
  const int64_t count = n * co * p;
  if (count > 0) {
    conv_grad_output_kernel<<<grid_for(count), kBlock, 0, s>>>(n, co, p, y, dy, relu, g);
    CUDA_CHECK_LAUNCH();
  }
  // db[c] = the sum of row c of g (co, n * P): g read as a (1, co, n * P) tensor.
  bias_grad(s, 1, co, n * p, g, db, false);
}

}  // namespace towers::kernels::cuda
