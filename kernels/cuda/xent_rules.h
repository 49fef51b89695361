// xent_rules.h — the per-example rule of cuda::softmax_xent (kernels/cuda/softmax_xent.cu): one
// example's loss, hit and gradient row with cpu::softmax_xent's arithmetic (float max and
// differences, double exp, log and sums). Plain C++17 with TOWERS_HD: compiled by g++ without
// CUDA headers as well as by nvcc.
#pragma once

#include <cmath>  // exp, log (host); nvcc provides the device exp and log
#include <cstdint>

#include "kernels/hd.h"

namespace towers::kernels::cuda {

// Example `row` of logits (n, k) with labels (n) in [0, k): row_loss[row] = -log softmax[label],
// row_correct[row] = (first argmax == label), and, when dlogits is not null, its row
// (softmax - onehot) * grad_scale.
TOWERS_HD void softmax_xent_row(int64_t k, const float* logits, const int32_t* labels,
                                float grad_scale, float* dlogits, double* row_loss,
                                int32_t* row_correct, int64_t row) {
  const float* z = logits + row * k;
  int64_t arg = 0;
  float mx = z[0];
  for (int64_t j = 1; j < k; ++j)
    if (z[j] > mx) mx = z[j], arg = j;
  double sum = 0.0;
  for (int64_t j = 0; j < k; ++j) sum += exp(static_cast<double>(z[j] - mx));
  const int32_t y = labels[row];
  row_loss[row] = log(sum) - static_cast<double>(z[y] - mx);
  row_correct[row] = (arg == y);
  if (dlogits != nullptr) {
    float* d = dlogits + row * k;
    for (int64_t j = 0; j < k; ++j) {
      double p = exp(static_cast<double>(z[j] - mx)) / sum;
      d[j] = static_cast<float>((p - (j == y ? 1.0 : 0.0)) * grad_scale);
    }
  }
}

}  // namespace towers::kernels::cuda
