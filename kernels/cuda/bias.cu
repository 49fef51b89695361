// bias.cu — per-channel bias on the GPU: an element-wise add (with the ReLU fused) and the
// gradient, one block per channel. Rules in kernels/cuda/bias_rules.h.
#include "kernels/bias.h"
#include "kernels/cuda/bias_rules.h"
#include "kernels/cuda/launch.cuh"

#if defined(__CUDACC__)
#include <cub/block/block_reduce.cuh>
#endif

namespace towers::kernels::cuda {

namespace {

struct BiasAdd {
  int64_t c, hw;
  const float* bias;
  float* y;
  bool relu;
  TOWERS_HD void operator()(int64_t i) const { body(c, hw, bias, y, relu, i); }
  static TOWERS_HD void body(int64_t c, int64_t hw, const float* __restrict__ bias,
                             float* __restrict__ y, bool relu, int64_t i) {
    y[i] = bias_add_at(c, hw, bias, y, relu, i);
  }
};

}  // namespace

void bias_add(CUstream_st* s, int64_t n, int64_t c, int64_t hw, const float* bias, float* y,
              bool relu) {
  for_each_index(s, n * c * hw, BiasAdd{c, hw, bias, y, relu});
}

#if defined(__CUDACC__)  // a block reduction; its emulator twin is in tests/emu/emu_kernels.cpp

// Block ch sums channel ch: each thread its strided share in double, then CUB's block tree.
// Both have a fixed shape for a fixed block size, so the result does not depend on scheduling.
__global__ void __launch_bounds__(kBlock)
    bias_grad_kernel(int64_t n, int64_t c, int64_t hw, const float* __restrict__ dy,
                     float* __restrict__ db, bool accumulate) {
  using BlockSum = cub::BlockReduce<double, kBlock>;
  __shared__ typename BlockSum::TempStorage temp;
  const int64_t ch = blockIdx.x;
  const double part = bias_grad_partial(n, c, hw, dy, ch, threadIdx.x, kBlock);
  const double total = BlockSum(temp).Sum(part);  // valid in thread 0
  if (threadIdx.x == 0) db[ch] = bias_grad_finish(total, accumulate ? db[ch] : 0.0f, accumulate);
}

void bias_grad(CUstream_st* s, int64_t n, int64_t c, int64_t hw, const float* dy, float* db,
               bool accumulate) {
  if (c == 0) return;  // n * hw == 0 still writes db (zeros, or leaves it when accumulating)
  bias_grad_kernel<<<static_cast<unsigned>(c), kBlock, 0, s>>>(n, c, hw, dy, db, accumulate);
  CUDA_CHECK_LAUNCH();
}

#endif

}  // namespace towers::kernels::cuda
