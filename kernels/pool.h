// pool.h — max-pooling over (C, H, W) planes with TF window/padding rules.
// Padding never wins a max (TF treats it as -inf). Backward routes each output gradient to the
// first maximal input of its window (row-major scan), recomputed from x and y as TF does.
#pragma once

#include <cstdint>

#include "kernels/conv.h"

namespace towers::kernels::cpu {

// x (planes, H, W) -> y (planes, rows.out, cols.out)
void maxpool_forward(int64_t planes, int64_t h, int64_t w, const Window& rows, const Window& cols,
                     const float* x, float* y);
// dx (planes, H, W) is overwritten.
void maxpool_backward(int64_t planes, int64_t h, int64_t w, const Window& rows,
                      const Window& cols, const float* x, const float* y, const float* dy,
                      float* dx);

}  // namespace towers::kernels::cpu
