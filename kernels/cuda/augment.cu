// augment.cu — the training transform on the device (--input device): crop, flip and
// brightness one thread per output float, the contrast one block per channel of an example,
// then per-image standardization (standardize.cu). Rules in kernels/cuda/augment_rules.h.
#include "kernels/augment.h"
#include "kernels/cuda/augment_rules.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/standardize.h"

#if defined(__CUDACC__)
#include <cub/block/block_reduce.cuh>  // cub::BlockReduce: a fixed, deterministic block tree
#endif

namespace towers::kernels::cuda {

namespace {

struct Crop {
  const uint8_t* images;
  const ExamplePlan* plans;
  AugmentShape s;
  float* out;
  // The output is (n, C, out_h, out_w); 32-bit indices where n * C * out_h * out_w fits.
  template <class I>
  TOWERS_HD void operator()(I i) const {
    const I x = i % static_cast<I>(s.out_w);
    I r = i / static_cast<I>(s.out_w);
    const I y = r % static_cast<I>(s.out_h);
    r /= static_cast<I>(s.out_h);
    const I ch = r % static_cast<I>(s.channels);
    const I b = r / static_cast<I>(s.channels);
    out[i] = augment_pixel(images, s, plans[b], ch, y, x);
  }
};

#if defined(__CUDACC__)
// Block p is plane p = (example, channel) (grid-stride over planes). Every partial is read
// before the barrier that precedes any write, so in place is safe.
__global__ void __launch_bounds__(kBlock)
    contrast_kernel(int64_t planes, int64_t channels, int64_t plane, const ExamplePlan* plans,
                    float* x) {
  using Reduce = cub::BlockReduce<double, kBlock>;
  __shared__ typename Reduce::TempStorage temp;
  __shared__ float mean_s;
  for (int64_t p = blockIdx.x; p < planes; p += gridDim.x) {
    float* xp = x + p * plane;
    const double s = Reduce(temp).Sum(contrast_partial(plane, xp, threadIdx.x, kBlock));
    if (threadIdx.x == 0) mean_s = contrast_mean(s, plane);  // valid in thread 0
    __syncthreads();
    const float mean = mean_s, factor = plans[p / channels].factor;
    for (int64_t i = threadIdx.x; i < plane; i += blockDim.x) xp[i] = contrast_at(xp[i], mean, factor);
    __syncthreads();  // mean_s and temp are rewritten for the next plane
  }
}
#endif

}  // namespace

#if defined(__CUDACC__)
void contrast(CUstream_st* s, int64_t n, int64_t channels, int64_t plane,
              const ExamplePlan* plans, float* x) {
  const int64_t planes = n * channels;
  if (planes == 0 || plane == 0) return;
  const unsigned blocks = static_cast<unsigned>(planes < 65535 * 8 ? planes : 65535 * 8);
  contrast_kernel<<<blocks, kBlock, 0, s>>>(planes, channels, plane, plans, x);
  CUDA_CHECK_LAUNCH();
}
#endif

void augment(CUstream_st* s, const uint8_t* images, const AugmentShape& shape,
             const ExamplePlan* plans, int64_t n, float* out) {
  const int64_t plane = shape.out_h * shape.out_w;
  const int64_t m = shape.channels * plane;
  const int64_t total = n * m;
  if (total <= 0) return;
  if (total <= INT32_MAX)
    for_each_index(s, static_cast<int32_t>(total), Crop{images, plans, shape, out});
  else
    for_each_index(s, total, Crop{images, plans, shape, out});
  if (shape.contrast) contrast(s, n, shape.channels, plane, plans, out);
  if (shape.standardize) standardize(s, n, m, out, out);
}

}  // namespace towers::kernels::cuda
