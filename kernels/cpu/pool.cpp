#include "kernels/pool.h"

#include "kernels/global_pool_rules.h"

#include <algorithm>
#include <cstring>
#include <limits>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace towers::kernels::cpu {

static inline void window_bounds(const Window& wdw, int64_t o, int64_t& lo, int64_t& hi) {
  int64_t start = o * wdw.stride - wdw.pad_before;
  lo = std::max<int64_t>(start, 0);
  hi = std::min<int64_t>(start + wdw.k, wdw.in);
}

// One output's window, the row-major scan: the first maximal input and its position.
static inline void maxpool_window(const float* xp, int64_t w, int64_t y0, int64_t y1, int64_t x0,
                                  int64_t x1, float* yo, float* ao) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t at = y0 * w + x0;
  for (int64_t iy = y0; iy < y1; ++iy)
    for (int64_t ix = x0; ix < x1; ++ix)
      if (xp[iy * w + ix] > m) m = xp[iy * w + ix], at = iy * w + ix;
  *yo = m;
  if (ao != nullptr) *ao = static_cast<float>(at);
}

#ifdef __AVX2__
// L (8 or 4) outputs side by side whose column windows (stride 2, k wide, the first at column
// x0) lie inside the plane, rows [y0, y1): each output's candidates in maxpool_window's order,
// each taken where it is greater than the maximum so far, so that the maxima and the first
// maximal positions are maxpool_window's, bit for bit. A window column's L inputs, 2 apart,
// come from two loads of L floats (the second L - 1 floats on, so that no float past the last
// input used is read) and shuffles.
template <int L>
static void maxpool_lanes_stride2(const float* xp, int64_t w, int64_t y0, int64_t y1, int64_t x0,
                                  int64_t k, float* yo, float* ao) {
  static_assert(L == 8 || L == 4);
  constexpr float kLow = -std::numeric_limits<float>::infinity();
  // Positions base, base + 2, ... of the L lanes.
  auto seti = [](int32_t base) {
    if constexpr (L == 8)
      return _mm256_add_epi32(_mm256_set1_epi32(base),
                              _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14));
    else
      return _mm_add_epi32(_mm_set1_epi32(base), _mm_setr_epi32(0, 2, 4, 6));
  };
  auto m = [] {
    if constexpr (L == 8)
      return _mm256_set1_ps(kLow);
    else
      return _mm_set1_ps(kLow);
  }();
  auto at = seti(static_cast<int32_t>(y0 * w + x0));
  for (int64_t iy = y0; iy < y1; ++iy)
    for (int64_t dx = 0; dx < k; ++dx) {
      const float* r = xp + iy * w + x0 + dx;
      const auto idx = seti(static_cast<int32_t>(iy * w + x0 + dx));
      if constexpr (L == 8) {
        // [a0 a2 b1 b3 | a4 a6 b5 b7], then the 64-bit pairs in order 0, 2, 1, 3: columns 0,
        // 2, ..., 14 from r.
        const __m256 a = _mm256_loadu_ps(r), b = _mm256_loadu_ps(r + 7);
        const __m256 sh = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 2, 0));
        const __m256 v =
            _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(sh), _MM_SHUFFLE(3, 1, 2, 0)));
        const __m256 gt = _mm256_cmp_ps(v, m, _CMP_GT_OQ);
        m = _mm256_blendv_ps(m, v, gt);
        at = _mm256_castps_si256(
            _mm256_blendv_ps(_mm256_castsi256_ps(at), _mm256_castsi256_ps(idx), gt));
      } else {
        // [a0 a2 b1 b3]: columns 0, 2, 4, 6 from r.
        const __m128 a = _mm_loadu_ps(r), b = _mm_loadu_ps(r + 3);
        const __m128 v = _mm_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 2, 0));
        const __m128 gt = _mm_cmp_ps(v, m, _CMP_GT_OQ);
        m = _mm_blendv_ps(m, v, gt);
        at = _mm_castps_si128(_mm_blendv_ps(_mm_castsi128_ps(at), _mm_castsi128_ps(idx), gt));
      }
    }
  if constexpr (L == 8) {
    _mm256_storeu_ps(yo, m);
    if (ao != nullptr) _mm256_storeu_ps(ao, _mm256_cvtepi32_ps(at));
  } else {
    _mm_storeu_ps(yo, m);
    if (ao != nullptr) _mm_storeu_ps(ao, _mm_cvtepi32_ps(at));
  }
}
#endif

void maxpool_forward(int64_t planes, int64_t h, int64_t w, const Window& rows, const Window& cols,
                     const float* x, float* y, float* argmax) {
  const int64_t out = rows.out * cols.out;
  // The outputs whose column window lies inside the plane, [in_lo, in_hi), go L at a time
  // where the CPU has AVX2 and the column stride is 2 (every net's max-pooling here); the
  // last block of a row overlaps the one before it rather than leave outputs to the scalar
  // scan (an output computed twice comes out the same).
  int64_t in_lo = 0, in_hi = 0, lanes = 0;
#ifdef __AVX2__
  if (cols.stride == 2 && w >= cols.k && h * w < (int64_t{1} << 24)) {
    in_lo = std::min<int64_t>((cols.pad_before + 1) / 2, cols.out);
    in_hi = std::clamp<int64_t>((w - cols.k + cols.pad_before) / 2 + 1, in_lo, cols.out);
    lanes = in_hi - in_lo >= 8 ? 8 : in_hi - in_lo >= 4 ? 4 : 0;
  }
#endif
  if (lanes == 0) in_lo = in_hi = 0;
  for (int64_t p = 0; p < planes; ++p) {
    const float* xp = x + p * h * w;
    float* yp = y + p * out;
    float* ap = argmax != nullptr ? argmax + p * out : nullptr;
    for (int64_t oy = 0; oy < rows.out; ++oy) {
      int64_t y0, y1;
      window_bounds(rows, oy, y0, y1);
      float* yo = yp + oy * cols.out;
      float* ao = ap != nullptr ? ap + oy * cols.out : nullptr;
      auto scalar = [&](int64_t ox) {
        int64_t x0, x1;
        window_bounds(cols, ox, x0, x1);
        maxpool_window(xp, w, y0, y1, x0, x1, yo + ox, ao != nullptr ? ao + ox : nullptr);
      };
      for (int64_t ox = 0; ox < in_lo; ++ox) scalar(ox);
#ifdef __AVX2__
      for (int64_t b = in_lo; lanes > 0 && b < in_hi; b += lanes) {
        const int64_t ox = std::min(b, in_hi - lanes);
        const int64_t x0 = ox * 2 - cols.pad_before;
        float* a = ao != nullptr ? ao + ox : nullptr;
        if (lanes == 8)
          maxpool_lanes_stride2<8>(xp, w, y0, y1, x0, cols.k, yo + ox, a);
        else
          maxpool_lanes_stride2<4>(xp, w, y0, y1, x0, cols.k, yo + ox, a);
      }
#endif
      for (int64_t ox = in_hi; ox < cols.out; ++ox) scalar(ox);
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
