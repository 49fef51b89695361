#include "kernels/cuda/launch.cuh"
#include "kernels/reduce.h"
#include "kernels/reduce_rules.h"  // tree_sum_rule: the CPU's tree, per element

namespace towers::kernels::cuda {

// The block pointers travel by value as the kernel argument (512 bytes, in the constant bank),
// so the launch needs no device copy of the host array.
struct TreeBlocks {
  float* p[kMaxTreeBlocks];
  __device__ float* operator[](int64_t i) const { return p[i]; }
};

// Thread j runs the whole tree for element j: the same additions, in the same order, as
// cpu::tree_sum, so the sums are bitwise equal. Blocks alias nothing but themselves, and every
// element is read and written by one thread only.
__global__ void tree_sum_kernel(const TreeBlocks blocks, int64_t count, int64_t n) {
  TOWERS_GRID_STRIDE(j, n) { tree_sum_rule(blocks, count, j); }
}

__global__ void scale_kernel(int64_t n, float alpha, float* __restrict__ x) {
  TOWERS_GRID_STRIDE(i, n) { x[i] *= alpha; }
}

// One block: each thread ORs its strided elements, then the block ORs the threads.
__global__ void any_nonfinite_kernel(int64_t n, const double* __restrict__ x,
                                     int32_t* __restrict__ flag) {
  int bad = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) bad |= !isfinite(x[i]);
  bad = __syncthreads_or(bad);
  if (threadIdx.x == 0) *flag = bad ? 1 : 0;
}

void tree_sum(CUstream_st* s, float* const* blocks, int64_t count, int64_t n) {
  TOWERS_CHECK(count >= 0 && count <= kMaxTreeBlocks, "tree_sum: count {} not in [0, {}]", count,
               kMaxTreeBlocks);
  if (count <= 1 || n == 0) return;  // one block is its own sum
  TreeBlocks b{};
  for (int64_t i = 0; i < count; ++i) b.p[i] = blocks[i];
  tree_sum_kernel<<<grid_for(n), kBlock, 0, s>>>(b, count, n);
  CUDA_CHECK_LAUNCH();
}

void scale(CUstream_st* s, int64_t n, float alpha, float* x) {
  if (n == 0) return;
  scale_kernel<<<grid_for(n), kBlock, 0, s>>>(n, alpha, x);
  CUDA_CHECK_LAUNCH();
}

void any_nonfinite(CUstream_st* s, int64_t n, const double* x, int32_t* flag) {
  any_nonfinite_kernel<<<1, kBlock, 0, s>>>(n, x, flag);
  CUDA_CHECK_LAUNCH();
}

}  // namespace towers::kernels::cuda
