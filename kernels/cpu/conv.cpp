#include "kernels/conv.h"

#include <algorithm>
#include <cstring>

#include "core/check.h"

namespace towers::kernels {

Padding parse_padding(const std::string& s) {
  if (s == "SAME") return Padding::Same;
  if (s == "VALID") return Padding::Valid;
  TOWERS_FAIL("unknown padding '{}' (expected SAME or VALID)", s);
}

Window make_window(int64_t in, int64_t k, int64_t stride, Padding padding) {
  TOWERS_CHECK(in > 0 && k > 0 && stride > 0, "bad window in={} k={} stride={}", in, k, stride);
  Window w{in, k, stride, 0, 0};
  if (padding == Padding::Same) {
    w.out = (in + stride - 1) / stride;
    int64_t total = std::max<int64_t>((w.out - 1) * stride + k - in, 0);
    w.pad_before = total / 2;
  } else {
    TOWERS_CHECK(in >= k, "VALID window of {} does not fit an input of {}", k, in);
    w.out = (in - k + stride) / stride;
  }
  return w;
}

namespace cpu {

// For output index o, input index = o*stride - pad_before + kk. Returns the range of o for
// which that index lies inside [0, in).
static inline void valid_range(const Window& w, int64_t kk, int64_t& lo, int64_t& hi) {
  // o*stride >= pad_before - kk  and  o*stride <= in - 1 + pad_before - kk
  int64_t a = w.pad_before - kk;
  lo = a <= 0 ? 0 : (a + w.stride - 1) / w.stride;
  int64_t b = w.in - 1 + w.pad_before - kk;
  hi = b < 0 ? 0 : std::min(w.out, b / w.stride + 1);
  if (lo > hi) lo = hi;
}

void im2col(const ConvGeometry& g, const float* x, float* col, int64_t ld) {
  const Window& R = g.rows;
  const Window& C = g.cols;
  const bool whole_rows = R.stride == 1 && C.stride == 1 && C.out == g.width;
  int64_t row = 0;
  for (int64_t c = 0; c < g.channels; ++c) {
    const float* plane = x + c * g.height * g.width;
    for (int64_t ky = 0; ky < R.k; ++ky) {
      int64_t oy_lo, oy_hi;
      valid_range(R, ky, oy_lo, oy_hi);
      for (int64_t kx = 0; kx < C.k; ++kx, ++row) {
        float* dst = col + row * ld;
        int64_t ox_lo, ox_hi;
        valid_range(C, kx, ox_lo, ox_hi);
        if (whole_rows && oy_lo < oy_hi && ox_lo < ox_hi) {
          // Stride 1 with as many output as input columns: the row is the plane shifted by
          // (ky - pad) rows and (kx - pad) columns, so one copy fills [oy_lo, oy_hi), reading
          // only inside the plane; then the wrapped columns and the rows outside are zeroed.
          const int64_t first = oy_lo * C.out + ox_lo, last = (oy_hi - 1) * C.out + ox_hi;
          const int64_t shift = (ky - R.pad_before) * g.width + kx - C.pad_before;
          std::memset(dst, 0, sizeof(float) * first);
          std::memcpy(dst + first, plane + first + shift, sizeof(float) * (last - first));
          std::memset(dst + last, 0, sizeof(float) * (R.out * C.out - last));
          for (int64_t oy = oy_lo; oy < oy_hi; ++oy) {
            float* d = dst + oy * C.out;
            if (oy > oy_lo)
              for (int64_t ox = 0; ox < ox_lo; ++ox) d[ox] = 0.0f;
            if (oy + 1 < oy_hi)
              for (int64_t ox = ox_hi; ox < C.out; ++ox) d[ox] = 0.0f;
          }
          continue;
        }
        for (int64_t oy = 0; oy < R.out; ++oy) {
          float* d = dst + oy * C.out;
          if (oy < oy_lo || oy >= oy_hi) {
            std::memset(d, 0, sizeof(float) * C.out);
            continue;
          }
          const float* src = plane + (oy * R.stride - R.pad_before + ky) * g.width;
          for (int64_t ox = 0; ox < ox_lo; ++ox) d[ox] = 0.0f;
          if (C.stride == 1) {
            std::memcpy(d + ox_lo, src + ox_lo - C.pad_before + kx,
                        sizeof(float) * (ox_hi - ox_lo));
          } else {
            for (int64_t ox = ox_lo; ox < ox_hi; ++ox)
              d[ox] = src[ox * C.stride - C.pad_before + kx];
          }
          for (int64_t ox = ox_hi; ox < C.out; ++ox) d[ox] = 0.0f;
        }
      }
    }
  }
}

void col2im(const ConvGeometry& g, const float* col, int64_t ld, float* dx) {
  const Window& R = g.rows;
  const Window& C = g.cols;
  std::memset(dx, 0, sizeof(float) * g.channels * g.height * g.width);
  int64_t row = 0;
  for (int64_t c = 0; c < g.channels; ++c) {
    float* plane = dx + c * g.height * g.width;
    for (int64_t ky = 0; ky < R.k; ++ky) {
      int64_t oy_lo, oy_hi;
      valid_range(R, ky, oy_lo, oy_hi);
      for (int64_t kx = 0; kx < C.k; ++kx, ++row) {
        const float* src_row = col + row * ld;
        int64_t ox_lo, ox_hi;
        valid_range(C, kx, ox_lo, ox_hi);
        for (int64_t oy = oy_lo; oy < oy_hi; ++oy) {
          const float* s = src_row + oy * C.out;
          float* d = plane + (oy * R.stride - R.pad_before + ky) * g.width;
          if (C.stride == 1) {
            float* __restrict__ dd = d + kx - C.pad_before;
            for (int64_t ox = ox_lo; ox < ox_hi; ++ox) dd[ox] += s[ox];
          } else {
            for (int64_t ox = ox_lo; ox < ox_hi; ++ox) d[ox * C.stride - C.pad_before + kx] += s[ox];
          }
        }
      }
    }
  }
}

}  // namespace cpu
}  // namespace towers::kernels
