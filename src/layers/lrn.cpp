#include "layers/lrn.h"

#include <vector>

#include "core/check.h"
#include "core/parallel.h"
#include "layers/scratch.h"

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

}  // namespace towers
