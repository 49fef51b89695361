// conv.cu — the convolution's data movers on the GPU: batched im2col/col2im and the two
// element-wise kernels around the GEMM. The per-element rules are in kernels/cuda/conv_rules.h.
#include <algorithm>

#include "kernels/bias.h"
#include "kernels/conv.h"
#include "kernels/cuda/conv_rules.h"
#include "kernels/cuda/launch.cuh"

namespace towers::kernels::cuda {

template <class I>
__global__ void im2col_kernel(ConvGeometry g, I n, I count, const float* __restrict__ x,
                              float* __restrict__ col) {
  TOWERS_GRID_STRIDE(i, count) { col[i] = im2col_at<I>(g, n, x, static_cast<I>(i)); }
}

template <class I>
__global__ void col2im_kernel(ConvGeometry g, I n, I count, const float* __restrict__ col,
                              float* __restrict__ dx) {
  TOWERS_GRID_STRIDE(i, count) { dx[i] = col2im_at<I>(g, n, col, static_cast<I>(i)); }
}

template <class I>
__global__ void conv_output_kernel(I n, I co, I p, const float* __restrict__ out,
                                   const float* __restrict__ bias, bool relu,
                                   float* __restrict__ y) {
  TOWERS_GRID_STRIDE(i, n * co * p) {
    y[i] = conv_output_at<I>(n, co, p, out, bias, relu, static_cast<I>(i));
  }
}

template <class I>
__global__ void conv_grad_output_kernel(I n, I co, I p, const float* __restrict__ y,
                                        const float* __restrict__ dy, bool relu,
                                        float* __restrict__ g) {
  TOWERS_GRID_STRIDE(i, n * co * p) {
    g[i] = conv_grad_output_at<I>(n, co, p, y, dy, relu, static_cast<I>(i));
  }
}

void im2col(CUstream_st* s, const ConvGeometry& g, int64_t n, const float* x, float* col) {
  const int64_t count = g.patch() * n * g.out_pixels();  // col (patch, n * P)
  if (count == 0) return;
  if (fits_int32_indices(std::max(count, n * g.channels * g.height * g.width)))
    im2col_kernel<int32_t><<<grid_for(count), kBlock, 0, s>>>(
        g, static_cast<int32_t>(n), static_cast<int32_t>(count), x, col);
  else
    im2col_kernel<int64_t><<<grid_for(count), kBlock, 0, s>>>(g, n, count, x, col);
  CUDA_CHECK_LAUNCH();
}

void col2im(CUstream_st* s, const ConvGeometry& g, int64_t n, const float* col, float* dx) {
  const int64_t count = n * g.channels * g.height * g.width;  // dx (n, C, H, W)
  if (count == 0) return;
  if (fits_int32_indices(std::max(count, g.patch() * n * g.out_pixels())))
    col2im_kernel<int32_t><<<grid_for(count), kBlock, 0, s>>>(
        g, static_cast<int32_t>(n), static_cast<int32_t>(count), col, dx);
  else
    col2im_kernel<int64_t><<<grid_for(count), kBlock, 0, s>>>(g, n, count, col, dx);
  CUDA_CHECK_LAUNCH();
}

void conv_output(CUstream_st* s, int64_t n, int64_t co, int64_t p, const float* out,
                 const float* bias, bool relu, float* y) {
  const int64_t count = n * co * p;
  if (count == 0) return;
  if (fits_int32_indices(count))
    conv_output_kernel<int32_t><<<grid_for(count), kBlock, 0, s>>>(
        static_cast<int32_t>(n), static_cast<int32_t>(co), static_cast<int32_t>(p), out, bias,
        relu, y);
  else
    conv_output_kernel<int64_t><<<grid_for(count), kBlock, 0, s>>>(n, co, p, out, bias, relu, y);
  CUDA_CHECK_LAUNCH();
}

void conv_grad_output(CUstream_st* s, int64_t n, int64_t co, int64_t p, const float* y,
                      const float* dy, bool relu, float* g, float* db) {
  const int64_t count = n * co * p;
  if (count > 0) {
    if (fits_int32_indices(count))
      conv_grad_output_kernel<int32_t><<<grid_for(count), kBlock, 0, s>>>(
          static_cast<int32_t>(n), static_cast<int32_t>(co), static_cast<int32_t>(p), y, dy,
          relu, g);
    else
      conv_grad_output_kernel<int64_t><<<grid_for(count), kBlock, 0, s>>>(n, co, p, y, dy, relu, g);
    CUDA_CHECK_LAUNCH();
  }
  // db[c] = the sum of row c of g (co, n * P): g read as a (1, co, n * P) tensor.
  bias_grad(s, 1, co, n * p, g, db, false);
}

}  // namespace towers::kernels::cuda
