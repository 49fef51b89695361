#include "kernels/cuda/launch.cuh"
#include "kernels/softmax_xent.h"

namespace towers::kernels::cuda {

// Thread b handles example b with cpu::softmax_xent's arithmetic (float max and differences,
// double exp/log/sums), and leaves the loss and the hit of its row for sum_rows.
__global__ void softmax_xent_kernel(int64_t n, int64_t k, const float* __restrict__ logits,
                                    const int32_t* __restrict__ labels, float grad_scale,
                                    float* __restrict__ dlogits, double* __restrict__ row_loss,
                                    int32_t* __restrict__ row_correct) {
  TOWERS_GRID_STRIDE(b, n) {
    const float* z = logits + b * k;
    int64_t arg = 0;
    float mx = z[0];
    for (int64_t j = 1; j < k; ++j)
      if (z[j] > mx) mx = z[j], arg = j;
    double sum = 0.0;
    for (int64_t j = 0; j < k; ++j) sum += exp(static_cast<double>(z[j] - mx));
    const int32_t y = labels[b];
    row_loss[b] = log(sum) - static_cast<double>(z[y] - mx);
    row_correct[b] = (arg == y);
    if (dlogits != nullptr) {
      float* d = dlogits + b * k;
      for (int64_t j = 0; j < k; ++j) {
        double p = exp(static_cast<double>(z[j] - mx)) / sum;
        d[j] = static_cast<float>((p - (j == y ? 1.0 : 0.0)) * grad_scale);
      }
    }
  }
}

void softmax_xent(CUstream_st* s, int64_t n, int64_t k, const float* logits, const int32_t* labels,
                  float grad_scale, float* dlogits, double* row_loss, int32_t* row_correct) {
  if (n == 0) return;
  TOWERS_CHECK(k > 0, "softmax_xent: k = {}, need at least one class", k);
  TOWERS_CHECK(row_loss != nullptr && row_correct != nullptr,
               "softmax_xent: row_loss and row_correct are required");
  softmax_xent_kernel<<<grid_for(n), kBlock, 0, s>>>(n, k, logits, labels, grad_scale, dlogits,
                                                     row_loss, row_correct);
  CUDA_CHECK_LAUNCH();
}

}  // namespace towers::kernels::cuda
