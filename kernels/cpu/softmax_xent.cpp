#include "kernels/softmax_xent.h"

#include <cmath>

namespace towers::kernels::cpu {

XentResult softmax_xent(int64_t n, int64_t k, const float* logits, const int32_t* labels,
                        float grad_scale, float* dlogits) {
  XentResult r;
  for (int64_t b = 0; b < n; ++b) {
    const float* z = logits + b * k;
    int64_t arg = 0;
    float mx = z[0];
    for (int64_t j = 1; j < k; ++j)
      if (z[j] > mx) mx = z[j], arg = j;
    double sum = 0.0;
    for (int64_t j = 0; j < k; ++j) sum += std::exp(static_cast<double>(z[j] - mx));
    const int32_t y = labels[b];
    r.loss_sum += std::log(sum) - static_cast<double>(z[y] - mx);
    r.correct += (arg == y);
    if (dlogits != nullptr) {
      float* d = dlogits + b * k;
      for (int64_t j = 0; j < k; ++j) {
        double p = std::exp(static_cast<double>(z[j] - mx)) / sum;
        d[j] = static_cast<float>((p - (j == y ? 1.0 : 0.0)) * grad_scale);
      }
    }
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

}  // namespace towers::kernels
