
#include <cublas_v2.h>  // cublasSgemm, cublasGetStatusString

#include "core/check.h"
#include "kernels/gemm.h"

namespace towers::kernels::cuda {

void gemm(cublasContext* h, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
          float alpha, const float* a, int64_t lda, const float* b, int64_t ldb, float beta,
          float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  const ColMajorGemm g = row_major_as_col_major(trans_a, trans_b, m, n, k, a, lda, b, ldb, c, ldc);
  const CublasInts x = cublas_ints(g);
  const int gm = x.m, gn = x.n, gk = x.k, glda = x.lda, gldb = x.ldb, gldc = x.ldc;
  // alpha and beta are host values: the handle's pointer mode is CUBLAS_POINTER_MODE_HOST.
  const cublasStatus_t st =
      cublasSgemm(h, g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                  gm, gn, gk, &alpha, g.a, glda, g.b, gldb, &beta, g.c, gldc);
  if (st != CUBLAS_STATUS_SUCCESS)
    TOWERS_SYSTEM_FAIL("cuBLAS call cublasSgemm(m={}, n={}, k={}, transa={}, transb={}) failed: {}", gm,
                gn, gk, g.trans_a, g.trans_b, cublasGetStatusString(st));
}

}  // namespace towers::kernels::cuda
