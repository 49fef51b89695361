// dropout_rules.h — the dropout mask's per-element rule, run by the CPU loop
// (kernels/cpu/dropout.cpp), the CUDA kernel (kernels/cuda/dropout.cu) and the emulator alike.
// The hash is core/rng.h's mix64 (SplitMix64's finalizer). Integer arithmetic and one float
// multiply, so the twins agree bitwise on any machine.
#pragma once

#include <cstdint>

#include "core/rng.h"  // mix64: constexpr, so device code calls it (--expt-relaxed-constexpr)
#include "kernels/dropout.h"
#include "kernels/hd.h"

namespace towers::kernels {

// The key of one layer in one step.
TOWERS_HD uint64_t dropout_key(uint64_t step_key, uint64_t salt) { return mix64(step_key ^ salt); }

// Element j (< 2^32) of the example at global position `example` (< 2^32): its counter is
// (example, j) as one word, mixed under the key; the top 24 bits are the element's uniform.
TOWERS_HD bool dropout_keep(uint64_t key, uint64_t example, uint64_t j, uint32_t threshold) {
  const uint64_t h = mix64(key ^ mix64((example << 32) | j));
  return static_cast<uint32_t>(h >> 40) >= threshold;
}

TOWERS_HD float dropout_at(const DropoutParams& p, uint64_t key, uint64_t example, uint64_t j,
                           float v) {
  return dropout_keep(key, example, j, p.threshold) ? v * p.scale : 0.0f;
}

}  // namespace towers::kernels
