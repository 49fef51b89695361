// global_pool_rules.h — the per-element rules of global average pooling, run by the CPU loop
// (kernels/cpu/pool.cpp), the CUDA kernels (kernels/cuda/pool.cu) and the emulator alike. Plain
// C++17 with TOWERS_HD. Each plane is summed in order in double by one thread, so the twins
// agree bitwise.
#pragma once

#include <cstdint>

#include "kernels/hd.h"

namespace towers::kernels {

// y of plane p of x (planes, hw): its hw inputs summed in order in double, over hw.
TOWERS_HD float global_avg_pool_at(int64_t hw, const float* x, int64_t p) {
  const float* xp = x + p * hw;
  double sum = 0.0;
  for (int64_t i = 0; i < hw; ++i) sum += xp[i];
  return static_cast<float>(sum / static_cast<double>(hw));
}

// dx of input element idx of (planes, hw): its plane's dy over hw.
TOWERS_HD float global_avg_pool_backward_at(int64_t hw, const float* dy, int64_t idx) {
  return static_cast<float>(static_cast<double>(dy[idx / hw]) / static_cast<double>(hw));
}

}  // namespace towers::kernels
