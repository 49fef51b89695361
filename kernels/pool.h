// pool.h — max-pooling over (C, H, W) planes with TF window/padding rules.
// Padding never wins a max (TF treats it as -inf). Backward routes each output gradient to the
// first maximal input of its window (row-major scan), whose position forward records.
// Global average pooling: each (H, W) plane to its mean, summed in order in double
// (kernels/global_pool_rules.h); backward spreads dy / (H * W) over the plane.
#pragma once

#include <cstdint>

#include "kernels/conv.h"

namespace towers::kernels {

namespace cpu {

// x (planes, H, W) -> y (planes, rows.out, cols.out). argmax (same shape as y, may be null)
// receives the index within its plane of each maximum, as a float (exact below 2^24).
void maxpool_forward(int64_t planes, int64_t h, int64_t w, const Window& rows, const Window& cols,
                     const float* x, float* y, float* argmax);
// dx (planes, H, W) is overwritten: dx[argmax] += dy.
void maxpool_backward(int64_t planes, int64_t h, int64_t w, const Window& rows,
                      const Window& cols, const float* argmax, const float* dy, float* dx);

// x (planes, hw) -> y (planes): each plane's mean.
void global_avg_pool_forward(int64_t planes, int64_t hw, const float* x, float* y);
// dx (planes, hw) is overwritten: dy of its plane / hw.
void global_avg_pool_backward(int64_t planes, int64_t hw, const float* dy, float* dx);

}  // namespace cpu

namespace cuda {
void maxpool_forward(CUstream_st* s, int64_t planes, int64_t h, int64_t w, const Window& rows,
                     const Window& cols, const float* x, float* y, float* argmax);
// Each input element gathers the dy of the windows whose argmax it is (no atomics).
void maxpool_backward(CUstream_st* s, int64_t planes, int64_t h, int64_t w, const Window& rows,
                      const Window& cols, const float* argmax, const float* dy, float* dx);
// Forward: one thread per plane; backward: one thread per input element.
void global_avg_pool_forward(CUstream_st* s, int64_t planes, int64_t hw, const float* x, float* y);
void global_avg_pool_backward(CUstream_st* s, int64_t planes, int64_t hw, const float* dy,
                              float* dx);
}  // namespace cuda

}  // namespace towers::kernels
