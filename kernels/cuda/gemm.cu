
#include <cublas_v2.h>  // cublasSgemm, cublasGetStatusString

#include "core/check.h"
#include "kernels/gemm.h"

namespace towers::kernels::cuda {

void gemm(cublasContext* h, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
          float alpha, const float* a, int64_t lda, const float* b, int64_t ldb, float beta,
          float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  const SgemmCall call = sgemm_call(trans_a, trans_b, m, n, k, a, lda, b, ldb, c, ldc);
  const ColMajorGemm& g = call.g;
  const CublasInts& x = call.x;
  // alpha and beta are host values: the handle's pointer mode is CUBLAS_POINTER_MODE_HOST.
  const cublasStatus_t st =
      cublasSgemm(h, g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                  x.m, x.n, x.k, &alpha, g.a, x.lda, g.b, x.ldb, &beta, g.c, x.ldc);
  if (st != CUBLAS_STATUS_SUCCESS) sgemm_failed(call, cublasGetStatusString(st));
}

}  // namespace towers::kernels::cuda
