// softmax_xent.cu — softmax cross-entropy on the GPU, one thread per example.
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/xent_rules.h"
#include "kernels/softmax_xent.h"

namespace towers::kernels::cuda {

namespace {

// Thread b handles example b with cpu::softmax_xent's arithmetic (kernels/cuda/xent_rules.h),
// and leaves the loss and the hit of its row for sum_rows.
struct SoftmaxXentRow {
  int64_t k;
  const float* logits;
  const int32_t* labels;
  float smoothing, grad_scale;
  float* dlogits;
  double* row_loss;
  int32_t* row_correct;
  TOWERS_HD void operator()(int64_t b) const {
    body(k, logits, labels, smoothing, grad_scale, dlogits, row_loss, row_correct, b);
  }
  static TOWERS_HD void body(int64_t k, const float* __restrict__ logits,
                             const int32_t* __restrict__ labels, float smoothing, float grad_scale,
                             float* __restrict__ dlogits, double* __restrict__ row_loss,
                             int32_t* __restrict__ row_correct, int64_t b) {
    softmax_xent_row(k, logits, labels, smoothing, grad_scale, dlogits, row_loss, row_correct, b);
  }
};

}  // namespace

void softmax_xent(CUstream_st* s, int64_t n, int64_t k, const float* logits, const int32_t* labels,
                  float smoothing, float grad_scale, float* dlogits, double* row_loss,
                  int32_t* row_correct) {
  if (n == 0) return;
  check_softmax_xent_args(k, row_loss, row_correct);
  for_each_index(s, n, SoftmaxXentRow{k, logits, labels, smoothing, grad_scale, dlogits, row_loss,
                                      row_correct});
}

}  // namespace towers::kernels::cuda
