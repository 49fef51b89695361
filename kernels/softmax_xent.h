// softmax_xent.h — mean softmax cross-entropy over a batch, with its gradient and accuracy.
#pragma once

#include <cstdint>

#include "kernels/hd.h"

namespace towers::kernels {

namespace cpu {

struct XentResult {
  double loss_sum = 0.0;  // sum over the batch of -log softmax(logits)[label]
  int64_t correct = 0;    // argmax(logits) == label
};

// logits (n, k), labels (n) in [0, k). dlogits (n, k) = (softmax - q) * grad_scale with the
// target q = (1 - smoothing) onehot + smoothing / k (grad_scale = 1/global_batch for a mean
// loss); dlogits may be null for evaluation.
XentResult softmax_xent(int64_t n, int64_t k, const float* logits, const int32_t* labels,
                        float smoothing, float grad_scale, float* dlogits);

}  // namespace cpu

namespace cuda {
// One thread per example, the CPU twin's arithmetic (double). The batch sums are left to the
// caller, per example: row_loss (n doubles) and row_correct (n int32), all device memory;
// sum_rows adds them on the host in the CPU twin's order.
void softmax_xent(CUstream_st* s, int64_t n, int64_t k, const float* logits,
                  const int32_t* labels, float smoothing, float grad_scale, float* dlogits,
                  double* row_loss, int32_t* row_correct);
// The launcher's argument checks (host code; the emulator runs the launcher itself).
void check_softmax_xent_args(int64_t k, const double* row_loss, const int32_t* row_correct);
}  // namespace cuda

// Host side: the batch result from per-example losses and hits (host memory).
cpu::XentResult sum_rows(int64_t n, const double* row_loss, const int32_t* row_correct);

}  // namespace towers::kernels
