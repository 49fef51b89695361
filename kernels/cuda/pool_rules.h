// pool_rules.h — the per-element rules of the max-pool kernels (kernels/cuda/pool.cu), shared
// with the CPU tests (tests/rules_conv_test.cpp). Plain C++17 with TOWERS_HD.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/conv.h"
#include "kernels/hd.h"

namespace towers::kernels::cuda {

// Output element idx of x (planes, h, w) -> (planes, rows.out, cols.out): y receives the
// window's maximum and at its index within the plane, the first maximal input in row-major
// order; padding never wins (the scan starts from -inf at the window's first input inside).
TOWERS_HD void maxpool_at(const Window& rows, const Window& cols, int64_t h, int64_t w,
                          const float* x, int64_t idx, float& y, int64_t& at) {
  const int64_t out = rows.out * cols.out;
  const int64_t plane = idx / out, o = idx - plane * out;
  const int64_t oy = o / cols.out, ox = o - oy * cols.out;
  const int64_t sy = oy * rows.stride - rows.pad_before, sx = ox * cols.stride - cols.pad_before;
  const int64_t y0 = sy > 0 ? sy : 0, y1 = sy + rows.k < rows.in ? sy + rows.k : rows.in;
  const int64_t x0 = sx > 0 ? sx : 0, x1 = sx + cols.k < cols.in ? sx + cols.k : cols.in;
  const float* xp = x + plane * h * w;
  float m = -INFINITY;
  at = y0 * w + x0;
  for (int64_t iy = y0; iy < y1; ++iy)
    for (int64_t ix = x0; ix < x1; ++ix)
      if (xp[iy * w + ix] > m) m = xp[iy * w + ix], at = iy * w + ix;
  y = m;
}

// dx[idx] for input element (plane, iy, ix): the sum of dy over the windows that contain it and
// whose recorded argmax (a float index within the plane) is this element, in row-major window
// order starting from 0, the order in which the CPU twin's scatter adds them.
TOWERS_HD float maxpool_backward_at(const Window& rows, const Window& cols, int64_t h, int64_t w,
                                    const float* argmax, const float* dy, int64_t idx) {
  const int64_t hw = h * w;
  const int64_t plane = idx / hw, self = idx - plane * hw;
  const int64_t iy = self / w, ix = self - iy * w;
  // Window o covers [o * stride - pad, o * stride - pad + k): the o with
  // iy + pad - k < o * stride <= iy + pad.
  const int64_t ty = iy + rows.pad_before, tx = ix + cols.pad_before;
  const int64_t ly = ty - rows.k + 1, lx = tx - cols.k + 1;
  const int64_t oy0 = ly <= 0 ? 0 : (ly + rows.stride - 1) / rows.stride;
  const int64_t ox0 = lx <= 0 ? 0 : (lx + cols.stride - 1) / cols.stride;
  const int64_t oy1 = ty / rows.stride + 1 < rows.out ? ty / rows.stride + 1 : rows.out;
  const int64_t ox1 = tx / cols.stride + 1 < cols.out ? tx / cols.stride + 1 : cols.out;
  const int64_t out = rows.out * cols.out;
  const float* ap = argmax + plane * out;
  const float* dp = dy + plane * out;
  float sum = 0.0f;
  for (int64_t oy = oy0; oy < oy1; ++oy)
    for (int64_t ox = ox0; ox < ox1; ++ox) {
      const int64_t o = oy * cols.out + ox;
      if (static_cast<int64_t>(ap[o]) == self) sum += dp[o];
    }
  return sum;
}

}  // namespace towers::kernels::cuda
