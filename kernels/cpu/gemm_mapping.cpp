// The row-major to column-major mapping behind cuda::gemm. Host code without CUDA, built in every
// configuration so that the CPU tests check it against cpu::gemm (tests/rules_math_test.cpp).
#include "kernels/gemm.h"

#include <climits>

#include "core/check.h"

namespace towers::kernels::cuda {

// Row-major X (r, c) with row stride ld is, read column-major, X^T (c, r) with the same ld.
// So the row-major C (m, n) is the column-major C^T (n, m), and
//   C^T = (op(A) op(B))^T = op(B)^T op(A)^T,
// where op(B)^T is the column-major reading of B's storage with B's own transpose flag (the
// column-major reading is already the transpose), and likewise for A. cuBLAS computes
// C^T = op'(B) op'(A) with m' = n, n' = m, the same k, and every stride unchanged.
ColMajorGemm row_major_as_col_major(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                                    const float* a, int64_t lda, const float* b, int64_t ldb,
                                    float* c, int64_t ldc) {
  ColMajorGemm g;
  g.trans_a = trans_b;
  g.trans_b = trans_a;
  g.m = n;
  g.n = m;
  g.k = k;
  g.a = b;
  g.lda = ldb;
  g.b = a;
  g.ldb = lda;
  g.c = c;
  g.ldc = ldc;
  return g;
}

namespace {
int as_int(int64_t v, const char* name) {
  TOWERS_CHECK(v >= 0 && v <= INT_MAX, "cuda::gemm: {} = {} does not fit cuBLAS's int", name, v);
  return static_cast<int>(v);
}
}  // namespace

CublasInts cublas_ints(const ColMajorGemm& g) {
  // The names are the caller's: the mapping swapped m and n, and A and B.
  CublasInts r;
  r.m = as_int(g.m, "n");
  r.n = as_int(g.n, "m");
  r.k = as_int(g.k, "k");
  r.lda = as_int(g.lda, "ldb");
  r.ldb = as_int(g.ldb, "lda");
  r.ldc = as_int(g.ldc, "ldc");
  return r;
}

SgemmCall sgemm_call(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const float* a,
                     int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc) {
  SgemmCall call;
  call.g = row_major_as_col_major(trans_a, trans_b, m, n, k, a, lda, b, ldb, c, ldc);
  call.x = cublas_ints(call.g);
  return call;
}

void sgemm_failed(const SgemmCall& call, const char* status) {
  TOWERS_SYSTEM_FAIL("cuBLAS call cublasSgemm(m={}, n={}, k={}, transa={}, transb={}) failed: {}",
                     call.x.m, call.x.n, call.x.k, call.g.trans_a, call.g.trans_b, status);
}

}  // namespace towers::kernels::cuda
