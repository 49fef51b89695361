// reduce.cu — the tree sum of tower gradients on one GPU, scaling, and the non-finite check.
#include "kernels/cuda/launch.cuh"
#include "kernels/reduce.h"
#include "kernels/norm_rules.h"    // the norm's lanes and chunks, as the host sums them
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

struct ScaleAt {
  const float* alpha;
  float* x;
  TOWERS_HD void operator()(int64_t i) const { body(alpha, x, i); }
  static TOWERS_HD void body(const float* __restrict__ alpha, float* __restrict__ x, int64_t i) {
    x[i] *= *alpha;
  }
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

void scale_at(CUstream_st* s, int64_t n, const float* alpha, float* x) {
  for_each_index(s, n, ScaleAt{alpha, x});
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

// Block k is chunk k, thread l its lane l; thread 0 adds the lanes in order.
__global__ void __launch_bounds__(kNormLanes)
    norm_chunks_kernel(int64_t n, const float* __restrict__ x, const int64_t* __restrict__ keep,
                       int64_t nkeep, double* __restrict__ partials) {
  __shared__ double lanes[kNormLanes];
  const int64_t b = static_cast<int64_t>(blockIdx.x) * kNormChunk;
  const int64_t e = b + kNormChunk < n ? b + kNormChunk : n;
  lanes[threadIdx.x] = norm_lane(x, b, e, static_cast<int>(threadIdx.x), keep, nkeep);
  __syncthreads();
  if (threadIdx.x == 0) partials[blockIdx.x] = norm_lanes_total(lanes);
}

// One thread: the chunks in order, the root, the scale and the flag (norm_finish).
__global__ void norm_total_kernel(int64_t chunks, const double* __restrict__ partials,
                                  double bound, double* __restrict__ norm,
                                  float* __restrict__ scale, int32_t* __restrict__ flag) {
  norm_finish(chunks, partials, bound, norm, scale, flag);
}

void norm_guard(CUstream_st* s, int64_t n, const float* x, const int64_t* keep, int64_t nkeep,
                double bound, double* partials, double* norm, float* scale, int32_t* flag) {
  const int64_t chunks = norm_chunks(n);
  TOWERS_CHECK(chunks < (int64_t{1} << 31), "norm_guard: {} floats are too many chunks", n);
  if (chunks > 0) {
    norm_chunks_kernel<<<static_cast<unsigned>(chunks), kNormLanes, 0, s>>>(n, x, keep, nkeep,
                                                                           partials);
    CUDA_CHECK_LAUNCH();
  }
  norm_total_kernel<<<1, 1, 0, s>>>(chunks, partials, bound, norm, scale, flag);
  CUDA_CHECK_LAUNCH();
}

#endif

}  // namespace towers::kernels::cuda
