// dropout.cu — dropout on the GPU, one thread per element; the mask's rule is in
// kernels/dropout_rules.h. The step's noise is read from device memory when the kernel runs.
#include "core/check.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/dropout.h"
#include "kernels/dropout_rules.h"

namespace towers::kernels::cuda {

namespace {

// Scales src into dst where the mask keeps, zeroes elsewhere: forward (x -> y) and backward
// (dy -> dx) are the same map.
struct DropoutMap {
  DropoutParams p;
  const StepNoise* noise;
  const float* src;
  float* dst;
  TOWERS_HD void operator()(int64_t i) const { body(p, noise, src, dst, i); }
  static TOWERS_HD void body(const DropoutParams& p, const StepNoise* __restrict__ noise,
                             const float* __restrict__ src, float* __restrict__ dst, int64_t i) {
    const StepNoise nz = *noise;
    const int64_t e = i / p.per_example, j = i - e * p.per_example;
    dst[i] = dropout_at(p, dropout_key(nz.key, p.salt), static_cast<uint64_t>(nz.first_example + e),
                        static_cast<uint64_t>(j), src[i]);
  }
};

void launch(CUstream_st* stream, const DropoutParams& p, const StepNoise* noise, int64_t n,
            const float* src, float* dst) {
  const int64_t count = n * p.per_example;
  if (count == 0) return;
  TOWERS_CHECK(noise != nullptr, "dropout on the GPU needs the step's noise in device memory");
  for_each_index(stream, count, DropoutMap{p, noise, src, dst});
}

}  // namespace

void dropout_forward(CUstream_st* stream, const DropoutParams& p, const StepNoise* noise,
                     int64_t n, const float* x, float* y) {
  launch(stream, p, noise, n, x, y);
}

void dropout_backward(CUstream_st* stream, const DropoutParams& p, const StepNoise* noise,
                      int64_t n, const float* dy, float* dx) {
  launch(stream, p, noise, n, dy, dx);
}

}  // namespace towers::kernels::cuda
