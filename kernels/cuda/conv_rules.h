// conv_rules.h — the per-element rules of the convolution kernels (kernels/cuda/conv.cu): each
// returns one output element from its flat index, so a kernel is a grid-stride loop over them
// and the CPU tests (tests/rules_conv_test.cpp) run the very same code over every index.
// Plain C++17 with TOWERS_HD: compiled by g++ without CUDA headers as well as by nvcc.
// The index type I is a parameter: the kernels run the rules in 32-bit arithmetic whenever
// every index of the call fits (64-bit integer division costs the GPU several times more),
// and the tests run both instantiations.
#pragma once

#include <cstdint>

#include "kernels/conv.h"
#include "kernels/hd.h"

namespace towers::kernels::cuda {

// col[idx] of the batched im2col: col is (patch, n * P), image i's columns at [i*P, (i+1)*P);
// row (c, ky, kx) and column (i, oy, ox) read x[i, c, oy*stride - pad + ky, ox*stride - pad + kx],
// 0 where that falls in the padding. x is (n, C, H, W).
template <class I = int64_t>
TOWERS_HD float im2col_at(const ConvGeometry& g, I n, const float* x, I idx) {
  const I p = static_cast<I>(g.out_pixels()), ld = n * p, wo = static_cast<I>(g.cols.out);
  const I kw = static_cast<I>(g.cols.k), kh = static_cast<I>(g.rows.k);
  const I row = idx / ld, j = idx - row * ld;
  const I i = j / p, q = j - i * p;
  const I oy = q / wo, ox = q - oy * wo;
  const I kx = row % kw, ky = (row / kw) % kh;
  const I c = row / (kw * kh);
  const I iy = oy * static_cast<I>(g.rows.stride) - static_cast<I>(g.rows.pad_before) + ky;
  const I ix = ox * static_cast<I>(g.cols.stride) - static_cast<I>(g.cols.pad_before) + kx;
  const I h = static_cast<I>(g.height), w = static_cast<I>(g.width);
  if (iy < 0 || iy >= h || ix < 0 || ix >= w) return 0.0f;
  return x[((i * static_cast<I>(g.channels) + c) * h + iy) * w + ix];
}

// dx[idx] of the batched col2im: the sum of the col entries that im2col reads from input
// element (i, c, iy, ix), added in (ky, kx) order starting from 0, which is the order in which
// the CPU twin's scatter reaches that element, so both give the same float. dx is (n, C, H, W).
template <class I = int64_t>
TOWERS_HD float col2im_at(const ConvGeometry& g, I n, const float* col, I idx) {
  const I p = static_cast<I>(g.out_pixels()), ld = n * p;
  const I w = static_cast<I>(g.width), h = static_cast<I>(g.height);
  const I ix = idx % w, iy = (idx / w) % h;
  const I c = (idx / (w * h)) % static_cast<I>(g.channels);
  const I i = idx / (w * h * static_cast<I>(g.channels));
  const I rk = static_cast<I>(g.rows.k), rs = static_cast<I>(g.rows.stride);
  const I rp = static_cast<I>(g.rows.pad_before), ro = static_cast<I>(g.rows.out);
  const I ck = static_cast<I>(g.cols.k), cs = static_cast<I>(g.cols.stride);
  const I cp = static_cast<I>(g.cols.pad_before), co = static_cast<I>(g.cols.out);
  const float* base = col + c * rk * ck * ld + i * p;  // row (c, 0, 0), image i
  float sum = 0.0f;
  for (I ky = 0; ky < rk; ++ky) {
    const I ty = iy + rp - ky;  // oy * stride when (oy, ky) reads iy
    if (ty < 0) break;          // ty only falls as ky grows
    const I oy = ty / rs;
    if (oy * rs != ty || oy >= ro) continue;
    for (I kx = 0; kx < ck; ++kx) {
      const I tx = ix + cp - kx;
      if (tx < 0) break;
      const I ox = tx / cs;
      if (ox * cs != tx || ox >= co) continue;
      sum += base[(ky * ck + kx) * ld + oy * co + ox];
    }
  }
  return sum;
}

// y[idx] of conv_output: y (n, co, P) = out (co, n * P) + bias[c], then ReLU (max(v, 0), so a
// NaN passes through as on the CPU).
template <class I = int64_t>
TOWERS_HD float conv_output_at(I n, I co, I p, const float* out, const float* bias, bool relu,
                               I idx) {
  const I q = idx % p, c = (idx / p) % co, i = idx / (p * co);
  const float v = out[c * n * p + i * p + q] + bias[c];
  return relu && v < 0.0f ? 0.0f : v;
}

// g[idx] of conv_grad_output: g (co, n * P) = dy (n, co, P), 0 where y <= 0 when relu.
template <class I = int64_t>
TOWERS_HD float conv_grad_output_at(I n, I co, I p, const float* y, const float* dy, bool relu,
                                    I idx) {
  const I ld = n * p;
  const I c = idx / ld, j = idx - c * ld;
  const I i = j / p, q = j - i * p;
  const I src = (i * co + c) * p + q;
  return relu && !(y[src] > 0.0f) ? 0.0f : dy[src];
}

}  // namespace towers::kernels::cuda
