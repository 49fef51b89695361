// conv_rules.h — the per-element rules of the convolution kernels (kernels/cuda/conv.cu): each
// returns one output element from its flat index, so a kernel is a grid-stride loop over them
// and the CPU tests (tests/rules_conv_test.cpp) run the very same code over every index.
// Plain C++17 with TOWERS_HD: compiled by g++ without CUDA headers as well as by nvcc.
#pragma once

#include <cstdint>

#include "kernels/conv.h"
#include "kernels/hd.h"

namespace towers::kernels::cuda {

// col[idx] of the batched im2col: col is (patch, n * P), image i's columns at [i*P, (i+1)*P);
// row (c, ky, kx) and column (i, oy, ox) read x[i, c, oy*stride - pad + ky, ox*stride - pad + kx],
// 0 where that falls in the padding. x is (n, C, H, W).
TOWERS_HD float im2col_at(const ConvGeometry& g, int64_t n, const float* x, int64_t idx) {
  const int64_t p = g.out_pixels(), ld = n * p;
  const int64_t row = idx / ld, j = idx - row * ld;
  const int64_t i = j / p, q = j - i * p;
  const int64_t oy = q / g.cols.out, ox = q - oy * g.cols.out;
  const int64_t kx = row % g.cols.k, ky = (row / g.cols.k) % g.rows.k;
  const int64_t c = row / (g.cols.k * g.rows.k);
  const int64_t iy = oy * g.rows.stride - g.rows.pad_before + ky;
  const int64_t ix = ox * g.cols.stride - g.cols.pad_before + kx;
  if (iy < 0 || iy >= g.height || ix < 0 || ix >= g.width) return 0.0f;
  return x[((i * g.channels + c) * g.height + iy) * g.width + ix];
}

// dx[idx] of the batched col2im: the sum of the col entries that im2col reads from input
// element (i, c, iy, ix), added in (ky, kx) order starting from 0, which is the order in which
// the CPU twin's scatter reaches that element, so both give the same float. dx is (n, C, H, W).
TOWERS_HD float col2im_at(const ConvGeometry& g, int64_t n, const float* col, int64_t idx) {
  const int64_t p = g.out_pixels(), ld = n * p;
  const int64_t ix = idx % g.width, iy = (idx / g.width) % g.height;
  const int64_t c = (idx / (g.width * g.height)) % g.channels;
  const int64_t i = idx / (g.width * g.height * g.channels);
  const Window& R = g.rows;
  const Window& C = g.cols;
  const float* base = col + c * R.k * C.k * ld + i * p;  // row (c, 0, 0), image i
  float sum = 0.0f;
  for (int64_t ky = 0; ky < R.k; ++ky) {
    const int64_t ty = iy + R.pad_before - ky;  // oy * stride when (oy, ky) reads iy
    if (ty < 0) break;                          // ty only falls as ky grows
    const int64_t oy = ty / R.stride;
    if (oy * R.stride != ty || oy >= R.out) continue;
    for (int64_t kx = 0; kx < C.k; ++kx) {
      const int64_t tx = ix + C.pad_before - kx;
      if (tx < 0) break;
      const int64_t ox = tx / C.stride;
      if (ox * C.stride != tx || ox >= C.out) continue;
      sum += base[(ky * C.k + kx) * ld + oy * C.out + ox];
    }
  }
  return sum;
}

// y[idx] of conv_output: y (n, co, P) = out (co, n * P) + bias[c], then ReLU (max(v, 0), so a
// NaN passes through as on the CPU).
TOWERS_HD float conv_output_at(int64_t n, int64_t co, int64_t p, const float* out,
                               const float* bias, bool relu, int64_t idx) {
  const int64_t q = idx % p, c = (idx / p) % co, i = idx / (p * co);
  const float v = out[c * n * p + i * p + q] + bias[c];
  return relu && v < 0.0f ? 0.0f : v;
}

// g[idx] of conv_grad_output: g (co, n * P) = dy (n, co, P), 0 where y <= 0 when relu.
TOWERS_HD float conv_grad_output_at(int64_t n, int64_t co, int64_t p, const float* y,
                                    const float* dy, bool relu, int64_t idx) {
  const int64_t ld = n * p;
  const int64_t c = idx / ld, j = idx - c * ld;
  const int64_t i = j / p, q = j - i * p;
  const int64_t src = (i * co + c) * p + q;
  return relu && !(y[src] > 0.0f) ? 0.0f : dy[src];
}

}  // namespace towers::kernels::cuda
