// cuda::gemm (cuBLAS) against a double-precision reference and the CPU twin (OpenBLAS), for all
// four transpose combinations, padded leading dimensions, and the products the cifar10 net runs
// (conv forward, conv weight and data gradients, dense layers). Skips, with the reason, where
// no CUDA device is usable.
//
// Error measure: a gemm entry is a sum of k products that may cancel to near zero, so its own
// magnitude is no scale for rounding error. Each entry's error is divided by its condition
// scale |alpha| sum_p |op(A)_ip op(B)_pj| + |beta| |C_ij|: FP32 accumulation is off by a few
// unit roundoffs (6e-8) of that scale, whatever k and the summation order.
#include <algorithm>
#include <climits>
#include <cmath>
#include <string>
#include <vector>

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "core/check.h"
#include "core/rng.h"
#include "gpu_test_util.h"  // TOWERS_SKIP_WITHOUT_GPU, DeviceArray, random_floats
#include "kernels/gemm.h"

namespace towers {
namespace {

using gputest::DeviceArray;
using gputest::random_floats;

// A cuBLAS handle on a fresh stream; the math mode is cuBLAS's default (FP32) unless set.
class Cublas {
 public:
  Cublas() {
    CUDA_CHECK(cudaStreamCreate(&stream_));
    check(cublasCreate(&h_), "cublasCreate");
    check(cublasSetStream(h_, stream_), "cublasSetStream");
  }
  Cublas(const Cublas&) = delete;
  Cublas& operator=(const Cublas&) = delete;
  ~Cublas() {
    cublasDestroy(h_);
    cudaStreamDestroy(stream_);
  }
  cublasHandle_t get() const { return h_; }
  void set_math_mode(cublasMath_t mode) { check(cublasSetMathMode(h_, mode), "cublasSetMathMode"); }

 private:
  static void check(cublasStatus_t st, const char* call) {
    if (st != CUBLAS_STATUS_SUCCESS) TOWERS_FAIL("{} failed: {}", call, cublasGetStatusString(st));
  }
  cudaStream_t stream_ = nullptr;
  cublasHandle_t h_ = nullptr;
};

struct GemmCase {
  bool trans_a, trans_b;
  int64_t m, n, k;
  int64_t pad = 0;  // added to every leading dimension
  float alpha = 1.0f, beta = 0.0f;
};

std::string describe(const GemmCase& c) {
  return fmt::format("trans_a={} trans_b={} m={} n={} k={} pad={} alpha={} beta={}", c.trans_a,
                     c.trans_b, c.m, c.n, c.k, c.pad, c.alpha, c.beta);
}

struct GemmErrors {
  double gpu_vs_exact = 0.0;  // cuda::gemm against the double reference
  double gpu_vs_cpu = 0.0;    // cuda::gemm against cpu::gemm
  double cpu_vs_exact = 0.0;  // cpu::gemm against the double reference (a check of the check)
  int64_t checked = 0;        // entries compared
};

// Runs one case on both twins and measures the scaled errors (see the top of the file). The
// double reference is computed for every entry of small products and for 4096 random entries
// of large ones.
GemmErrors run_case(const Cublas& blas, const GemmCase& c, uint64_t seed) {
  const int64_t a_rows = c.trans_a ? c.k : c.m, a_cols = c.trans_a ? c.m : c.k;
  const int64_t b_rows = c.trans_b ? c.n : c.k, b_cols = c.trans_b ? c.k : c.n;
  const int64_t lda = a_cols + c.pad, ldb = b_cols + c.pad, ldc = c.n + c.pad;
  const std::vector<float> a = random_floats(a_rows * lda, seed);
  const std::vector<float> b = random_floats(b_rows * ldb, seed + 1);
  const std::vector<float> c0 = random_floats(c.m * ldc, seed + 2);

  std::vector<float> cpu = c0;
  kernels::cpu::gemm(c.trans_a, c.trans_b, c.m, c.n, c.k, c.alpha, a.data(), lda, b.data(), ldb,
                     c.beta, cpu.data(), ldc);
  DeviceArray<float> a_d(a), b_d(b), c_d(c0);
  kernels::cuda::gemm(blas.get(), c.trans_a, c.trans_b, c.m, c.n, c.k, c.alpha, a_d.get(), lda,
                      b_d.get(), ldb, c.beta, c_d.get(), ldc);
  const std::vector<float> gpu = c_d.download();

  auto op_a = [&](int64_t i, int64_t p) { return c.trans_a ? a[p * lda + i] : a[i * lda + p]; };
  auto op_b = [&](int64_t p, int64_t j) { return c.trans_b ? b[j * ldb + p] : b[p * ldb + j]; };
  GemmErrors e;
  auto check_entry = [&](int64_t i, int64_t j) {
    double sum = 0.0, scale = 0.0;
    for (int64_t p = 0; p < c.k; ++p) {
      const double t = static_cast<double>(op_a(i, p)) * op_b(p, j);
      sum += t, scale += std::fabs(t);
    }
    const double c_ij = c0[i * ldc + j];
    const double exact = c.alpha * sum + c.beta * c_ij;
    scale = std::fabs(c.alpha) * scale + std::fabs(c.beta) * std::fabs(c_ij);
    scale = std::max(scale, 1e-30);
    const double g = gpu[i * ldc + j], h = cpu[i * ldc + j];
    e.gpu_vs_exact = std::max(e.gpu_vs_exact, std::fabs(g - exact) / scale);
    e.cpu_vs_exact = std::max(e.cpu_vs_exact, std::fabs(h - exact) / scale);
    e.gpu_vs_cpu = std::max(e.gpu_vs_cpu, std::fabs(g - h) / scale);
    ++e.checked;
  };
  if (c.m * c.n <= (1 << 16)) {
    for (int64_t i = 0; i < c.m; ++i)
      for (int64_t j = 0; j < c.n; ++j) check_entry(i, j);
  } else {
    Rng rng(seed + 3);
    for (int s = 0; s < 4096; ++s) check_entry(rng.below(c.m), rng.below(c.n));
  }
  // The padding of C (columns n..ldc) is never written.
  for (int64_t i = 0; i < c.m; ++i)
    for (int64_t j = c.n; j < ldc; ++j)
      EXPECT_EQ(gpu[i * ldc + j], c0[i * ldc + j])
          << "padding written at (" << i << ", " << j << ")";
  return e;
}

// The products of the cifar10 net (src/layers/conv2d.cpp, dense.cpp) over a batch of `batch`
// images, written as single gemms: conv1 forward 64 x (batch*576) x 75, conv2 weight gradient
// 64 x 1600 x (batch*144) (the long-k case), conv2 data gradient 1600 x (batch*144) x 64, local3
// forward and weight gradient.
std::vector<GemmCase> cifar10_cases(int64_t batch) {
  return {
      {false, false, 64, batch * 576, 75},   // conv1: W (64, 75) x cols (75, batch*576)
      {false, true, 64, 75, batch * 576},    // conv1 dW: dY (64, P) x cols^T (P, 75), k = 73,728
      {false, true, 64, 1600, batch * 144},  // conv2 dW: dY (64, P) x cols^T (P, 1600)
      {true, false, 1600, batch * 144, 64},  // conv2 dcols: W^T (1600, 64) x dY (64, P)
      {false, true, batch, 384, 2304},       // local3 forward: x (B, 2304) x W^T
      {true, false, 384, 2304, batch},       // local3 dW: dY^T (384, B) x x (B, 2304)
  };
}

TEST(GemmGpu, AllTransposesMatchCpuTwinAndExactFp32) {
  TOWERS_SKIP_WITHOUT_GPU();
  Cublas blas;
  uint64_t seed = 1;
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (GemmCase c : {GemmCase{ta, tb, 37, 53, 29}, GemmCase{ta, tb, 1, 300, 7},
                         GemmCase{ta, tb, 130, 3, 257}}) {
        c.pad = 5, c.alpha = 0.75f, c.beta = -0.5f;
        SCOPED_TRACE(describe(c));
        const GemmErrors e = run_case(blas, c, seed += 10);
        EXPECT_LT(e.gpu_vs_exact, 1e-5);
        EXPECT_LT(e.gpu_vs_cpu, 1e-5);
        EXPECT_LT(e.cpu_vs_exact, 1e-5);
        EXPECT_EQ(e.checked, c.m * c.n);
      }
}

TEST(GemmGpu, Cifar10ProductsMatchInFp32) {
  TOWERS_SKIP_WITHOUT_GPU();
  Cublas blas;
  uint64_t seed = 500;
  for (const GemmCase& c : cifar10_cases(128)) {
    SCOPED_TRACE(describe(c));
    const GemmErrors e = run_case(blas, c, seed += 10);
    // A dot product of k random-sign terms accumulated in float is off by about
    // sqrt(k) * 2^-24 of its scale (the probabilistic bound of Higham and Mary; the worst case
    // is k * 2^-24); 4x that, and never below 1e-5. For k = 73,728 (conv1's weight gradient)
    // that is 6.5e-5, where a one-at-a-time accumulation typically lands near 1.6e-5.
    const double tol = std::max(1e-5, 4.0 * std::sqrt(static_cast<double>(c.k)) * 0x1p-24);
    EXPECT_LT(e.gpu_vs_exact, tol);
    EXPECT_LT(e.gpu_vs_cpu, tol);
    EXPECT_LT(e.cpu_vs_exact, tol);
  }
}

// TF32 (--tf32: CUBLAS_TF32_TENSOR_OP_MATH) rounds each input to 10 mantissa bits, a unit
// roundoff of 2^-11 = 4.9e-4, so a product is off by up to ~1e-3 of its magnitude and an entry
// by up to ~1e-3 of its condition scale (if inputs are truncated rather than rounded, ~2e-3).
// The tolerance is 1e-2.
TEST(GemmGpu, Cifar10ProductsMatchInTf32WithinItsPrecision) {
  TOWERS_SKIP_WITHOUT_GPU();
  if (const std::string why = gputest::no_tf32_reason(); !why.empty()) GTEST_SKIP() << why;
  Cublas blas;
  blas.set_math_mode(CUBLAS_TF32_TENSOR_OP_MATH);
  uint64_t seed = 900;
  double worst = 0.0;
  for (const GemmCase& c : cifar10_cases(128)) {
    SCOPED_TRACE(describe(c));
    const GemmErrors e = run_case(blas, c, seed += 10);
    EXPECT_LT(e.gpu_vs_exact, 1e-2);
    worst = std::max(worst, e.gpu_vs_exact);
  }
  // FP32 stays below 1e-5 on these products (the test above): an error this small means the
  // math mode was not in effect and the test would prove nothing.
  EXPECT_GT(worst, 1e-5) << "TF32 was not in effect";
}

TEST(GemmGpu, CublasFailureIsAnErrorNamingTheCall) {
  TOWERS_SKIP_WITHOUT_GPU();
  Cublas blas;
  DeviceArray<float> a(64), b(64), c(64);
  // lda = 1 < k = 4 for a row-major A (2, 4): cuBLAS rejects the leading dimension (and prints
  // "** On entry to SGEMM parameter number 10 had an illegal value" to stderr, as BLAS does).
  try {
    kernels::cuda::gemm(blas.get(), false, false, 2, 4, 4, 1.0f, a.get(), 1, b.get(), 4, 0.0f,
                        c.get(), 4);
    FAIL() << "no error for lda < k";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cublasSgemm"), std::string::npos) << e.what();
  }
}

// Host-side checks only (no cuBLAS call is reached): they run wherever CUDA is built.
TEST(GemmGpu, SizesBeyondIntAreABug) {
  const int64_t big = int64_t{INT_MAX} + 1;
  EXPECT_THROW(kernels::cuda::gemm(nullptr, false, false, 2, 2, big, 1.0f, nullptr, big, nullptr, 2,
                                   0.0f, nullptr, 2),
               InternalError);
  EXPECT_THROW(kernels::cuda::gemm(nullptr, false, false, big, 2, 2, 1.0f, nullptr, 2, nullptr, 2,
                                   0.0f, nullptr, 2),
               InternalError);
  EXPECT_THROW(kernels::cuda::gemm(nullptr, false, false, 2, 2, 2, 1.0f, nullptr, 2, nullptr, 2,
                                   0.0f, nullptr, big),
               InternalError);
}

TEST(GemmGpu, EmptyProductDoesNothing) {
  EXPECT_NO_THROW(kernels::cuda::gemm(nullptr, false, false, 0, 5, 5, 1.0f, nullptr, 5, nullptr, 5,
                                      0.0f, nullptr, 5));
}

}  // namespace
}  // namespace towers
