// softmax_xent.h — mean softmax cross-entropy over a batch, with its gradient and accuracy.
#pragma once

#include <cstdint>

namespace towers::kernels::cpu {

struct XentResult {
  double loss_sum = 0.0;  // sum over the batch of -log softmax(logits)[label]
  int64_t correct = 0;    // argmax(logits) == label
};

// logits (n, k), labels (n) in [0, k). dlogits (n, k) = (softmax - onehot) * grad_scale
// (grad_scale = 1/global_batch for a mean loss); dlogits may be null for evaluation.
XentResult softmax_xent(int64_t n, int64_t k, const float* logits, const int32_t* labels,
                        float grad_scale, float* dlogits);

}  // namespace towers::kernels::cpu
