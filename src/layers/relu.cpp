#include "layers/relu.h"

#include "core/check.h"
#include "core/gpu.h"
#include "core/parallel.h"
#include "kernels/activation.h"

namespace towers {

Shape Relu::infer(const Shape& in) {
  TOWERS_CHECK(!in.empty() && numel(in) > 0, "{}: relu needs a non-empty input, got {}", name(),
               to_string(in));
  return in;
}

void Relu::forward(const ForwardArgs& a) const {
  const int64_t sz = numel(in_shape());
  for_chunks(a.n, 4, [&](int64_t, int64_t b0, int64_t b1) {
    kernels::cpu::relu_forward((b1 - b0) * sz, a.x + b0 * sz, a.y + b0 * sz);
  });
}

void Relu::backward(const BackwardArgs& a) const {
  if (a.dx == nullptr) return;
  const int64_t sz = numel(in_shape());
  for_chunks(a.n, 4, [&](int64_t, int64_t b0, int64_t b1) {
    kernels::cpu::relu_backward((b1 - b0) * sz, a.y + b0 * sz, a.dy + b0 * sz, a.dx + b0 * sz);
  });
}

#if TOWERS_HAVE_CUDA
// ---- the GPU twin ----------------------------------------------------------------------------
namespace kc = kernels::cuda;

void Relu::forward_gpu(const GpuExec& e, const ForwardArgs& a) const {
  kc::relu_forward(e.stream, a.n * numel(in_shape()), a.x, a.y);
}

void Relu::backward_gpu(const GpuExec& e, const BackwardArgs& a) const {
  if (a.dx == nullptr) return;
  kc::relu_backward(e.stream, a.n * numel(in_shape()), a.y, a.dy, a.dx);
}
#endif  // TOWERS_HAVE_CUDA

}  // namespace towers
