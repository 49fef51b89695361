#include "kernels/cuda/launch.cuh"
#include "kernels/optimizer.h"
#include "kernels/optimizer_rules.h"  // the per-element formulas shared with the CPU twin

namespace towers::kernels::cuda {

// One element per thread (grid-stride); the parameter, its slots and the gradient are
// distinct buffers.
template <class R>
__global__ void optimizer_kernel(int64_t n, float* __restrict__ w, float* __restrict__ s0,
                                 float* __restrict__ s1, const float* __restrict__ g, RuleArgs a) {
  TOWERS_GRID_STRIDE(i, n) { R::at(i, w, s0, s1, g, a); }
}

// The scalars and the skip flag from device memory; every thread reads the same two words.
template <class R>
__global__ void optimizer_at_kernel(int64_t n, float* __restrict__ w, float* __restrict__ s0,
                                    float* __restrict__ s1, const float* __restrict__ g,
                                    const RuleArgs* __restrict__ args,
                                    const int32_t* __restrict__ skip) {
  if (*skip != 0) return;
  const RuleArgs a = *args;
  TOWERS_GRID_STRIDE(i, n) { R::at(i, w, s0, s1, g, a); }
}

void optimizer_update(CUstream_st* s, int64_t n, float* w, float* s0, float* s1, const float* g,
                      const RuleArgs& a) {
  if (n == 0) return;
  with_rule(a.rule, [&](auto rule) {
    optimizer_kernel<decltype(rule)><<<grid_for(n), kBlock, 0, s>>>(n, w, s0, s1, g, a);
  });
  CUDA_CHECK_LAUNCH();
}

void optimizer_update_at(CUstream_st* s, int64_t n, float* w, float* s0, float* s1,
                         const float* g, OptRule rule, const RuleArgs* args,
                         const int32_t* skip) {
  if (n == 0) return;
  with_rule(rule, [&](auto r) {
    optimizer_at_kernel<decltype(r)><<<grid_for(n), kBlock, 0, s>>>(n, w, s0, s1, g, args, skip);
  });
  CUDA_CHECK_LAUNCH();
}

}  // namespace towers::kernels::cuda
