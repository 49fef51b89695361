// bias.cu — per-channel bias on the GPU: an element-wise add (with the ReLU fused; its channel
// divided out by multiply and shift, kernels/divisor.h) and the gradient, a block per channel,
// or per segment of a channel where there are few channels and many terms (then one thread per
// channel adds the segments); 32-bit indices where they fit. Rules in kernels/cuda/bias_rules.h.
#include "kernels/bias.h"
#include "kernels/cuda/bias_rules.h"
#include "kernels/cuda/launch.cuh"

#if defined(__CUDACC__)
#include <cub/block/block_reduce.cuh>
#endif

namespace towers::kernels::cuda {

namespace {

template <class I>
struct BiasAdd {
  Divisor<I> c, hw;
  const float* bias;
  float* y;
  bool relu;
  TOWERS_HD void operator()(I i) const { body(c, hw, bias, y, relu, i); }
  static TOWERS_HD void body(const Divisor<I>& c, const Divisor<I>& hw,
                             const float* __restrict__ bias, float* __restrict__ y, bool relu,
                             I i) {
    y[i] = bias_add_at<I>(c, hw, bias, y, relu, i);
  }
};

}  // namespace

void bias_add(CUstream_st* s, int64_t n, int64_t c, int64_t hw, const float* bias, float* y,
              bool relu) {
  const int64_t count = n * c * hw;
  launch_narrow_or_wide(s, count, fits_int32_indices(count), [&](auto i) {
    using I = decltype(i);
    return BiasAdd<I>{Divisor<I>(static_cast<I>(c)), Divisor<I>(static_cast<I>(hw)), bias, y, relu};
  });
}

#if defined(__CUDACC__)  // a block reduction; its emulator twin is in tests/emu/emu_kernels.cpp

// Block ch sums channel ch: each thread its strided share in double, then CUB's block tree.
// Both have a fixed shape for a fixed block size, so the result does not depend on scheduling.
template <class I>
__global__ void __launch_bounds__(kBlock)
    bias_grad_kernel(I n, I c, I hw, const float* __restrict__ dy, float* __restrict__ db,
                     bool accumulate) {
  using BlockSum = cub::BlockReduce<double, kBlock>;
  __shared__ typename BlockSum::TempStorage temp;
  const I ch = static_cast<I>(blockIdx.x);
  const double part =
      bias_grad_partial<I>(n, c, hw, dy, ch, static_cast<I>(threadIdx.x), static_cast<I>(kBlock));
  const double total = BlockSum(temp).Sum(part);  // valid in thread 0
  if (threadIdx.x == 0) db[ch] = bias_grad_finish(total, accumulate ? db[ch] : 0.0f, accumulate);
}

// Block ch x k + j sums segment j of channel ch into partials[ch x k + j], as above.
template <class I>
__global__ void __launch_bounds__(kBlock)
    bias_grad_segments_kernel(I n, I c, I hw, I k, const float* __restrict__ dy,
                              double* __restrict__ partials) {
  using BlockSum = cub::BlockReduce<double, kBlock>;
  __shared__ typename BlockSum::TempStorage temp;
  const I block = static_cast<I>(blockIdx.x), ch = block / k;
  I lo, hi;
  bias_grad_segment<I>(n * hw, k, block - ch * k, lo, hi);
  const double part = bias_grad_segment_partial<I>(c, hw, dy, ch, lo, hi,
                                                   static_cast<I>(threadIdx.x),
                                                   static_cast<I>(kBlock));
  const double total = BlockSum(temp).Sum(part);
  if (threadIdx.x == 0) partials[block] = total;
}

// Thread ch adds channel ch's k segment sums in order.
__global__ void bias_grad_total_kernel(int64_t c, int64_t k, const double* __restrict__ partials,
                                       float* __restrict__ db, bool accumulate) {
  const int64_t ch = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (ch >= c) return;
  double total = 0.0;
  for (int64_t j = 0; j < k; ++j) total += partials[ch * k + j];
  db[ch] = bias_grad_finish(total, accumulate ? db[ch] : 0.0f, accumulate);
}

void bias_grad(CUstream_st* s, int64_t n, int64_t c, int64_t hw, const float* dy, float* db,
               bool accumulate, double* partials) {
  if (c == 0) return;  // n * hw == 0 still writes db (zeros, or leaves it when accumulating)
  const bool narrow = fits_int32_indices(n * c * hw);
  const int64_t k = bias_grad_segments(c, n * hw);
  if (k == 1) {
    const auto blocks = static_cast<unsigned>(c);
    if (narrow)
      bias_grad_kernel<int32_t><<<blocks, kBlock, 0, s>>>(
          static_cast<int32_t>(n), static_cast<int32_t>(c), static_cast<int32_t>(hw), dy, db,
          accumulate);
    else
      bias_grad_kernel<int64_t><<<blocks, kBlock, 0, s>>>(n, c, hw, dy, db, accumulate);
    CUDA_CHECK_LAUNCH();
    return;
  }
  TOWERS_CHECK(partials != nullptr, "bias_grad of ({}, {}, {}) needs {} doubles of scratch", n, c,
               hw, c * k);
  const auto blocks = static_cast<unsigned>(c * k);
  if (narrow)
    bias_grad_segments_kernel<int32_t><<<blocks, kBlock, 0, s>>>(
        static_cast<int32_t>(n), static_cast<int32_t>(c), static_cast<int32_t>(hw),
        static_cast<int32_t>(k), dy, partials);
  else
    bias_grad_segments_kernel<int64_t><<<blocks, kBlock, 0, s>>>(n, c, hw, k, dy, partials);
  CUDA_CHECK_LAUNCH();
  bias_grad_total_kernel<<<grid_for(c), kBlock, 0, s>>>(c, k, partials, db, accumulate);
  CUDA_CHECK_LAUNCH();
}

#endif

}  // namespace towers::kernels::cuda
