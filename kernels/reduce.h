// reduce.h — the pairwise (tree) sum that every gradient reduction in towers uses.
// Blocks are added in a fixed binary tree: ((b0 + b1) + (b2 + b3)) + ... So the sum over the
// chunks of one tower, then over the towers, is the same tree as the sum over the chunks of
// one big tower: N sync towers of batch B/N reproduce one tower of batch B to the last bit
// when the chunk counts are powers of two.
#pragma once

#include <cstdint>

namespace towers::kernels::cpu {

// blocks[0..count) each hold n floats; afterwards blocks[0] holds their tree sum (the other
// blocks are scratch). Elements [begin, end) only, so callers can split the work.
void tree_sum(float* const* blocks, int64_t count, int64_t begin, int64_t end);

}  // namespace towers::kernels::cpu
