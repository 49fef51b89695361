// reduce.cu — the tree sum of tower gradients on one GPU, scaling, and the non-finite check.
#include "kernels/cuda/launch.cuh"
#include "kernels/reduce.h"
#include "kernels/reduce_rules.h"  // tree_sum_rule: the CPU's tree, per element

namespace towers::kernels::cuda {

namespace {

// The block pointers travel by value in the kernel's argument (in the constant bank),
// so the launch needs no device copy of the host array.
struct TreeBlocks {
  float* p[kMaxTreeBlocks];
  TOWERS_HD float* operator[](int64_t i) const { return p[i]; }
};

// Thread j runs the whole tree for element j: the same additions, in the same order, as
// cpu::tree_sum, so the sums are bitwise equal. Blocks alias nothing but themselves, and every
// element is read and written by one thread only.
struct TreeSum {
  TreeBlocks blocks;
  int64_t count;
  TOWERS_HD void operator()(int64_t j) const { tree_sum_rule(blocks, count, j); }
};

struct Scale {
  float alpha;
  float* x;
  TOWERS_HD void operator()(int64_t i) const { body(alpha, x, i); }
  static TOWERS_HD void body(float alpha, float* __restrict__ x, int64_t i) { x[i] *= alpha; }
};

}  // namespace

void tree_sum(CUstream_st* s, float* const* blocks, int64_t count, int64_t n) {
  TOWERS_CHECK(count >= 0 && count <= kMaxTreeBlocks, "tree_sum: count {} not in [0, {}]", count,
               kMaxTreeBlocks);
  if (count <= 1) return;  // one block is its own sum
  TreeSum f{{}, count};
  for (int64_t i = 0; i < count; ++i) f.blocks.p[i] = blocks[i];  // blocks need not outlive us
  for_each_index(s, n, f);
}

void scale(CUstream_st* s, int64_t n, float alpha, float* x) {
  for_each_index(s, n, Scale{alpha, x});
}

#if defined(__CUDACC__)  // a block reduction; its emulator twin is in tests/emu/emu_kernels.cpp

// One block: each thread ORs its strided elements, then the block ORs the threads.
__global__ void any_nonfinite_kernel(int64_t n, const double* __restrict__ x,
                                     int32_t* __restrict__ flag) {
  int bad = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) bad |= !isfinite(x[i]);
  bad = __syncthreads_or(bad);
  if (threadIdx.x == 0) *flag = bad ? 1 : 0;
}

void any_nonfinite(CUstream_st* s, int64_t n, const double* x, int32_t* flag) {
  any_nonfinite_kernel<<<1, kBlock, 0, s>>>(n, x, flag);
  CUDA_CHECK_LAUNCH();
}

#endif

}  // namespace towers::kernels::cuda
