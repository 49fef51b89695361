// conv.cu — the convolution's data movers on the GPU: batched im2col/col2im and the two
// element-wise kernels around the GEMM. The per-element rules are in kernels/cuda/conv_rules.h.
// Each kernel indexes in 32 bits where every index it forms fits (fits_int32_indices).
#include <algorithm>

#include "kernels/bias.h"
#include "kernels/conv.h"
#include "kernels/cuda/conv_rules.h"
#include "kernels/cuda/launch.cuh"

namespace towers::kernels::cuda {

namespace {

template <class I>
struct Im2col {
  ConvGeometry g;
  I n;
  const float* x;
  float* col;
  TOWERS_HD void operator()(I i) const { body(g, n, x, col, i); }
  static TOWERS_HD void body(const ConvGeometry& g, I n, const float* __restrict__ x,
                             float* __restrict__ col, I i) {
    col[i] = im2col_at<I>(g, n, x, i);
  }
};

template <class I>
struct Col2im {
  ConvGeometry g;
  I n;
  const float* col;
  float* dx;
  TOWERS_HD void operator()(I i) const { body(g, n, col, dx, i); }
  static TOWERS_HD void body(const ConvGeometry& g, I n, const float* __restrict__ col,
                             float* __restrict__ dx, I i) {
    dx[i] = col2im_at<I>(g, n, col, i);
  }
};

template <class I>
struct ConvOutput {
  I n, co, p;
  const float *out, *bias;
  bool relu;
  float* y;
  TOWERS_HD void operator()(I i) const { body(n, co, p, out, bias, relu, y, i); }
  static TOWERS_HD void body(I n, I co, I p, const float* __restrict__ out,
                             const float* __restrict__ bias, bool relu, float* __restrict__ y,
                             I i) {
    y[i] = conv_output_at<I>(n, co, p, out, bias, relu, i);
  }
};

template <class I>
struct ConvGradOutput {
  I n, co, p;
  const float *y, *dy;
  bool relu;
  float* g;
  TOWERS_HD void operator()(I i) const { body(n, co, p, y, dy, relu, g, i); }
  static TOWERS_HD void body(I n, I co, I p, const float* __restrict__ y,
                             const float* __restrict__ dy, bool relu, float* __restrict__ g, I i) {
    g[i] = conv_grad_output_at<I>(n, co, p, y, dy, relu, i);
  }
};

}  // namespace

void im2col(CUstream_st* s, const ConvGeometry& g, int64_t n, const float* x, float* col) {
  const int64_t count = g.patch() * n * g.out_pixels();  // col (patch, n * P)
  const bool narrow = fits_int32_indices(std::max(count, n * g.channels * g.height * g.width));
  launch_narrow_or_wide(s, count, narrow, [&](auto i) {
    using I = decltype(i);
    return Im2col<I>{g, static_cast<I>(n), x, col};
  });
}

void col2im(CUstream_st* s, const ConvGeometry& g, int64_t n, const float* col, float* dx) {
  const int64_t count = n * g.channels * g.height * g.width;  // dx (n, C, H, W)
  const bool narrow = fits_int32_indices(std::max(count, g.patch() * n * g.out_pixels()));
  launch_narrow_or_wide(s, count, narrow, [&](auto i) {
    using I = decltype(i);
    return Col2im<I>{g, static_cast<I>(n), col, dx};
  });
}

void conv_output(CUstream_st* s, int64_t n, int64_t co, int64_t p, const float* out,
                 const float* bias, bool relu, float* y) {
  const int64_t count = n * co * p;
  launch_narrow_or_wide(s, count, fits_int32_indices(count), [&](auto i) {
    using I = decltype(i);
    return ConvOutput<I>{static_cast<I>(n), static_cast<I>(co), static_cast<I>(p), out, bias,
                         relu, y};
  });
}

void conv_grad_output(CUstream_st* s, int64_t n, int64_t co, int64_t p, const float* y,
                      const float* dy, bool relu, float* g, float* db, double* partials) {
  const int64_t count = n * co * p;
  launch_narrow_or_wide(s, count, fits_int32_indices(count), [&](auto i) {
    using I = decltype(i);
    return ConvGradOutput<I>{static_cast<I>(n), static_cast<I>(co), static_cast<I>(p), y, dy,
                             relu, g};
  });
  // db[c] = the sum of row c of g (co, n * P): g read as a (1, co, n * P) tensor.
  bias_grad(s, 1, co, n * p, g, db, false, partials);
}

}  // namespace towers::kernels::cuda
