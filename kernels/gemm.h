// gemm.h — C = alpha * op(A) * op(B) + beta * C, row-major, float32.
// CPU: OpenBLAS sgemm, called single-threaded (towers parallelises across images with oneTBB).
#pragma once

#include <cstdint>

#include "kernels/hd.h"

namespace towers::kernels {

namespace cpu {

// op(A) is (m, k), op(B) is (k, n), C is (m, n); lda/ldb/ldc are row strides.
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
          const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
          int64_t ldc);

// OpenBLAS threads are turned off once per process: oneTBB owns all threads (DESIGN.md, 2).
void gemm_init_single_threaded();

}  // namespace cpu

namespace cuda {
// The row-major twin of cpu::gemm through cuBLAS, on the handle's stream. TF32 is the
// handle's math mode (CudaDevice sets it from --tf32).
void gemm(cublasContext* h, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
          float alpha, const float* a, int64_t lda, const float* b, int64_t ldb, float beta,
          float* c, int64_t ldc);

// cuBLAS is column-major. A row-major C (m, n) is a column-major C^T (n, m) with the same
// stride, and C^T = op(B)^T op(A)^T: so the call swaps A and B, and m and n. This is that
// mapping, kept separate so that the CPU tests can check it against cpu::gemm.
struct ColMajorGemm {
  bool trans_a = false, trans_b = false;  // cuBLAS's transa, transb
  int64_t m = 0, n = 0, k = 0;
  const float* a = nullptr;
  int64_t lda = 0;
  const float* b = nullptr;
  int64_t ldb = 0;
  float* c = nullptr;
  int64_t ldc = 0;
};
ColMajorGemm row_major_as_col_major(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                                    const float* a, int64_t lda, const float* b, int64_t ldb,
                                    float* c, int64_t ldc);

// The mapped call's sizes and strides as the ints cuBLAS takes; throws naming the caller's
// argument (m, n, k, lda, ldb or ldc) that does not fit.
struct CublasInts {
  int m = 0, n = 0, k = 0, lda = 0, ldb = 0, ldc = 0;
};
CublasInts cublas_ints(const ColMajorGemm& g);

// The row-major call as the column-major sgemm cuBLAS gets (the mapping and its ints), and
// the error of a failed call: what cuda::gemm and the test emulator's twin both do.
struct SgemmCall {
  ColMajorGemm g;
  CublasInts x;
};
SgemmCall sgemm_call(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const float* a,
                     int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc);
[[noreturn]] void sgemm_failed(const SgemmCall& call, const char* status);
}  // namespace cuda

}  // namespace towers::kernels
