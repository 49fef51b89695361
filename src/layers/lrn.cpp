#include "layers/lrn.h"

#include <vector>

#include "core/check.h"
#include "core/parallel.h"
#include "layers/scratch.h"
#include "core/gpu.h"
#include "kernels/lrn.h"

namespace towers {

Shape Lrn::infer(const Shape& in) {
  TOWERS_CHECK(in.size() == 3, "{}: lrn needs (C, H, W), got {}", name(), to_string(in));
  return in;
}

void Lrn::forward(const ForwardArgs& a) const {
  const int64_t c = in_shape()[0], hw = in_shape()[1] * in_shape()[2], sz = c * hw;
  for_chunks(a.n, 4, [&](int64_t, int64_t b0, int64_t b1) {
    // In evaluation nothing is saved: the scale goes to per-thread scratch.
    float* scale = a.training ? a.saved + b0 * sz : thread_scratch(ScratchSlot::Extra, (b1 - b0) * sz);
    kernels::cpu::lrn_forward(p_, b1 - b0, c, hw, a.x + b0 * sz, a.y + b0 * sz, scale);
  });
}

void Lrn::backward(const BackwardArgs& a) const {
  if (a.dx == nullptr) return;
  const int64_t c = in_shape()[0], hw = in_shape()[1] * in_shape()[2], sz = c * hw;
  for_chunks(a.n, 4, [&](int64_t, int64_t b0, int64_t b1) {
    kernels::cpu::lrn_backward(p_, b1 - b0, c, hw, a.x + b0 * sz, a.y + b0 * sz,
                               a.saved + b0 * sz, a.dy + b0 * sz, a.dx + b0 * sz);
  });
}

#if TOWERS_HAVE_CUDA
// ---- the GPU twin ----------------------------------------------------------------------------
namespace kc = kernels::cuda;

int64_t Lrn::gpu_scratch(int64_t n) const { return n * numel(in_shape()); }

void Lrn::forward_gpu(const GpuExec& e, const ForwardArgs& a) const {
  const int64_t c = in_shape()[0], hw = in_shape()[1] * in_shape()[2];
  float* scale = a.training ? a.saved : gpu_scratch_at(e, 0, a.n * c * hw, name());
  kc::lrn_forward(e.stream, p_, a.n, c, hw, a.x, a.y, scale);
}

void Lrn::backward_gpu(const GpuExec& e, const BackwardArgs& a) const {
  if (a.dx == nullptr) return;
  const int64_t c = in_shape()[0], hw = in_shape()[1] * in_shape()[2];
  kc::lrn_backward(e.stream, p_, a.n, c, hw, a.x, a.y, a.saved, a.dy, a.dx);
}
#endif  // TOWERS_HAVE_CUDA

}  // namespace towers
