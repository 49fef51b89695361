// lrn.cu — local response normalisation on the GPU, one thread per element, each summing its
// own channel window. Rules in kernels/cuda/lrn_rules.h.
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/lrn_rules.h"
#include "kernels/lrn.h"

namespace towers::kernels::cuda {

namespace {

struct LrnForward {
  LrnParams p;
  int64_t c, hw;
  const float* x;
  float *y, *scale;
  TOWERS_HD void operator()(int64_t i) const { body(p, c, hw, x, y, scale, i); }
  static TOWERS_HD void body(const LrnParams& p, int64_t c, int64_t hw, const float* __restrict__ x,
                             float* __restrict__ y, float* __restrict__ scale, int64_t i) {
    float yv, sv;
    lrn_forward_at(p, c, hw, x, i, yv, sv);
    y[i] = yv;
    scale[i] = sv;
  }
};

struct LrnBackward {
  LrnParams p;
  int64_t c, hw;
  const float *x, *y, *scale, *dy;
  float* dx;
  TOWERS_HD void operator()(int64_t i) const { body(p, c, hw, x, y, scale, dy, dx, i); }
  static TOWERS_HD void body(const LrnParams& p, int64_t c, int64_t hw, const float* __restrict__ x,
                             const float* __restrict__ y, const float* __restrict__ scale,
                             const float* __restrict__ dy, float* __restrict__ dx, int64_t i) {
    dx[i] = lrn_backward_at(p, c, hw, x, y, scale, dy, i);
  }
};

}  // namespace

void lrn_forward(CUstream_st* s, const LrnParams& p, int64_t n, int64_t c, int64_t hw,
                 const float* x, float* y, float* scale) {
  for_each_index(s, n * c * hw, LrnForward{p, c, hw, x, y, scale});
}

void lrn_backward(CUstream_st* s, const LrnParams& p, int64_t n, int64_t c, int64_t hw,
                  const float* x, const float* y, const float* scale, const float* dy, float* dx) {
  for_each_index(s, n * c * hw, LrnBackward{p, c, hw, x, y, scale, dy, dx});
}

}  // namespace towers::kernels::cuda
