// xent_rules.h — the per-example rule of cuda::softmax_xent (kernels/cuda/softmax_xent.cu): one
// example's loss, hit and gradient row with cpu::softmax_xent's arithmetic (float max and
// differences, double exp, log and sums). Plain C++17 with TOWERS_HD: compiled by g++ without
// CUDA headers as well as by nvcc.
#pragma once

#include <cmath>  // exp, log (host); nvcc provides the device exp and log
#include <cstdint>

#include "kernels/hd.h"

namespace towers::kernels::cuda {

// Example `row` of logits (n, k) with labels (n) in [0, k), against the target q = (1 - eps)
// onehot + eps / k (label smoothing eps; 0: the one-hot label): row_loss[row] = -sum q log
// softmax, row_correct[row] = (first argmax == label), and, when dlogits is not null, its row
// (softmax - q) * grad_scale. eps = 0 gives the plain cross-entropy's bits.
TOWERS_HD void softmax_xent_row(int64_t k, const float* logits, const int32_t* labels,
                                float smoothing, float grad_scale, float* dlogits,
                                double* row_loss, int32_t* row_correct, int64_t row) {
  const float* z = logits + row * k;
  int64_t arg = 0;
  float mx = z[0];
  for (int64_t j = 1; j < k; ++j)
    if (z[j] > mx) mx = z[j], arg = j;
  double sum = 0.0;
  for (int64_t j = 0; j < k; ++j) sum += exp(static_cast<double>(z[j] - mx));
  const int32_t y = labels[row];
  // -sum_j q_j log p_j = log(sum) - sum_j q_j (z_j - mx), as sum_j q_j = 1.
  const double eps = smoothing, off = eps / static_cast<double>(k);
  double zsum = 0.0;
  if (smoothing != 0.0f)
    for (int64_t j = 0; j < k; ++j) zsum += static_cast<double>(z[j] - mx);
  row_loss[row] = log(sum) - (1.0 - eps) * static_cast<double>(z[y] - mx) - off * zsum;
  row_correct[row] = (arg == y);
  if (dlogits != nullptr) {
    float* d = dlogits + row * k;
    for (int64_t j = 0; j < k; ++j) {
      double p = exp(static_cast<double>(z[j] - mx)) / sum;
      d[j] = static_cast<float>((p - ((j == y ? 1.0 - eps : 0.0) + off)) * grad_scale);
    }
  }
}

}  // namespace towers::kernels::cuda
