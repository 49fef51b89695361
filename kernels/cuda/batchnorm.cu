// batchnorm.cu — batch normalization on the GPU: one block of kBnLanes threads per channel.
// Thread l is lane l of kernels/batchnorm_rules.h: it sums the elements l, l + kBnLanes, ... of
// its channel in order in double, thread 0 adds the lanes in order, and every thread then
// writes its own elements. Built without FMA contraction, so the sums and outputs are the CPU
// twin's bit for bit. Evaluation is one thread per element.
#include "kernels/batchnorm.h"
#include "kernels/batchnorm_rules.h"
#include "kernels/cuda/launch.cuh"

namespace towers::kernels::cuda {

namespace {

// y from given statistics: the running ones (float, evaluation) or, under --sync-bn, the
// global batch's (double, on the device).
template <class Stat>
struct BnNormalize {
  BnShape s;
  const float *x, *gamma, *beta;
  const Stat *mean, *var;
  float* y;
  TOWERS_HD void operator()(int64_t i) const { body(s, x, gamma, beta, mean, var, y, i); }
  static TOWERS_HD void body(const BnShape& s, const float* __restrict__ x,
                             const float* __restrict__ gamma, const float* __restrict__ beta,
                             const Stat* __restrict__ mean, const Stat* __restrict__ var,
                             float* __restrict__ y, int64_t i) {
    const int64_t ch = (i / s.hw) % s.c;
    y[i] = bn_normalize(x[i], mean[ch], bn_invstd(var[ch], s.eps), gamma[ch], beta[ch]);
  }
};

}  // namespace

void batchnorm_forward_with(CUstream_st* st, const BnShape& s, const float* x, const float* gamma,
                            const float* beta, const double* mean, const double* var, float* y) {
  for_each_index(st, s.n * s.c * s.hw, BnNormalize<double>{s, x, gamma, beta, mean, var, y});
}

void batchnorm_forward_eval(CUstream_st* st, const BnShape& s, const float* x, const float* gamma,
                            const float* beta, const float* mean, const float* var, float* y) {
  for_each_index(st, s.n * s.c * s.hw, BnNormalize<float>{s, x, gamma, beta, mean, var, y});
}

#if defined(__CUDACC__)  // per-channel blocks; emulator twins in tests/emu/emu_kernels.cpp

namespace {

// The block's total of each thread's v, by thread 0 in lane order; every thread gets it.
__device__ double block_total(double v, double* lanes) {
  __syncthreads();  // lanes may still be read from the previous total
  lanes[threadIdx.x] = v;
  __syncthreads();
  if (threadIdx.x == 0) lanes[kBnLanes] = bn_lanes_total(lanes);
  __syncthreads();
  return lanes[kBnLanes];
}

// The batch mean and biased variance of channel blockIdx.x, in every thread.
__device__ void block_moments(const BnShape& s, const float* x, double* lanes, double& mean,
                              double& var) {
  const int64_t ch = blockIdx.x, m = s.n * s.hw;
  double a = 0.0;
  for (int64_t j = threadIdx.x; j < m; j += kBnLanes) a += static_cast<double>(x[bn_index(s, ch, j)]);
  mean = block_total(a, lanes) / static_cast<double>(m);
  double q = 0.0;
  for (int64_t j = threadIdx.x; j < m; j += kBnLanes) {
    const double d = static_cast<double>(x[bn_index(s, ch, j)]) - mean;
    q += d * d;
  }
  var = block_total(q, lanes) / static_cast<double>(m);
}

__global__ void __launch_bounds__(kBnLanes)
    forward_train_kernel(BnShape s, const float* __restrict__ x, const float* __restrict__ gamma,
                         const float* __restrict__ beta, float* __restrict__ y) {
  __shared__ double lanes[kBnLanes + 1];
  const int64_t ch = blockIdx.x, m = s.n * s.hw;
  double mean, var;
  block_moments(s, x, lanes, mean, var);
  const double invstd = bn_invstd(var, s.eps);
  for (int64_t j = threadIdx.x; j < m; j += kBnLanes) {
    const int64_t i = bn_index(s, ch, j);
    y[i] = bn_normalize(x[i], mean, invstd, gamma[ch], beta[ch]);
  }
}

__global__ void __launch_bounds__(kBnLanes)
    backward_kernel(BnShape s, const float* __restrict__ x, const float* __restrict__ dy,
                    const float* __restrict__ gamma, const float* __restrict__ running_mean,
                    const float* __restrict__ running_var, BnGrads g) {
  __shared__ double lanes[kBnLanes + 1];
  const int64_t ch = blockIdx.x, m = s.n * s.hw;
  double mean, var;
  block_moments(s, x, lanes, mean, var);
  const double invstd = bn_invstd(var, s.eps);
  double a = 0.0, b = 0.0;
  for (int64_t j = threadIdx.x; j < m; j += kBnLanes) {
    const int64_t i = bn_index(s, ch, j);
    const double d = static_cast<double>(dy[i]);
    a += d;
    b += d * bn_xhat(x[i], mean, invstd);
  }
  const double sdy = block_total(a, lanes);
  const double sdyx = block_total(b, lanes);
  if (threadIdx.x == 0)
    bn_channel_outputs(s, ch, mean, var, sdy, sdyx, running_mean, running_var, g);
  if (g.dx == nullptr) return;
  const double md = static_cast<double>(m), gi = static_cast<double>(gamma[ch]) * invstd;
  for (int64_t j = threadIdx.x; j < m; j += kBnLanes) {
    const int64_t i = bn_index(s, ch, j);
    g.dx[i] = bn_dx(dy[i], bn_xhat(x[i], mean, invstd), md, gi, sdy, sdyx);
  }
}

// --sync-bn: the lane sums of channel blockIdx.x's x, or (center non-null) of its
// (x - center)^2, as kernels::cpu::batchnorm_channel_sums takes them.
__global__ void __launch_bounds__(kBnLanes)
    channel_sums_kernel(BnShape s, const float* __restrict__ x, const double* __restrict__ center,
                        double* __restrict__ out) {
  __shared__ double lanes[kBnLanes + 1];
  const int64_t ch = blockIdx.x, m = s.n * s.hw;
  const double c = center != nullptr ? center[ch] : 0.0;
  double a = 0.0;
  if (center == nullptr) {
    for (int64_t j = threadIdx.x; j < m; j += kBnLanes)
      a += static_cast<double>(x[bn_index(s, ch, j)]) - c;
  } else {
    for (int64_t j = threadIdx.x; j < m; j += kBnLanes) {
      const double d = static_cast<double>(x[bn_index(s, ch, j)]) - c;
      a += d * d;
    }
  }
  const double t = block_total(a, lanes);
  if (threadIdx.x == 0) out[ch] = t;
}

// --sync-bn: the lane sums of dy and dy x xhat of channel blockIdx.x, with given statistics.
__global__ void __launch_bounds__(kBnLanes)
    backward_sums_kernel(BnShape s, const float* __restrict__ x, const float* __restrict__ dy,
                         const double* __restrict__ mean, const double* __restrict__ var,
                         double* __restrict__ sdy, double* __restrict__ sdyx) {
  __shared__ double lanes[kBnLanes + 1];
  const int64_t ch = blockIdx.x, m = s.n * s.hw;
  const double mu = mean[ch], invstd = bn_invstd(var[ch], s.eps);
  double a = 0.0, b = 0.0;
  for (int64_t j = threadIdx.x; j < m; j += kBnLanes) {
    const int64_t i = bn_index(s, ch, j);
    const double d = static_cast<double>(dy[i]);
    a += d;
    b += d * bn_xhat(x[i], mu, invstd);
  }
  const double ta = block_total(a, lanes);
  const double tb = block_total(b, lanes);
  if (threadIdx.x == 0) sdy[ch] = ta, sdyx[ch] = tb;
}

// --sync-bn: channel blockIdx.x's dx from the global sums, its gradients from the tower's own
// sums and its state deltas from the global statistics (`global`: the global batch's shape).
__global__ void __launch_bounds__(kBnLanes)
    backward_with_kernel(BnShape s, BnShape global, double m, const float* __restrict__ x,
                         const float* __restrict__ dy, const float* __restrict__ gamma,
                         const double* __restrict__ mean, const double* __restrict__ var,
                         const double* __restrict__ sdy, const double* __restrict__ sdyx,
                         const double* __restrict__ own_sdy, const double* __restrict__ own_sdyx,
                         const float* __restrict__ running_mean,
                         const float* __restrict__ running_var, BnGrads g) {
  const int64_t ch = blockIdx.x, count = s.n * s.hw;
  if (threadIdx.x == 0)
    bn_channel_outputs(global, ch, mean[ch], var[ch], own_sdy[ch], own_sdyx[ch], running_mean,
                       running_var, g);
  if (g.dx == nullptr) return;
  const double mu = mean[ch], invstd = bn_invstd(var[ch], s.eps);
  const double gi = static_cast<double>(gamma[ch]) * invstd;
  for (int64_t j = threadIdx.x; j < count; j += kBnLanes) {
    const int64_t i = bn_index(s, ch, j);
    g.dx[i] = bn_dx(dy[i], bn_xhat(x[i], mu, invstd), m, gi, sdy[ch], sdyx[ch]);
  }
}

}  // namespace

void batchnorm_channel_sums(CUstream_st* st, const BnShape& s, const float* x,
                            const double* center, double* out) {
  if (s.c == 0) return;
  channel_sums_kernel<<<static_cast<unsigned>(s.c), kBnLanes, 0, st>>>(s, x, center, out);
  CUDA_CHECK_LAUNCH();
}

void batchnorm_backward_sums(CUstream_st* st, const BnShape& s, const float* x, const float* dy,
                             const double* mean, const double* var, double* sdy, double* sdyx) {
  if (s.c == 0) return;
  backward_sums_kernel<<<static_cast<unsigned>(s.c), kBnLanes, 0, st>>>(s, x, dy, mean, var, sdy,
                                                                         sdyx);
  CUDA_CHECK_LAUNCH();
}

void batchnorm_backward_with(CUstream_st* st, const BnShape& s, double m, const float* x,
                             const float* dy, const float* gamma, const double* mean,
                             const double* var, const double* sdy, const double* sdyx,
                             const double* own_sdy, const double* own_sdyx,
                             const float* running_mean, const float* running_var,
                             const BnGrads& g) {
  if (s.c == 0) return;
  BnShape global = s;  // the state deltas' unbiased variance counts the global batch
  global.n = static_cast<int64_t>(m) / s.hw;
  backward_with_kernel<<<static_cast<unsigned>(s.c), kBnLanes, 0, st>>>(
      s, global, m, x, dy, gamma, mean, var, sdy, sdyx, own_sdy, own_sdyx, running_mean,
      running_var, g);
  CUDA_CHECK_LAUNCH();
}

void batchnorm_forward_train(CUstream_st* st, const BnShape& s, const float* x, const float* gamma,
                             const float* beta, float* y) {
  if (s.c == 0 || s.n * s.hw == 0) return;
  forward_train_kernel<<<static_cast<unsigned>(s.c), kBnLanes, 0, st>>>(s, x, gamma, beta, y);
  CUDA_CHECK_LAUNCH();
}

void batchnorm_backward(CUstream_st* st, const BnShape& s, const float* x, const float* dy,
                        const float* gamma, const float* running_mean, const float* running_var,
                        const BnGrads& g) {
  if (s.c == 0 || s.n * s.hw == 0) return;
  backward_kernel<<<static_cast<unsigned>(s.c), kBnLanes, 0, st>>>(s, x, dy, gamma, running_mean,
                                                                   running_var, g);
  CUDA_CHECK_LAUNCH();
}

#endif

}  // namespace towers::kernels::cuda
