// conv.h — convolution geometry with TF padding rules, and im2col/col2im.
// Convolution itself is im2col + GEMM (src/layers/conv2d.cpp); these are the data movers.
#pragma once

#include <cstdint>
#include <string>

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
  int64_t patch() const { return channels * rows.k * cols.k; }  // rows of the col matrix
  int64_t out_pixels() const { return rows.out * cols.out; }
};

namespace cpu {
// x (C, H, W) -> col (patch, out_pixels) written with row stride ld (>= out_pixels), so several
// images can sit side by side in one col matrix. Padding reads as 0.
void im2col(const ConvGeometry& g, const float* x, float* col, int64_t ld);
// The adjoint: dx (C, H, W) = sum of col entries mapped back; dx is overwritten.
void col2im(const ConvGeometry& g, const float* col, int64_t ld, float* dx);
}  // namespace cpu

}  // namespace towers::kernels
