#include "layers/global_avg_pool.h"

#include "core/check.h"
#include "core/gpu.h"
#include "core/parallel.h"
#include "kernels/pool.h"

namespace towers {

Shape GlobalAvgPool::infer(const Shape& in) {
  TOWERS_CHECK(in.size() == 3, "{}: global_avg_pool needs (C, H, W), got {}", name(),
               to_string(in));
  TOWERS_CHECK(in[1] * in[2] > 0, "{}: global_avg_pool of an empty {}x{} plane", name(), in[1],
               in[2]);
  return {in[0], 1, 1};
}

void GlobalAvgPool::forward(const ForwardArgs& a) const {
  const int64_t c = in_shape()[0], hw = in_shape()[1] * in_shape()[2];
  for_chunks(a.n, 4, [&](int64_t, int64_t b0, int64_t b1) {
    kernels::cpu::global_avg_pool_forward((b1 - b0) * c, hw, a.x + b0 * c * hw, a.y + b0 * c);
  });
}

void GlobalAvgPool::backward(const BackwardArgs& a) const {
  if (a.dx == nullptr) return;
  const int64_t c = in_shape()[0], hw = in_shape()[1] * in_shape()[2];
  for_chunks(a.n, 4, [&](int64_t, int64_t b0, int64_t b1) {
    kernels::cpu::global_avg_pool_backward((b1 - b0) * c, hw, a.dy + b0 * c, a.dx + b0 * c * hw);
  });
}

#if TOWERS_HAVE_CUDA
// ---- the GPU twin ----------------------------------------------------------------------------
namespace kc = kernels::cuda;

void GlobalAvgPool::forward_gpu(const GpuExec& e, const ForwardArgs& a) const {
  const int64_t c = in_shape()[0], hw = in_shape()[1] * in_shape()[2];
  kc::global_avg_pool_forward(e.stream, a.n * c, hw, a.x, a.y);
}

void GlobalAvgPool::backward_gpu(const GpuExec& e, const BackwardArgs& a) const {
  if (a.dx == nullptr) return;
  const int64_t c = in_shape()[0], hw = in_shape()[1] * in_shape()[2];
  kc::global_avg_pool_backward(e.stream, a.n * c, hw, a.dy, a.dx);
}
#endif  // TOWERS_HAVE_CUDA

}  // namespace towers
