// reduce.h — the pairwise (tree) sum that every gradient reduction in towers uses.
// Blocks are added in a fixed binary tree: ((b0 + b1) + (b2 + b3)) + ... So the sum over the
// chunks of one tower, then over the towers, is the same tree as the sum over the chunks of
// one big tower: N sync towers of batch B/N reproduce one tower of batch B to the last bit
// when the chunk counts are powers of two.
#pragma once

#include <cstdint>

#include "kernels/hd.h"

namespace towers::kernels {

namespace cpu {

// blocks[0..count) each hold n floats; afterwards blocks[0] holds their tree sum (the other
// blocks are scratch). Elements [begin, end) only, so callers can split the work.
void tree_sum(float* const* blocks, int64_t count, int64_t begin, int64_t end);

}  // namespace cpu

namespace cuda {
// The same tree over count device blocks of n floats on one GPU (count <= kMaxTreeBlocks);
// blocks is a host array of device pointers.
constexpr int kMaxTreeBlocks = 64;
void tree_sum(CUstream_st* s, float* const* blocks, int64_t count, int64_t n);
// x *= alpha (the 1/N of an average).
void scale(CUstream_st* s, int64_t n, float alpha, float* x);
// *flag = 1 if any of x[0..n) is not finite (NaN or infinite), else 0: a step's per-example
// losses, checked on the device before its update.
void any_nonfinite(CUstream_st* s, int64_t n, const double* x, int32_t* flag);
// The guard of an update (--clip-grad-norm, --on-divergence skip-step) on the device: *norm =
// the L2 norm of the kept ranges of x[0, n) (nkeep [begin, end) pairs in device memory), in
// the order of kernels/norm_rules.h, so the host's bits; *scale = norm_clip_scale(*norm,
// bound); and, where flag is not null, *flag = 1 when the norm is not finite (else it is left
// as it is). partials: norm_chunks(n) doubles of device scratch.
void norm_guard(CUstream_st* s, int64_t n, const float* x, const int64_t* keep, int64_t nkeep,
                double bound, double* partials, double* norm, float* scale, int32_t* flag);
// x *= *alpha, alpha read from device memory when the kernel runs (a captured step's clip).
void scale_at(CUstream_st* s, int64_t n, const float* alpha, float* x);
}  // namespace cuda

}  // namespace towers::kernels
