// gemm.h — C = alpha * op(A) * op(B) + beta * C, row-major, float32.
// CPU: OpenBLAS sgemm, called single-threaded (towers parallelises across images with oneTBB).
#pragma once

#include <cstdint>

namespace towers::kernels::cpu {

// op(A) is (m, k), op(B) is (k, n), C is (m, n); lda/ldb/ldc are row strides.
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
          const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
          int64_t ldc);

// OpenBLAS threads are turned off once per process: oneTBB owns all threads (DESIGN.md, 2).
void gemm_init_single_threaded();

}  // namespace towers::kernels::cpu
