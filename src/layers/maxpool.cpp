#include "layers/maxpool.h"

#include "core/check.h"
#include "core/parallel.h"
#include "kernels/pool.h"
#include "core/gpu.h"

namespace towers {

Shape MaxPool::infer(const Shape& in) {
  TOWERS_CHECK(in.size() == 3, "{}: maxpool needs (C, H, W), got {}", name(), to_string(in));
  // The argmax is kept as a float (kernels/pool.h): exact only below 2^24 positions per plane.
  TOWERS_CHECK(in[1] * in[2] <= (int64_t{1} << 24), "{}: a {}x{} plane is too large to pool",
               name(), in[1], in[2]);
  rows_ = kernels::make_window(in[1], kernel_, stride_, padding_);
  cols_ = kernels::make_window(in[2], kernel_, stride_, padding_);
  return {in[0], rows_.out, cols_.out};
}

void MaxPool::forward(const ForwardArgs& a) const {
  const int64_t c = in_shape()[0], h = in_shape()[1], w = in_shape()[2];
  const int64_t in_sz = c * h * w, out_sz = numel(out_shape());
  for_chunks(a.n, 4, [&](int64_t, int64_t b0, int64_t b1) {
    kernels::cpu::maxpool_forward((b1 - b0) * c, h, w, rows_, cols_, a.x + b0 * in_sz,
                                  a.y + b0 * out_sz, a.training ? a.saved + b0 * out_sz : nullptr);
  });
}

void MaxPool::backward(const BackwardArgs& a) const {
  if (a.dx == nullptr) return;
  const int64_t c = in_shape()[0], h = in_shape()[1], w = in_shape()[2];
  const int64_t in_sz = c * h * w, out_sz = numel(out_shape());
  for_chunks(a.n, 4, [&](int64_t, int64_t b0, int64_t b1) {
    kernels::cpu::maxpool_backward((b1 - b0) * c, h, w, rows_, cols_, a.saved + b0 * out_sz,
                                   a.dy + b0 * out_sz, a.dx + b0 * in_sz);
  });
}

#if TOWERS_HAVE_CUDA
// ---- the GPU twin ----------------------------------------------------------------------------
namespace kc = kernels::cuda;

int64_t MaxPool::gpu_scratch(int64_t n) const { return n * numel(out_shape()); }

void MaxPool::forward_gpu(const GpuExec& e, const ForwardArgs& a) const {
  const int64_t c = in_shape()[0], h = in_shape()[1], w = in_shape()[2];
  // Evaluation keeps no argmax; the kernel still writes one, to scratch.
  float* argmax = a.training ? a.saved : gpu_scratch_at(e, 0, a.n * numel(out_shape()), name());
  kc::maxpool_forward(e.stream, a.n * c, h, w, rows_, cols_, a.x, a.y, argmax);
}

void MaxPool::backward_gpu(const GpuExec& e, const BackwardArgs& a) const {
  if (a.dx == nullptr) return;
  const int64_t c = in_shape()[0], h = in_shape()[1], w = in_shape()[2];
  kc::maxpool_backward(e.stream, a.n * c, h, w, rows_, cols_, a.saved, a.dy, a.dx);
}
#endif  // TOWERS_HAVE_CUDA

}  // namespace towers
