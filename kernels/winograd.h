// winograd.h — convolution by Winograd's minimal filtering on the CPU: F(2x2, 5x5) and
// F(4x4, 3x3) (Lavin and Gray, "Fast Algorithms for Convolutional Neural Networks", 2016).
//
// A stride-1 SAME convolution with an odd r x r kernel is cut into m x m output tiles. Each
// tile needs an alpha x alpha input patch (alpha = m + r - 1), and
//     y_tile = A^T [ (G w G^T) (.) (B^T d B) ] A
// where (.) is the elementwise product. Summed over the input channels, the product at each
// of the alpha^2 positions is one GEMM over every tile of a chunk of images:
//     M[xi] (co x T) = U[xi] (co x ci) * V[xi] (ci x T)
// so a tile costs alpha^2 multiplications per channel pair where the direct convolution costs
// m^2 r^2: 36 against 100 for F(2x2, 5x5) (2.8x fewer), 36 against 144 for F(4x4, 3x3) (4x).
// The transforms' constants are exact rationals (the interpolation points 0, 1, -1, 2, -1/2 for
// F(2x2, 5x5) and 0, 1, -1, 1/2, -2 for F(4x4, 3x3), and infinity), derived and checked by
// scripts/winograd-matrices.py; it also measured these points as the most accurate of the
// sets it tried.
//
// The backward uses the same transforms:
//   dx = the forward convolution of dy with the flipped, transposed kernel (Ut below);
//   dW = G^T [ sum over tiles of (A dy A^T) (.) (B^T x B) ] G: alpha^2 GEMMs (co x T) * (T x ci)
//        and the adjoint of the weight transform.
// Accuracy: the transforms amplify rounding. On unit-normal data over 64 channels, the error of
// an output is about 2e-6 of sqrt(channels * r^2) against 1e-7 for the direct sum (the test,
// tests/winograd_test.cpp, states the bound it holds every path to). Everything is deterministic:
// a chunk's result depends on its images only.
#pragma once

#include <cstdint>

#include "kernels/conv.h"

namespace towers::kernels::cpu {

struct WinogradShape {
  int m = 0, r = 0;  // output tile m x m; kernel r x r
  int64_t height = 0, width = 0;  // the input's, which is also the output's
  int alpha() const { return m + r - 1; }
  int positions() const { return alpha() * alpha(); }
  int64_t tiles_h() const { return (height + m - 1) / m; }
  int64_t tiles_w() const { return (width + m - 1) / m; }
  int64_t tiles(int64_t images) const { return images * tiles_h() * tiles_w(); }
};

// Whether a convolution has a Winograd form here: a 3x3 or 5x5 kernel, stride 1, SAME.
inline bool winograd_fits(int64_t kernel, int64_t stride, Padding padding) {
  return (kernel == 3 || kernel == 5) && stride == 1 && padding == Padding::Same;
}

// The Winograd form of a square-kernel convolution of a height x width input: m = 2 for a
// 5x5 kernel, m = 4 for a 3x3 one; m = 0 where it does not fit (winograd_fits).
WinogradShape winograd_shape(int64_t kernel, int64_t stride, Padding padding, int64_t height,
                             int64_t width);

// Layouts, for a chunk of `images` images of T = s.tiles(images) tiles, with the channels of
// the transformed arrays rounded up to a multiple of 8 (Cp) so that the transforms run on
// whole vectors (kernels/cpu/winograd.cpp):
//   U  (positions, ci, co)  the weights' transform                        winograd_weights
//   Ut (positions, co, ci)  that of the flipped kernel, for dx             (for_dx = true)
//   V  (T, positions, Cp)   an input's transform, B^T d B per tile
//   M  (T, positions, Cp)   the GEMMs' products, A^T m A per tile to NCHW output
//   Dy (T, positions, Cp)   the adjoint of the output transform, A dy A^T per tile
//   dU (positions, co, ci)  to dW (co, ci, r, r), the weight transform's adjoint
// w is (co, ci, r, r); x, y, dy and dx are (images, c, height, width).
void winograd_weights(const WinogradShape& s, int64_t co, int64_t ci, const float* w, bool for_dx,
                      float* u);

// One chunk of a convolution, transforms and GEMMs, with per-thread scratch of its own.
//   forward:  y = conv(x, w) + bias, ReLU when relu; u from winograd_weights (not for dx)
//   backward: dw = the chunk's weight gradient; dx (unless null) = its input gradient, from ut
//             (winograd_weights, for dx); g is the chunk's dy, already masked by the ReLU
void winograd_forward(const WinogradShape& s, int64_t co, int64_t ci, int64_t images,
                      const float* u, const float* x, const float* bias, bool relu, float* y);
void winograd_backward(const WinogradShape& s, int64_t co, int64_t ci, int64_t images,
                       const float* ut, const float* x, const float* g, float* dw, float* dx);

}  // namespace towers::kernels::cpu
