// emu_kernels.cpp — the kernels::cuda:: launchers whose kernels are not one thread per element,
// on the emulated device (emu_runtime.h): the block reductions (bias gradients, the non-finite
// check, standardize), the GEMM, and the debug kernels. Each runs the checks of its .cu launcher,
// then a host loop over the rules its CUDA kernel runs, submitted to the stream (queued, or
// recorded while the thread captures). Every closure captures by value: a recorded one runs at
// graph replay, after the launcher has returned, when only the device pointers it names are still
// valid.
//
// The element-wise launchers are not here: emu_launchers.cpp compiles their .cu files as host
// code, and their one launcher, for_each_index (kernels/cuda/launch.cuh), calls
// launch_host_loop below.
#include <algorithm>
#include <array>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <cblas.h>  // OpenBLAS: cblas_sgemm
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "core/check.h"
#include "emu_runtime.h"
#include "kernels/bias.h"
#include "kernels/cuda/augment_rules.h"
#include "kernels/cuda/bias_rules.h"
#include "kernels/cuda/launch.cuh"  // kBlock, launch_host_loop
#include "kernels/cuda/standardize_rules.h"
#include "kernels/debug.h"
#include "kernels/gemm.h"
#include "kernels/norm_rules.h"
#include "kernels/reduce.h"
#include "kernels/standardize.h"

namespace towers::kernels::cuda {

namespace {

using emu::submit;

// The block total of kBlock thread partials, as cub::BlockReduce<double, kBlock>::Sum forms it
// in the CUB that ships with CUDA 13.0 (CUB 3.0, default algorithm BLOCK_REDUCE_WARP_REDUCTIONS):
// each warp of 32 threads adds its lanes with shuffles at offsets 1, 2, 4, 8, 16, a pairwise tree
// ((t0 + t1) + (t2 + t3)) + ..., then thread 0 adds the warp totals in warp order. That order is
// read from CUB's source, not documented: another CUB may add differently, and the GPU's result
// would then differ from this one in the last bits.
double block_sum(const std::array<double, kBlock>& part) {
  constexpr int kWarp = 32;
  static_assert(kBlock % kWarp == 0, "whole warps");
  double total = 0.0;
  for (int w = 0; w < kBlock / kWarp; ++w) {
    std::array<double, kWarp> lane;
    for (int i = 0; i < kWarp; ++i) lane[i] = part[w * kWarp + i];
    for (int s = 1; s < kWarp; s *= 2)
      for (int i = 0; i + s < kWarp; i += 2 * s) lane[i] += lane[i + s];
    total = w == 0 ? lane[0] : total + lane[0];
  }
  return total;
}

int max1(int v) { return v > 1 ? v : 1; }

}  // namespace

// The one launcher of the element-wise kernels (launch.cuh), on the emulated device.
void launch_host_loop(CUstream_st* stream, std::function<void()> loop) {
  submit(stream, std::move(loop));
}

// ---- bias.cu -------------------------------------------------------------------------------

// Channel ch as its blocks compute it: for each segment kBlock thread partials
// (bias_grad_segment_partial) and the block sum (block_sum, CUB's order as far as it is
// known); with several segments, their sums added in order.
void bias_grad(CUstream_st* s, int64_t n, int64_t c, int64_t hw, const float* dy, float* db,
               bool accumulate, double* partials) {
  if (c == 0) return;  // n * hw == 0 still writes db (zeros, or leaves it when accumulating)
  const int64_t k = bias_grad_segments(c, n * hw);
  TOWERS_CHECK(k == 1 || partials != nullptr,
               "bias_grad of ({}, {}, {}) needs {} doubles of scratch", n, c, hw, c * k);
  if (k > 1) TOWERS_CHECK(emu::on_device(partials, sizeof(double) * c * k), "bias_grad partials");
  submit(s, [=] {
    std::array<double, kBlock> part;
    for (int64_t ch = 0; ch < c; ++ch) {
      double total = 0.0;
      for (int64_t j = 0; j < k; ++j) {
        int64_t lo, hi;
        bias_grad_segment<int64_t>(n * hw, k, j, lo, hi);
        for (int t = 0; t < kBlock; ++t)
          part[t] = bias_grad_segment_partial<int64_t>(c, hw, dy, ch, lo, hi, t, kBlock);
        const double sum = block_sum(part);
        if (k == 1) total = sum;
        else partials[ch * k + j] = sum, total += sum;
      }
      db[ch] = bias_grad_finish(total, accumulate ? db[ch] : 0.0f, accumulate);
    }
  });
}

// ---- gemm.cu -------------------------------------------------------------------------------

using emu::to_tf32;

// The column-major call cuda::gemm makes (row_major_as_col_major), with cuda::gemm's int checks
// and the argument checks cuBLAS makes before it runs (a null handle; a leading dimension below
// the rows of its column-major matrix), reported as cuda::gemm reports a failed cuBLAS call. The
// product is OpenBLAS's column-major sgemm on those very arguments; with the handle in TF32
// mode, on copies of A and B rounded to TF32's 10 mantissa bits (nearest, ties to even), which
// is what the tensor cores multiply (their accumulation is FP32, as here).
void gemm(cublasContext* h, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
          float alpha, const float* a, int64_t lda, const float* b, int64_t ldb, float beta,
          float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  const SgemmCall call = sgemm_call(trans_a, trans_b, m, n, k, a, lda, b, ldb, c, ldc);
  const ColMajorGemm g = call.g;
  const int gm = call.x.m, gn = call.x.n, gk = call.x.k, glda = call.x.lda, gldb = call.x.ldb,
            gldc = call.x.ldc;
  if (h == nullptr) sgemm_failed(call, "CUBLAS_STATUS_NOT_INITIALIZED");
  if (glda < max1(g.trans_a ? gk : gm) || gldb < max1(g.trans_b ? gn : gk) || gldc < max1(gm))
    sgemm_failed(call, "CUBLAS_STATUS_INVALID_VALUE");
  const bool tf32 = emu::tf32(h);
  submit(emu::stream_of(h), [=] {
    const float* ea = g.a;
    const float* eb = g.b;
    std::vector<float> ra, rb;
    if (tf32) {
      auto rounded = [](const float* p, int64_t count, std::vector<float>& out) {
        out.resize(count);
        for (int64_t i = 0; i < count; ++i) out[i] = to_tf32(p[i]);
        return out.data();
      };
      ea = rounded(g.a, int64_t{glda} * (g.trans_a ? gm : gk), ra);
      eb = rounded(g.b, int64_t{gldb} * (g.trans_b ? gk : gn), rb);
    }
    cblas_sgemm(CblasColMajor, g.trans_a ? CblasTrans : CblasNoTrans,
                g.trans_b ? CblasTrans : CblasNoTrans, gm, gn, gk, alpha, ea, glda, eb, gldb,
                beta, g.c, gldc);
  });
}

// ---- reduce.cu -----------------------------------------------------------------------------

void any_nonfinite(CUstream_st* s, int64_t n, const double* x, int32_t* flag) {
  submit(s, [=] {
    int32_t bad = 0;
    for (int64_t i = 0; i < n; ++i) bad |= !std::isfinite(x[i]);
    *flag = bad;
  });
}

// Chunk k as block k computes it: each lane by norm_lane, the lanes in order; then
// norm_finish, as the one-thread kernel runs it.
void norm_guard(CUstream_st* s, int64_t n, const float* x, const int64_t* keep, int64_t nkeep,
                double bound, double* partials, double* norm, float* scale, int32_t* flag) {
  const int64_t chunks = norm_chunks(n);
  TOWERS_CHECK(chunks < (int64_t{1} << 31), "norm_guard: {} floats are too many chunks", n);
  TOWERS_CHECK(emu::on_device(partials, sizeof(double) * chunks) &&
                   emu::on_device(norm, sizeof(double)) && emu::on_device(scale, sizeof(float)) &&
                   (nkeep == 0 || emu::on_device(keep, sizeof(int64_t) * 2 * nkeep)) &&
                   (flag == nullptr || emu::on_device(flag, sizeof(int32_t))),
               "norm_guard: its buffers must be device memory");
  submit(s, [=] {
    std::array<double, kNormLanes> lanes;
    for (int64_t k = 0; k < chunks; ++k) {
      const int64_t b = k * kNormChunk, e = std::min(n, b + kNormChunk);
      for (int l = 0; l < kNormLanes; ++l) lanes[l] = norm_lane(x, b, e, l, keep, nkeep);
      partials[k] = norm_lanes_total(lanes.data());
    }
    norm_finish(chunks, partials, bound, norm, scale, flag);
  });
}

// ---- standardize.cu ------------------------------------------------------------------------

// Image b as block b computes it: kBlock thread partials of the sum and of the sum of squares
// (standardize_partial), each joined by block_sum, then the statistics and the element rule.
// Every sum is read before any element is written, so x == y is fine, as on the GPU.
void standardize(CUstream_st* s, int64_t n, int64_t m, const float* x, float* y) {
  if (n == 0 || m == 0) return;
  submit(s, [=] {
    std::array<double, kBlock> sum, sumsq;
    for (int64_t b = 0; b < n; ++b) {
      const float* xi = x + b * m;
      float* yi = y + b * m;
      for (int t = 0; t < kBlock; ++t) standardize_partial(m, xi, t, kBlock, sum[t], sumsq[t]);
      float mean, inv;
      standardize_stats(block_sum(sum), block_sum(sumsq), m, mean, inv);
      for (int64_t i = 0; i < m; ++i) yi[i] = standardize_at(xi[i], mean, inv);
    }
  });
}

// ---- augment.cu ----------------------------------------------------------------------------

// Plane p (an example's channel) as block p computes it: kBlock thread partials of its sum
// (contrast_partial) joined by block_sum, its mean, then the element rule, in place.
void contrast(CUstream_st* s, int64_t n, int64_t channels, int64_t plane,
              const ExamplePlan* plans, float* x) {
  const int64_t planes = n * channels;
  if (planes == 0 || plane == 0) return;
  submit(s, [=] {
    std::array<double, kBlock> part;
    for (int64_t p = 0; p < planes; ++p) {
      float* xp = x + p * plane;
      for (int t = 0; t < kBlock; ++t) part[t] = contrast_partial(plane, xp, t, kBlock);
      const float mean = contrast_mean(block_sum(part), plane);
      const float factor = plans[p / channels].factor;
      for (int64_t i = 0; i < plane; ++i) xp[i] = contrast_at(xp[i], mean, factor);
    }
  });
}

// The emulator already runs each stream as late and as far out of issue order as its waits
// allow (emu_runtime.cpp): a delay would add nothing.
void spin_delay(CUstream_st*, int64_t) {}
// Its "device code" is these host loops: always there.
std::string device_code_missing() { return {}; }

}  // namespace towers::kernels::cuda
