#include "layers/loss.h"

#include "core/check.h"
#include "kernels/softmax_xent.h"
#include "core/gpu.h"

namespace towers {

void Loss::forward_gpu(const GpuExec&, const LossArgs&) const {
  TOWERS_FAIL("loss {} has no GPU path in this build", kind());
}

LossSums SoftmaxCrossEntropy::forward(const LossArgs& a) const {
  const auto r = kernels::cpu::softmax_xent(a.n, a.classes, a.logits, a.labels, smoothing(a),
                                            a.grad_scale, a.dlogits);
  return {r.loss_sum, r.correct};
}

#if TOWERS_HAVE_CUDA
// ---- the GPU twin ----------------------------------------------------------------------------
namespace kc = kernels::cuda;

void SoftmaxCrossEntropy::forward_gpu(const GpuExec& e, const LossArgs& a) const {
  kc::softmax_xent(e.stream, a.n, a.classes, a.logits, a.labels, smoothing(a), a.grad_scale,
                   a.dlogits, a.row_loss, a.row_correct);
}
#endif  // TOWERS_HAVE_CUDA

}  // namespace towers
