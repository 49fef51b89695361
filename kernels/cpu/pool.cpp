#include "kernels/pool.h"

#include "kernels/global_pool_rules.h"

#include <algorithm>
#include <cstring>
#include <limits>

namespace towers::kernels::cpu {

static inline void window_bounds(const Window& wdw, int64_t o, int64_t& lo, int64_t& hi) {
  int64_t start = o * wdw.stride - wdw.pad_before;
  lo = std::max<int64_t>(start, 0);
  hi = std::min<int64_t>(start + wdw.k, wdw.in);
}

void maxpool_forward(int64_t planes, int64_t h, int64_t w, const Window& rows, const Window& cols,
                     const float* x, float* y, float* argmax) {
  const int64_t out = rows.out * cols.out;
  for (int64_t p = 0; p < planes; ++p) {
    const float* xp = x + p * h * w;
    float* yp = y + p * out;
    float* ap = argmax != nullptr ? argmax + p * out : nullptr;
    for (int64_t oy = 0; oy < rows.out; ++oy) {
      int64_t y0, y1;
      window_bounds(rows, oy, y0, y1);
      for (int64_t ox = 0; ox < cols.out; ++ox) {
        int64_t x0, x1;
        window_bounds(cols, ox, x0, x1);
        float m = -std::numeric_limits<float>::infinity();
        int64_t at = y0 * w + x0;
        for (int64_t iy = y0; iy < y1; ++iy)
          for (int64_t ix = x0; ix < x1; ++ix)
            if (xp[iy * w + ix] > m) m = xp[iy * w + ix], at = iy * w + ix;
        yp[oy * cols.out + ox] = m;
        if (ap != nullptr) ap[oy * cols.out + ox] = static_cast<float>(at);
      }
    }
  }
}

void maxpool_backward(int64_t planes, int64_t h, int64_t w, const Window& rows,
                      const Window& cols, const float* argmax, const float* dy, float* dx) {
  const int64_t out = rows.out * cols.out;
  std::memset(dx, 0, sizeof(float) * planes * h * w);
  for (int64_t p = 0; p < planes; ++p) {
    float* dxp = dx + p * h * w;
    for (int64_t o = 0; o < out; ++o)
      dxp[static_cast<int64_t>(argmax[p * out + o])] += dy[p * out + o];
  }
}

void global_avg_pool_forward(int64_t planes, int64_t hw, const float* x, float* y) {
  for (int64_t p = 0; p < planes; ++p) y[p] = global_avg_pool_at(hw, x, p);
}

void global_avg_pool_backward(int64_t planes, int64_t hw, const float* dy, float* dx) {
  for (int64_t i = 0; i < planes * hw; ++i) dx[i] = global_avg_pool_backward_at(hw, dy, i);
}

}  // namespace towers::kernels::cpu
