#include "layers/dropout.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/check.h"
#include "core/gpu.h"
#include "core/parallel.h"
#include "core/rng.h"

#if TOWERS_HAVE_CUDA
#include <cuda_runtime.h>

#include "core/cuda_check.h"
#endif

namespace towers {

namespace {
// Elements per CPU task, rounded to whole examples.
int64_t examples_per_task(int64_t per_example) {
  return std::max<int64_t>(1, (int64_t{1} << 14) / per_example);
}
}  // namespace

Shape Dropout::infer(const Shape& in) {
  TOWERS_CHECK(!in.empty() && numel(in) > 0, "{}: dropout needs a non-empty input, got {}", name(),
               to_string(in));
  TOWERS_CHECK(cfg_.rate >= 0.0 && cfg_.rate < 1.0, "{}: dropout rate must be in [0, 1), got {}",
               name(), cfg_.rate);
  TOWERS_CHECK(numel(in) < (int64_t{1} << 32), "{}: dropout takes fewer than 2^32 elements per "
               "example, got {}", name(), numel(in));
  // The salt, a hash of the name: two dropout layers of a net draw independent masks.
  p_ = kernels::dropout_params(cfg_.rate, numel(in), hash_string(name()));
  return in;
}

void Dropout::forward(const ForwardArgs& a) const {
  const int64_t sz = p_.per_example;
  if (!a.training || p_.threshold == 0) {
    if (a.y != a.x) std::memcpy(a.y, a.x, sizeof(float) * a.n * sz);
    return;
  }
  TOWERS_CHECK(a.noise != nullptr, "{}: a training forward of dropout needs the step's noise",
               name());
  for_chunks(a.n, examples_per_task(sz), [&](int64_t, int64_t e0, int64_t e1) {
    kernels::cpu::dropout_forward(p_, *a.noise, e0, e1, a.x, a.y);
  });
}

void Dropout::backward(const BackwardArgs& a) const {
  if (a.dx == nullptr) return;
  const int64_t sz = p_.per_example;
  if (p_.threshold == 0) {
    std::memcpy(a.dx, a.dy, sizeof(float) * a.n * sz);
    return;
  }
  TOWERS_CHECK(a.noise != nullptr, "{}: dropout's backward needs the step's noise", name());
  for_chunks(a.n, examples_per_task(sz), [&](int64_t, int64_t e0, int64_t e1) {
    kernels::cpu::dropout_backward(p_, *a.noise, e0, e1, a.dy, a.dx);
  });
}

#if TOWERS_HAVE_CUDA
// ---- the GPU twin ----------------------------------------------------------------------------
namespace kc = kernels::cuda;

namespace {
void copy_on(const GpuExec& e, float* dst, const float* src, int64_t count) {
  if (dst != src && count > 0)
    CUDA_CHECK(cudaMemcpyAsync(dst, src, sizeof(float) * count, cudaMemcpyDeviceToDevice, e.stream));
}
}  // namespace

void Dropout::forward_gpu(const GpuExec& e, const ForwardArgs& a) const {
  if (!a.training || p_.threshold == 0) {
    copy_on(e, a.y, a.x, a.n * p_.per_example);
    return;
  }
  TOWERS_CHECK(a.noise != nullptr, "{}: a training forward of dropout needs the step's noise",
               name());
  kc::dropout_forward(e.stream, p_, a.noise, a.n, a.x, a.y);
}

void Dropout::backward_gpu(const GpuExec& e, const BackwardArgs& a) const {
  if (a.dx == nullptr) return;
  if (p_.threshold == 0) {
    copy_on(e, a.dx, a.dy, a.n * p_.per_example);
    return;
  }
  TOWERS_CHECK(a.noise != nullptr, "{}: dropout's backward needs the step's noise", name());
  kc::dropout_backward(e.stream, p_, a.noise, a.n, a.dy, a.dx);
}
#endif  // TOWERS_HAVE_CUDA

}  // namespace towers
