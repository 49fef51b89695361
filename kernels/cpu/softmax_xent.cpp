#include "kernels/softmax_xent.h"

#include "core/check.h"

#include "kernels/cuda/xent_rules.h"

namespace towers::kernels::cpu {

// One example at a time through the rule the CUDA kernel runs (kernels/cuda/xent_rules.h).
XentResult softmax_xent(int64_t n, int64_t k, const float* logits, const int32_t* labels,
                        float smoothing, float grad_scale, float* dlogits) {
  XentResult r;
  for (int64_t b = 0; b < n; ++b) {
    double loss = 0.0;
    int32_t hit = 0;
    cuda::softmax_xent_row(k, logits + b * k, labels + b, smoothing, grad_scale,
                           dlogits != nullptr ? dlogits + b * k : nullptr, &loss, &hit, 0);
    r.loss_sum += loss;
    r.correct += hit;
  }
  return r;
}

}  // namespace towers::kernels::cpu

namespace towers::kernels {

// Adds in example order, as cpu::softmax_xent does, so that per-example losses computed with the
// CPU's arithmetic give the CPU's loss_sum bit for bit.
cpu::XentResult sum_rows(int64_t n, const double* row_loss, const int32_t* row_correct) {
  cpu::XentResult r;
  for (int64_t b = 0; b < n; ++b) {
    r.loss_sum += row_loss[b];
    r.correct += row_correct[b];
  }
  return r;
}

void cuda::check_softmax_xent_args(int64_t k, const double* row_loss, const int32_t* row_correct) {
  TOWERS_CHECK(k > 0, "softmax_xent: k = {}, need at least one class", k);
  TOWERS_CHECK(row_loss != nullptr && row_correct != nullptr,
               "softmax_xent: row_loss and row_correct are required");
}

}  // namespace towers::kernels
