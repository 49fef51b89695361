// pool_rules.h — the per-element rules of the max-pool kernels (kernels/cuda/pool.cu), shared
// with the CPU tests (tests/rules_conv_test.cpp). Plain C++17 with TOWERS_HD.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/conv.h"
#include "kernels/divisor.h"
#include "kernels/hd.h"

namespace towers::kernels::cuda {

// A window's numbers in the index type of the call.
template <class I>
struct WindowOf {
  I in, k, stride, out, pad_before;
  TOWERS_HD explicit WindowOf(const Window& w)
      : in(static_cast<I>(w.in)), k(static_cast<I>(w.k)), stride(static_cast<I>(w.stride)),
        out(static_cast<I>(w.out)), pad_before(static_cast<I>(w.pad_before)) {}
};

// The index type I is a parameter, as in conv_rules.h: the kernels take 32-bit arithmetic
// whenever every index of the call fits (fits_int32_indices), and the tests run both.

// A max-pool call's sizes in the index type of the call, with every divisor its rules divide
// by (divisor.h: a multiply and a shift in 32 bits). Built once per launch.
template <class I>
struct PoolShape {
  WindowOf<I> rows, cols;
  I w;
  Divisor<I> out_plane, out_cols;  // an output index: its plane, then its row
  Divisor<I> in_plane, in_cols;    // an input index: its plane, then its row
  Divisor<I> row_stride, col_stride;
  TOWERS_HD PoolShape(const Window& r, const Window& c, int64_t h_, int64_t w_)
      : rows(r), cols(c), w(static_cast<I>(w_)),
        out_plane(static_cast<I>(r.out * c.out)), out_cols(static_cast<I>(c.out)),
        in_plane(static_cast<I>(h_ * w_)), in_cols(static_cast<I>(w_)),
        row_stride(static_cast<I>(r.stride)), col_stride(static_cast<I>(c.stride)) {}
};

// Output element idx of x (planes, h, w) -> (planes, rows.out, cols.out): y receives the
// window's maximum and at its index within the plane, the first maximal input in row-major
// order; padding never wins (the scan starts from -inf at the window's first input inside).
template <class I = int64_t>
TOWERS_HD void maxpool_at(const PoolShape<I>& s, const float* x, I idx, float& y, I& at) {
  const WindowOf<I>&rows = s.rows, &cols = s.cols;
  const I w = s.w;
  I plane, o, oy, ox;
  s.out_plane.divmod(idx, plane, o);
  s.out_cols.divmod(o, oy, ox);
  const I sy = oy * rows.stride - rows.pad_before, sx = ox * cols.stride - cols.pad_before;
  const I y0 = sy > 0 ? sy : 0, y1 = sy + rows.k < rows.in ? sy + rows.k : rows.in;
  const I x0 = sx > 0 ? sx : 0, x1 = sx + cols.k < cols.in ? sx + cols.k : cols.in;
  const float* xp = x + plane * s.in_plane.value();
  float m = -INFINITY;
  at = y0 * w + x0;
  for (I iy = y0; iy < y1; ++iy)
    for (I ix = x0; ix < x1; ++ix)
      if (xp[iy * w + ix] > m) m = xp[iy * w + ix], at = iy * w + ix;
  y = m;
}

// dx[idx] for input element (plane, iy, ix): the sum of dy over the windows that contain it and
// whose recorded argmax (a float index within the plane) is this element, in row-major window
// order starting from 0, the order in which the CPU twin's scatter adds them.
template <class I = int64_t>
TOWERS_HD float maxpool_backward_at(const PoolShape<I>& s, const float* argmax, const float* dy,
                                    I idx) {
  const WindowOf<I>&rows = s.rows, &cols = s.cols;
  I plane, self, iy, ix;
  s.in_plane.divmod(idx, plane, self);
  s.in_cols.divmod(self, iy, ix);
  // Window o covers [o * stride - pad, o * stride - pad + k): the o with
  // iy + pad - k < o * stride <= iy + pad.
  const I ty = iy + rows.pad_before, tx = ix + cols.pad_before;
  const I ly = ty - rows.k + 1, lx = tx - cols.k + 1;
  const I oy0 = ly <= 0 ? 0 : s.row_stride.div(ly + rows.stride - 1);
  const I ox0 = lx <= 0 ? 0 : s.col_stride.div(lx + cols.stride - 1);
  const I oy1 = s.row_stride.div(ty) + 1 < rows.out ? s.row_stride.div(ty) + 1 : rows.out;
  const I ox1 = s.col_stride.div(tx) + 1 < cols.out ? s.col_stride.div(tx) + 1 : cols.out;
  const I out = s.out_plane.value();
  const float* ap = argmax + plane * out;
  const float* dp = dy + plane * out;
  float sum = 0.0f;
  for (I oy = oy0; oy < oy1; ++oy)
    for (I ox = ox0; ox < ox1; ++ox) {
      const I o = oy * cols.out + ox;
      if (static_cast<I>(ap[o]) == self) sum += dp[o];
    }
  return sum;
}

}  // namespace towers::kernels::cuda
