// activation.cu — ReLU and GELU on the GPU, one thread per element. GELU's rules are in
// kernels/activation_rules.h.
#include "kernels/activation.h"
#include "kernels/activation_rules.h"
#include "kernels/cuda/launch.cuh"

namespace towers::kernels::cuda {

namespace {

struct ReluForward {
  const float* x;
  float* y;
  TOWERS_HD void operator()(int64_t i) const { body(x, y, i); }
  static TOWERS_HD void body(const float* __restrict__ x, float* __restrict__ y, int64_t i) {
    y[i] = x[i] > 0.0f ? x[i] : 0.0f;
  }
};

struct ReluBackward {
  const float *y, *dy;
  float* dx;
  TOWERS_HD void operator()(int64_t i) const { body(y, dy, dx, i); }
  static TOWERS_HD void body(const float* __restrict__ y, const float* __restrict__ dy,
                             float* __restrict__ dx, int64_t i) {
    dx[i] = y[i] > 0.0f ? dy[i] : 0.0f;
  }
};

struct GeluForward {
  const float* x;
  float* y;
  TOWERS_HD void operator()(int64_t i) const { body(x, y, i); }
  static TOWERS_HD void body(const float* __restrict__ x, float* __restrict__ y, int64_t i) {
    y[i] = gelu_at(x[i]);
  }
};

struct GeluBackward {
  const float *x, *dy;
  float* dx;
  TOWERS_HD void operator()(int64_t i) const { body(x, dy, dx, i); }
  static TOWERS_HD void body(const float* __restrict__ x, const float* __restrict__ dy,
                             float* __restrict__ dx, int64_t i) {
    dx[i] = gelu_backward_at(x[i], dy[i]);
  }
};

}  // namespace

void relu_forward(CUstream_st* stream, int64_t n, const float* x, float* y) {
  for_each_index(stream, n, ReluForward{x, y});
}

void relu_backward(CUstream_st* stream, int64_t n, const float* y, const float* dy, float* dx) {
  for_each_index(stream, n, ReluBackward{y, dy, dx});
}

void gelu_forward(CUstream_st* stream, int64_t n, const float* x, float* y) {
  for_each_index(stream, n, GeluForward{x, y});
}

void gelu_backward(CUstream_st* stream, int64_t n, const float* x, const float* dy, float* dx) {
  for_each_index(stream, n, GeluBackward{x, dy, dx});
}

}  // namespace towers::kernels::cuda
