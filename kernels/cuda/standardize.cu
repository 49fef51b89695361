#include <cub/block/block_reduce.cuh>  // cub::BlockReduce: a fixed, deterministic block tree

#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/standardize_rules.h"
#include "kernels/standardize.h"

namespace towers::kernels::cuda {

// One block per image (grid-stride over images). The sums are in double like cpu::standardize's,
// in a different but fixed order: the result is deterministic and, after rounding to float,
// agrees with the CPU twin to about an ulp. No __restrict__: x may equal y. In place is safe
// because every read of the sums precedes the barrier, and the element-wise pass reads x[i]
// before writing y[i] in the same thread. Rules in kernels/cuda/standardize_rules.h.
__global__ void __launch_bounds__(kBlock)
    standardize_kernel(int64_t n, int64_t m, const float* x, float* y) {
  using Reduce = cub::BlockReduce<double, kBlock>;
  __shared__ typename Reduce::TempStorage temp;
  __shared__ float mean_s, inv_s;
  for (int64_t b = blockIdx.x; b < n; b += gridDim.x) {
    const float* xi = x + b * m;
    float* yi = y + b * m;
    double s, ss;
    standardize_partial(m, xi, threadIdx.x, kBlock, s, ss);  // Reduce assumes kBlock threads
    s = Reduce(temp).Sum(s);
    __syncthreads();  // temp is reused
    ss = Reduce(temp).Sum(ss);
    // The reductions' results are valid in thread 0.
    if (threadIdx.x == 0) standardize_stats(s, ss, m, mean_s, inv_s);
    __syncthreads();
    const float fm = mean_s, inv = inv_s;
    for (int64_t i = threadIdx.x; i < m; i += blockDim.x) yi[i] = standardize_at(xi[i], fm, inv);
    __syncthreads();  // mean_s, inv_s and temp are rewritten for the next image
  }
}

void standardize(CUstream_st* s, int64_t n, int64_t m, const float* x, float* y) {
  if (n == 0 || m == 0) return;
  const unsigned blocks = static_cast<unsigned>(n < 65535 * 8 ? n : 65535 * 8);
  standardize_kernel<<<blocks, kBlock, 0, s>>>(n, m, x, y);
  CUDA_CHECK_LAUNCH();
}

}  // namespace towers::kernels::cuda
