// reduce_rules.h — the tree of cpu::tree_sum (kernels/reduce.h) for one element j, the rule
// each thread of cuda::tree_sum runs. cpu::tree_sum keeps its own loop (levels outer, elements
// inner, which vectorises); the additions each element sees, and their order, are the same,
// so the two agree bitwise (checked in tests/rules_math_test.cpp).
#pragma once

#include <cstdint>

#include "kernels/hd.h"

namespace towers::kernels {

// blocks[i][j] for i in [0, count): afterwards blocks[0][j] holds the tree sum and the other
// blocks hold the partial sums cpu::tree_sum leaves there. Blocks is anything indexable by
// int64_t giving a float* (a float* const*, or the CUDA kernel's array of block pointers).
template <class Blocks>
TOWERS_HD void tree_sum_rule(const Blocks& blocks, int64_t count, int64_t j) {
  for (int64_t s = 1; s < count; s *= 2)
    for (int64_t i = 0; i + s < count; i += 2 * s) blocks[i][j] += blocks[i + s][j];
}

}  // namespace towers::kernels
