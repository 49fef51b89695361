#include <cub/block/block_reduce.cuh>  // cub::BlockReduce: a fixed, deterministic block tree

#include "kernels/cuda/launch.cuh"
#include "kernels/standardize.h"

namespace towers::kernels::cuda {

namespace {
__device__ __forceinline__ double max_of(double a, double b) { return a < b ? b : a; }  // std::max
}  // namespace

// One block per image (grid-stride over images). The sums are in double like cpu::standardize's,
// in a different but fixed order: the result is deterministic and, after rounding to float,
// agrees with the CPU twin to about an ulp. No __restrict__: x may equal y. In place is safe
// because every read of the sums precedes the barrier, and the element-wise pass reads x[i]
// before writing y[i] in the same thread.
__global__ void standardize_kernel(int64_t n, int64_t m, const float* x, float* y) {
  using Reduce = cub::BlockReduce<double, kBlock>;
  __shared__ typename Reduce::TempStorage temp;
  __shared__ float mean_s, inv_s;
  for (int64_t b = blockIdx.x; b < n; b += gridDim.x) {
    const float* xi = x + b * m;
    float* yi = y + b * m;
    double s = 0.0, ss = 0.0;
    for (int64_t i = threadIdx.x; i < m; i += blockDim.x) {
      const double v = xi[i];
      s += v, ss += v * v;
    }
    s = Reduce(temp).Sum(s);
    __syncthreads();  // temp is reused
    ss = Reduce(temp).Sum(ss);
    if (threadIdx.x == 0) {  // the reductions' results are valid in thread 0
      const double mean = s / m;
      const double var = max_of(ss / m - mean * mean, 0.0);
      const double adj = max_of(sqrt(var), 1.0 / sqrt(static_cast<double>(m)));
      mean_s = static_cast<float>(mean);
      inv_s = static_cast<float>(1.0 / adj);
    }
    __syncthreads();
    const float fm = mean_s, inv = inv_s;
    for (int64_t i = threadIdx.x; i < m; i += blockDim.x) yi[i] = (xi[i] - fm) * inv;
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
