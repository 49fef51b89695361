// lrn.cu — local response normalisation on the GPU, one thread per element, each summing its
// own channel window; 32-bit indices where they fit. Rules in kernels/cuda/lrn_rules.h.
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/lrn_rules.h"
#include "kernels/lrn.h"

namespace towers::kernels::cuda {

namespace {

template <class I>
struct LrnForward {
  LrnParams p;
  I c, hw;
  const float* x;
  float *y, *scale;
  TOWERS_HD void operator()(I i) const { body(p, c, hw, x, y, scale, i); }
  static TOWERS_HD void body(const LrnParams& p, I c, I hw, const float* __restrict__ x,
                             float* __restrict__ y, float* __restrict__ scale, I i) {
    float yv, sv;
    lrn_forward_at<I>(p, c, hw, x, i, yv, sv);
    y[i] = yv;
    scale[i] = sv;
  }
};

template <class I>
struct LrnBackward {
  LrnParams p;
  I c, hw;
  const float *x, *y, *scale, *dy;
  float* dx;
  TOWERS_HD void operator()(I i) const { body(p, c, hw, x, y, scale, dy, dx, i); }
  static TOWERS_HD void body(const LrnParams& p, I c, I hw, const float* __restrict__ x,
                             const float* __restrict__ y, const float* __restrict__ scale,
                             const float* __restrict__ dy, float* __restrict__ dx, I i) {
    dx[i] = lrn_backward_at<I>(p, c, hw, x, y, scale, dy, i);
  }
};

}  // namespace

void lrn_forward(CUstream_st* s, const LrnParams& p, int64_t n, int64_t c, int64_t hw,
                 const float* x, float* y, float* scale) {
  const int64_t count = n * c * hw;
  launch_narrow_or_wide(s, count, fits_int32_indices(count), [&](auto i) {
    using I = decltype(i);
    return LrnForward<I>{p, static_cast<I>(c), static_cast<I>(hw), x, y, scale};
  });
}

void lrn_backward(CUstream_st* s, const LrnParams& p, int64_t n, int64_t c, int64_t hw,
                  const float* x, const float* y, const float* scale, const float* dy, float* dx) {
  const int64_t count = n * c * hw;
  launch_narrow_or_wide(s, count, fits_int32_indices(count), [&](auto i) {
    using I = decltype(i);
    return LrnBackward<I>{p, static_cast<I>(c), static_cast<I>(hw), x, y, scale, dy, dx};
  });
}

}  // namespace towers::kernels::cuda
