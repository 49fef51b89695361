// pool.cu — max-pooling on the GPU. Forward: one thread per output element; backward: one
// thread per input element, gathering (no atomics); 32-bit indices where they fit, divided by
// multiply and shift (kernels/divisor.h). Rules in kernels/cuda/pool_rules.h.
// Global average pooling: one thread per plane forward, one per input element backward; rules
// in kernels/global_pool_rules.h.
#include <algorithm>

#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/pool_rules.h"
#include "kernels/global_pool_rules.h"
#include "kernels/pool.h"

namespace towers::kernels::cuda {

namespace {

template <class I>
struct MaxpoolForward {
  PoolShape<I> shape;
  const float* x;
  float *y, *argmax;
  TOWERS_HD void operator()(I i) const { body(shape, x, y, argmax, i); }
  static TOWERS_HD void body(const PoolShape<I>& shape, const float* __restrict__ x,
                             float* __restrict__ y, float* __restrict__ argmax, I i) {
    float m;
    I at;
    maxpool_at<I>(shape, x, i, m, at);
    y[i] = m;
    if (argmax != nullptr) argmax[i] = static_cast<float>(at);
  }
};

template <class I>
struct MaxpoolBackward {
  PoolShape<I> shape;
  const float *argmax, *dy;
  float* dx;
  TOWERS_HD void operator()(I i) const { body(shape, argmax, dy, dx, i); }
  static TOWERS_HD void body(const PoolShape<I>& shape, const float* __restrict__ argmax,
                             const float* __restrict__ dy, float* __restrict__ dx, I i) {
    dx[i] = maxpool_backward_at<I>(shape, argmax, dy, i);
  }
};

struct GlobalAvgPoolForward {
  int64_t hw;
  const float* x;
  float* y;
  TOWERS_HD void operator()(int64_t p) const { body(hw, x, y, p); }
  static TOWERS_HD void body(int64_t hw, const float* __restrict__ x, float* __restrict__ y,
                             int64_t p) {
    y[p] = global_avg_pool_at(hw, x, p);
  }
};

struct GlobalAvgPoolBackward {
  int64_t hw;
  const float* dy;
  float* dx;
  TOWERS_HD void operator()(int64_t i) const { body(hw, dy, dx, i); }
  static TOWERS_HD void body(int64_t hw, const float* __restrict__ dy, float* __restrict__ dx,
                             int64_t i) {
    dx[i] = global_avg_pool_backward_at(hw, dy, i);
  }
};

}  // namespace

// Both index in 32 bits when the input and the output fit (their indices are the largest
// any rule forms).
void maxpool_forward(CUstream_st* s, int64_t planes, int64_t h, int64_t w, const Window& rows,
                     const Window& cols, const float* x, float* y, float* argmax) {
  const int64_t count = planes * rows.out * cols.out;
  launch_narrow_or_wide(s, count, fits_int32_indices(std::max(count, planes * h * w)),
                        [&](auto i) {
                          using I = decltype(i);
                          return MaxpoolForward<I>{PoolShape<I>(rows, cols, h, w), x, y, argmax};
                        });
}

void maxpool_backward(CUstream_st* s, int64_t planes, int64_t h, int64_t w, const Window& rows,
                      const Window& cols, const float* argmax, const float* dy, float* dx) {
  const int64_t count = planes * h * w;
  launch_narrow_or_wide(s, count, fits_int32_indices(std::max(count, planes * rows.out * cols.out)),
                        [&](auto i) {
                          using I = decltype(i);
                          return MaxpoolBackward<I>{PoolShape<I>(rows, cols, h, w), argmax, dy,
                                                    dx};
                        });
}

void global_avg_pool_forward(CUstream_st* s, int64_t planes, int64_t hw, const float* x, float* y) {
  for_each_index(s, planes, GlobalAvgPoolForward{hw, x, y});
}

void global_avg_pool_backward(CUstream_st* s, int64_t planes, int64_t hw, const float* dy,
                              float* dx) {
  for_each_index(s, planes * hw, GlobalAvgPoolBackward{hw, dy, dx});
}

}  // namespace towers::kernels::cuda
