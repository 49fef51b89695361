// launch.cuh — launch arithmetic in one place: block sizes, grid sizes, grid-stride loops.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "core/cuda_check.h"

namespace towers::kernels::cuda {

constexpr int kBlock = 256;

// Enough blocks to cover n with a grid-stride loop, capped so huge n does not over-launch.
inline unsigned grid_for(int64_t n, int block = kBlock) {
  int64_t blocks = (n + block - 1) / block;
  if (blocks > 65535 * 8) blocks = 65535 * 8;
  return static_cast<unsigned>(blocks < 1 ? 1 : blocks);
}

#define TOWERS_GRID_STRIDE(i, n)                                                        \
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); \
       i += static_cast<int64_t>(blockDim.x) * gridDim.x)

}  // namespace towers::kernels::cuda
