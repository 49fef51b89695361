// conv.h — convolution geometry with TF padding rules, and im2col/col2im.
// Convolution itself is im2col + GEMM (src/layers/conv2d.cpp); these are the data movers.
#pragma once

#include <cstdint>
#include <string>

#include "kernels/hd.h"

namespace towers::kernels {

enum class Padding { Same, Valid };
Padding parse_padding(const std::string& s);  // "SAME" | "VALID"

// TF semantics: SAME gives out = ceil(in / stride) and pads (out-1)*stride + k - in in total,
// the smaller half before and the extra one after; VALID gives ceil((in - k + 1) / stride).
struct Window {
  int64_t in = 0, k = 0, stride = 1, out = 0, pad_before = 0;
};
Window make_window(int64_t in, int64_t k, int64_t stride, Padding padding);

struct ConvGeometry {
  int64_t channels = 0, height = 0, width = 0;  // input (C, H, W)
  Window rows, cols;                            // along H and along W
  TOWERS_HD int64_t patch() const { return channels * rows.k * cols.k; }  // rows of col
  TOWERS_HD int64_t out_pixels() const { return rows.out * cols.out; }
};

namespace cpu {
// x (C, H, W) -> col (patch, out_pixels) written with row stride ld (>= out_pixels), so several
// images can sit side by side in one col matrix. Padding reads as 0.
void im2col(const ConvGeometry& g, const float* x, float* col, int64_t ld);
// The adjoint: dx (C, H, W) = sum of col entries mapped back; dx is overwritten.
void col2im(const ConvGeometry& g, const float* col, int64_t ld, float* dx);
}  // namespace cpu

namespace cuda {
// Batched forms: col is (patch, n * out_pixels), image i's columns at [i * P, (i + 1) * P), so
// one GEMM covers the whole batch. x is (n, C, H, W).
void im2col(CUstream_st* s, const ConvGeometry& g, int64_t n, const float* x, float* col);
// dx (n, C, H, W) is overwritten; each input element gathers its col entries (no atomics, so
// the result does not depend on scheduling).
void col2im(CUstream_st* s, const ConvGeometry& g, int64_t n, const float* col, float* dx);
// The GEMM's (co, n * P) result to the layer's (n, co, P) output: y = out + bias[c], then ReLU
// when relu.
void conv_output(CUstream_st* s, int64_t n, int64_t co, int64_t p, const float* out,
                 const float* bias, bool relu, float* y);
// The backward's start: g (co, n * P) = dy (n, co, P), zeroed where y <= 0 when relu, and
// db[c] = the sum of row c of g (fixed-order sums, deterministic; bias_grad of g read as
// (1, co, n * P), whose bias_grad_partials doubles `partials` holds).
void conv_grad_output(CUstream_st* s, int64_t n, int64_t co, int64_t p, const float* y,
                      const float* dy, bool relu, float* g, float* db, double* partials);
}  // namespace cuda

}  // namespace towers::kernels
