#include "kernels/gemm.h"

#include <cblas.h>  // OpenBLAS: cblas_sgemm, openblas_set_num_threads

#include <algorithm>

namespace towers::kernels::cpu {

void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
          const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
          int64_t ldc) {
  // beta = 0 without AVX-512: C is cleared here (a vector fill) and OpenBLAS accumulates into
  // it (beta = 1). OpenBLAS 0.3.21's own clearing is a scalar loop there (sgemm_beta), which
  // cost 5% of a cifar10 step on a 2-core AVX2 machine; 0 + x is x (-0 products aside, which
  // OpenBLAS's accumulating kernels also give as +0), so the bits are the same. With AVX-512
  // its clearing is vectorized, and small row-major products with alpha = 1 and beta = 0 go
  // to its sgemm_direct kernel, which sums in an order of its own: there the call passes
  // through unchanged, so each kind of machine keeps the bits it had.
  static const bool blas_clears_fast = __builtin_cpu_supports("avx512f");
  if (beta == 0.0f && k > 0 && !blas_clears_fast) {
    if (ldc == n) {
      std::fill(c, c + m * n, 0.0f);
    } else {
      for (int64_t i = 0; i < m; ++i) std::fill(c + i * ldc, c + i * ldc + n, 0.0f);
    }
    beta = 1.0f;
  }
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, static_cast<int>(m), static_cast<int>(n),
              static_cast<int>(k), alpha, a, static_cast<int>(lda), b, static_cast<int>(ldb), beta,
              c, static_cast<int>(ldc));
}

void gemm_init_single_threaded() { openblas_set_num_threads(1); }

}  // namespace towers::kernels::cpu
