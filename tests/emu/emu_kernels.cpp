// emu_kernels.cpp — every kernels::cuda:: launcher on the emulated device (emu_runtime.h): the
// checks of its .cu launcher, then a host loop over the per-element rule its CUDA kernel runs,
// submitted to the stream (run at once, or recorded while the thread captures). Every closure
// captures by value: a recorded one runs at graph replay, after the launcher has returned, when
// only the device pointers it names are still valid.
//
// The loops run the indices in order where the GPU runs them in parallel; that makes no
// difference, since each index of a kernel writes its own element from inputs no other index
// writes. The block reductions (bias gradients, standardize) are the exception: see block_sum.
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
#include "kernels/activation.h"
#include "kernels/activation_rules.h"
#include "kernels/batchnorm.h"
#include "kernels/batchnorm_rules.h"
#include "kernels/bias.h"
#include "kernels/conv.h"
#include "kernels/debug.h"
#include "kernels/dropout.h"
#include "kernels/dropout_rules.h"
#include "kernels/cuda/bias_rules.h"
#include "kernels/cuda/conv_rules.h"
#include "kernels/cuda/launch.cuh"  // kBlock
#include "kernels/cuda/lrn_rules.h"
#include "kernels/cuda/pool_rules.h"
#include "kernels/cuda/standardize_rules.h"
#include "kernels/cuda/xent_rules.h"
#include "kernels/gemm.h"
#include "kernels/global_pool_rules.h"
#include "kernels/lrn.h"
#include "kernels/optimizer.h"
#include "kernels/optimizer_rules.h"
#include "kernels/pool.h"
#include "kernels/reduce.h"
#include "kernels/reduce_rules.h"
#include "kernels/softmax_xent.h"
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

// ---- activation.cu -------------------------------------------------------------------------

void relu_forward(CUstream_st* stream, int64_t n, const float* x, float* y) {
  if (n == 0) return;
  submit(stream, [=] {
    for (int64_t i = 0; i < n; ++i) y[i] = x[i] > 0.0f ? x[i] : 0.0f;
  });
}

void relu_backward(CUstream_st* stream, int64_t n, const float* y, const float* dy, float* dx) {
  if (n == 0) return;
  submit(stream, [=] {
    for (int64_t i = 0; i < n; ++i) dx[i] = y[i] > 0.0f ? dy[i] : 0.0f;
  });
}

void gelu_forward(CUstream_st* stream, int64_t n, const float* x, float* y) {
  if (n == 0) return;
  submit(stream, [=] {
    for (int64_t i = 0; i < n; ++i) y[i] = gelu_at(x[i]);
  });
}

void gelu_backward(CUstream_st* stream, int64_t n, const float* x, const float* dy, float* dx) {
  if (n == 0) return;
  submit(stream, [=] {
    for (int64_t i = 0; i < n; ++i) dx[i] = gelu_backward_at(x[i], dy[i]);
  });
}

// ---- dropout.cu ----------------------------------------------------------------------------

namespace {
void dropout_map(CUstream_st* stream, const DropoutParams& p, const StepNoise* noise, int64_t n,
                 const float* src, float* dst) {
  const int64_t count = n * p.per_example;
  if (count == 0) return;
  TOWERS_CHECK(noise != nullptr, "dropout on the GPU needs the step's noise in device memory");
  submit(stream, [=] {
    const StepNoise nz = *noise;  // read when the kernel runs, as on the GPU
    const uint64_t key = dropout_key(nz.key, p.salt);
    for (int64_t i = 0; i < count; ++i) {
      const int64_t e = i / p.per_example, j = i - e * p.per_example;
      dst[i] = dropout_at(p, key, static_cast<uint64_t>(nz.first_example + e),
                          static_cast<uint64_t>(j), src[i]);
    }
  });
}
}  // namespace

void dropout_forward(CUstream_st* stream, const DropoutParams& p, const StepNoise* noise,
                     int64_t n, const float* x, float* y) {
  dropout_map(stream, p, noise, n, x, y);
}

void dropout_backward(CUstream_st* stream, const DropoutParams& p, const StepNoise* noise,
                      int64_t n, const float* dy, float* dx) {
  dropout_map(stream, p, noise, n, dy, dx);
}

// ---- bias.cu -------------------------------------------------------------------------------

void bias_add(CUstream_st* s, int64_t n, int64_t c, int64_t hw, const float* bias, float* y,
              bool relu) {
  const int64_t count = n * c * hw;
  if (count == 0) return;
  submit(s, [=] {
    for (int64_t i = 0; i < count; ++i) y[i] = bias_add_at(c, hw, bias, y, relu, i);
  });
}

// Channel ch as block ch computes it: kBlock thread partials (bias_grad_partial), then the block
// sum (block_sum, CUB's order as far as it is known).
void bias_grad(CUstream_st* s, int64_t n, int64_t c, int64_t hw, const float* dy, float* db,
               bool accumulate) {
  if (c == 0) return;  // n * hw == 0 still writes db (zeros, or leaves it when accumulating)
  submit(s, [=] {
    std::array<double, kBlock> part;
    for (int64_t ch = 0; ch < c; ++ch) {
      for (int t = 0; t < kBlock; ++t) part[t] = bias_grad_partial(n, c, hw, dy, ch, t, kBlock);
      db[ch] = bias_grad_finish(block_sum(part), accumulate ? db[ch] : 0.0f, accumulate);
    }
  });
}

// ---- conv.cu -------------------------------------------------------------------------------

void im2col(CUstream_st* s, const ConvGeometry& g, int64_t n, const float* x, float* col) {
  const int64_t count = g.patch() * n * g.out_pixels();  // col (patch, n * P)
  if (count == 0) return;
  const ConvGeometry geo = g;
  // The index width the kernel picks (conv.cu).
  const bool narrow = fits_int32_indices(std::max(count, n * g.channels * g.height * g.width));
  submit(s, [=] {
    if (narrow)
      for (int32_t i = 0; i < count; ++i) col[i] = im2col_at<int32_t>(geo, int32_t(n), x, i);
    else
      for (int64_t i = 0; i < count; ++i) col[i] = im2col_at(geo, n, x, i);
  });
}

void col2im(CUstream_st* s, const ConvGeometry& g, int64_t n, const float* col, float* dx) {
  const int64_t count = n * g.channels * g.height * g.width;  // dx (n, C, H, W)
  if (count == 0) return;
  const ConvGeometry geo = g;
  const bool narrow = fits_int32_indices(std::max(count, g.patch() * n * g.out_pixels()));
  submit(s, [=] {
    if (narrow)
      for (int32_t i = 0; i < count; ++i) dx[i] = col2im_at<int32_t>(geo, int32_t(n), col, i);
    else
      for (int64_t i = 0; i < count; ++i) dx[i] = col2im_at(geo, n, col, i);
  });
}

void conv_output(CUstream_st* s, int64_t n, int64_t co, int64_t p, const float* out,
                 const float* bias, bool relu, float* y) {
  const int64_t count = n * co * p;
  if (count == 0) return;
  const bool narrow = fits_int32_indices(count);  // the index width the kernel picks
  submit(s, [=] {
    if (narrow)
      for (int32_t i = 0; i < count; ++i)
        y[i] = conv_output_at<int32_t>(int32_t(n), int32_t(co), int32_t(p), out, bias, relu, i);
    else
      for (int64_t i = 0; i < count; ++i) y[i] = conv_output_at(n, co, p, out, bias, relu, i);
  });
}

void conv_grad_output(CUstream_st* s, int64_t n, int64_t co, int64_t p, const float* y,
                      const float* dy, bool relu, float* g, float* db) {
  const int64_t count = n * co * p;
  if (count > 0) {
    const bool narrow = fits_int32_indices(count);
    submit(s, [=] {
      if (narrow)
        for (int32_t i = 0; i < count; ++i)
          g[i] = conv_grad_output_at<int32_t>(int32_t(n), int32_t(co), int32_t(p), y, dy, relu, i);
      else
        for (int64_t i = 0; i < count; ++i) g[i] = conv_grad_output_at(n, co, p, y, dy, relu, i);
    });
  }
  // db[c] = the sum of row c of g (co, n * P): g read as a (1, co, n * P) tensor.
  bias_grad(s, 1, co, n * p, g, db, false);
}

// ---- gemm.cu -------------------------------------------------------------------------------

// x rounded to TF32 (1 sign, 8 exponent, 10 mantissa bits), to nearest with ties to even.
static float to_tf32(float x) {
  if (!std::isfinite(x)) return x;
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  u += 0x0FFFu + ((u >> 13) & 1u);
  u &= 0xFFFFE000u;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

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

// ---- lrn.cu --------------------------------------------------------------------------------

void lrn_forward(CUstream_st* s, const LrnParams& p, int64_t n, int64_t c, int64_t hw,
                 const float* x, float* y, float* scale) {
  const int64_t count = n * c * hw;
  if (count == 0) return;
  const LrnParams lp = p;
  submit(s, [=] {
    for (int64_t i = 0; i < count; ++i) {
      float yv, sv;
      lrn_forward_at(lp, c, hw, x, i, yv, sv);
      y[i] = yv;
      scale[i] = sv;
    }
  });
}

void lrn_backward(CUstream_st* s, const LrnParams& p, int64_t n, int64_t c, int64_t hw,
                  const float* x, const float* y, const float* scale, const float* dy, float* dx) {
  const int64_t count = n * c * hw;
  if (count == 0) return;
  const LrnParams lp = p;
  submit(s, [=] {
    for (int64_t i = 0; i < count; ++i) dx[i] = lrn_backward_at(lp, c, hw, x, y, scale, dy, i);
  });
}

// ---- optimizer.cu --------------------------------------------------------------------------

void optimizer_update(CUstream_st* s, int64_t n, float* w, float* s0, float* s1, const float* g,
                      const RuleArgs& a) {
  if (n == 0) return;
  const RuleArgs args = a;
  submit(s, [=] {
    with_rule(args.rule, [&](auto rule) {
      for (int64_t i = 0; i < n; ++i) decltype(rule)::at(i, w, s0, s1, g, args);
    });
  });
}

void optimizer_update_at(CUstream_st* s, int64_t n, float* w, float* s0, float* s1,
                         const float* g, OptRule rule, const RuleArgs* args,
                         const int32_t* skip) {
  if (n == 0) return;
  // The scalars and the flag are read when the work runs (at replay, for a captured step).
  submit(s, [=] {
    if (*skip != 0) return;
    const RuleArgs a = *args;
    with_rule(rule, [&](auto r) {
      for (int64_t i = 0; i < n; ++i) decltype(r)::at(i, w, s0, s1, g, a);
    });
  });
}

// ---- pool.cu -------------------------------------------------------------------------------

void maxpool_forward(CUstream_st* s, int64_t planes, int64_t h, int64_t w, const Window& rows,
                     const Window& cols, const float* x, float* y, float* argmax) {
  const int64_t count = planes * rows.out * cols.out;
  if (count == 0) return;
  const Window r = rows, c = cols;
  submit(s, [=] {
    for (int64_t i = 0; i < count; ++i) {
      float m;
      int64_t at;
      maxpool_at(r, c, h, w, x, i, m, at);
      y[i] = m;
      if (argmax != nullptr) argmax[i] = static_cast<float>(at);
    }
  });
}

void maxpool_backward(CUstream_st* s, int64_t planes, int64_t h, int64_t w, const Window& rows,
                      const Window& cols, const float* argmax, const float* dy, float* dx) {
  const int64_t count = planes * h * w;
  if (count == 0) return;
  const Window r = rows, c = cols;
  submit(s, [=] {
    for (int64_t i = 0; i < count; ++i) dx[i] = maxpool_backward_at(r, c, h, w, argmax, dy, i);
  });
}

void global_avg_pool_forward(CUstream_st* s, int64_t planes, int64_t hw, const float* x, float* y) {
  if (planes == 0) return;
  submit(s, [=] {
    for (int64_t p = 0; p < planes; ++p) y[p] = global_avg_pool_at(hw, x, p);
  });
}

void global_avg_pool_backward(CUstream_st* s, int64_t planes, int64_t hw, const float* dy,
                              float* dx) {
  const int64_t count = planes * hw;
  if (count == 0) return;
  submit(s, [=] {
    for (int64_t i = 0; i < count; ++i) dx[i] = global_avg_pool_backward_at(hw, dy, i);
  });
}

// ---- reduce.cu -----------------------------------------------------------------------------

// The block pointers are copied, as the kernel argument copies them: blocks is the caller's host
// array and need not outlive the call.
void tree_sum(CUstream_st* s, float* const* blocks, int64_t count, int64_t n) {
  TOWERS_CHECK(count >= 0 && count <= kMaxTreeBlocks, "tree_sum: count {} not in [0, {}]", count,
               kMaxTreeBlocks);
  if (count <= 1 || n == 0) return;  // one block is its own sum
  std::array<float*, kMaxTreeBlocks> b{};
  for (int64_t i = 0; i < count; ++i) b[i] = blocks[i];
  submit(s, [=] {
    for (int64_t j = 0; j < n; ++j) tree_sum_rule(b, count, j);
  });
}

void scale(CUstream_st* s, int64_t n, float alpha, float* x) {
  if (n == 0) return;
  submit(s, [=] {
    for (int64_t i = 0; i < n; ++i) x[i] *= alpha;
  });
}

void any_nonfinite(CUstream_st* s, int64_t n, const double* x, int32_t* flag) {
  submit(s, [=] {
    int32_t bad = 0;
    for (int64_t i = 0; i < n; ++i) bad |= !std::isfinite(x[i]);
    *flag = bad;
  });
}

// ---- softmax_xent.cu -----------------------------------------------------------------------

void softmax_xent(CUstream_st* s, int64_t n, int64_t k, const float* logits, const int32_t* labels,
                  float smoothing, float grad_scale, float* dlogits, double* row_loss,
                  int32_t* row_correct) {
  if (n == 0) return;
  check_softmax_xent_args(k, row_loss, row_correct);
  submit(s, [=] {
    for (int64_t b = 0; b < n; ++b)
      softmax_xent_row(k, logits, labels, smoothing, grad_scale, dlogits, row_loss, row_correct,
                       b);
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

// ---- batchnorm.cu -------------------------------------------------------------------------

// Channel by channel, each one's lanes walked in order on one thread: the sums the CUDA block
// takes one lane per thread (kernels/batchnorm_rules.h).
void batchnorm_forward_train(CUstream_st* st, const BnShape& s, const float* x, const float* gamma,
                             const float* beta, float* y) {
  if (s.c == 0 || s.n * s.hw == 0) return;
  submit(st, [=] {
    for (int64_t ch = 0; ch < s.c; ++ch) bn_channel_forward_train(s, ch, x, gamma, beta, y);
  });
}

void batchnorm_forward_eval(CUstream_st* st, const BnShape& s, const float* x, const float* gamma,
                            const float* beta, const float* mean, const float* var, float* y) {
  if (s.n * s.c * s.hw == 0) return;
  submit(st, [=] {
    for (int64_t ch = 0; ch < s.c; ++ch)
      bn_channel_forward_eval(s, ch, x, gamma, beta, mean, var, y);
  });
}

void batchnorm_backward(CUstream_st* st, const BnShape& s, const float* x, const float* dy,
                        const float* gamma, const float* running_mean, const float* running_var,
                        const BnGrads& g) {
  if (s.c == 0 || s.n * s.hw == 0) return;
  submit(st, [=] {
    for (int64_t ch = 0; ch < s.c; ++ch)
      bn_channel_backward(s, ch, x, dy, gamma, running_mean, running_var, g);
  });
}

// The emulator runs every operation in issue order, so a delay could not expose anything.
void spin_delay(CUstream_st*, int64_t) {}
// Its "device code" is these host loops: always there.
std::string device_code_missing() { return {}; }

}  // namespace towers::kernels::cuda
