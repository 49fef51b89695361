// batchnorm.cu — batch normalization on the GPU, every kernel one thread per index through
// for_each_index (the emulator runs the same functors as host loops):
//   - a channel's sums: one thread per lane of every channel (C x kBnLanes threads; lane l of
//     kernels/batchnorm_rules.h, walked in order in double by bn_lane_sum), in small blocks
//     (lane_block) so that a layer of few channels still spreads over the GPU's
//     multiprocessors; then one thread per channel adds its lanes in order (bn_lanes_total);
//   - the normalization and dx: one thread per element, its channel divided out by multiply and
//     shift (kernels/divisor.h).
// Built without FMA contraction, so the sums and outputs are the CPU twin's bit for bit.
#include "kernels/batchnorm.h"
#include "kernels/batchnorm_rules.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/divisor.h"

namespace towers::kernels::cuda {

namespace {

// Threads per block of the lane kernels: C x kBnLanes lanes make C x kBnLanes / 32 blocks of 32
// (192 for 24 channels), where blocks of kBlock would leave most multiprocessors idle; from
// 128 channels on, blocks of 128 (a multiprocessor holds at most 16 to 32 blocks, so blocks of
// one warp would cap its warps there). A block's size changes no sum.
int lane_block(const BnShape& s) { return s.c < 128 ? 32 : 128; }

// lanes[ch x kBnLanes + l] = lane l of channel ch's sum of x - center[ch] and its square
// (center non-null), or of x (center null): kernels::cpu::batchnorm_channel_sums's lanes.
struct BnLaneSums {
  BnShape s;
  const float* x;
  const double* center;
  double* lanes;
  TOWERS_HD void operator()(int64_t i) const { body(s, x, center, lanes, i); }
  static TOWERS_HD void body(const BnShape& s, const float* __restrict__ x,
                             const double* __restrict__ center, double* __restrict__ lanes,
                             int64_t i) {
    const int64_t ch = i / kBnLanes, l = i % kBnLanes;
    lanes[i] = center != nullptr ? bn_lane_sum(s, ch, l, x, center[ch], true)
                                 : bn_lane_sum(s, ch, l, x, 0.0, false);
  }
};

// The lane sums of dy and of dy x xhat, with the given statistics.
struct BnBackwardLaneSums {
  BnShape s;
  const float *x, *dy;
  const double *mean, *var;
  double *a, *b;
  TOWERS_HD void operator()(int64_t i) const { body(s, x, dy, mean, var, a, b, i); }
  static TOWERS_HD void body(const BnShape& s, const float* __restrict__ x,
                             const float* __restrict__ dy, const double* __restrict__ mean,
                             const double* __restrict__ var, double* __restrict__ a,
                             double* __restrict__ b, int64_t i) {
    const int64_t ch = i / kBnLanes, l = i % kBnLanes;
    bn_lane_backward_sums(s, ch, l, x, dy, mean[ch], bn_invstd(var[ch], s.eps), a[i], b[i]);
  }
};

// out[ch] = channel ch's lanes added in order, over `divisor` (m for a moment, 1 for a sum;
// x / 1 is x exactly).
struct BnLaneTotals {
  const double* lanes;
  double divisor;
  double* out;
  TOWERS_HD void operator()(int64_t ch) const {
    out[ch] = bn_lanes_total(lanes + ch * kBnLanes) / divisor;
  }
};

// Channel ch's gradients and state deltas (bn_channel_outputs), from the statistics of shape
// `stats` (the global batch's under --sync-bn) and the sums sdy, sdyx; and its invstd, for dx.
struct BnOutputs {
  BnShape stats;
  const double *mean, *var, *sdy, *sdyx;
  const float *running_mean, *running_var;
  BnGrads g;
  double* invstd;
  TOWERS_HD void operator()(int64_t ch) const {
    bn_channel_outputs(stats, ch, mean[ch], var[ch], sdy[ch], sdyx[ch], running_mean, running_var,
                       g);
    invstd[ch] = bn_invstd(var[ch], stats.eps);
  }
};

// invstd[ch] from a channel's variance (the batch's, or the running one), once per channel
// rather than once per element.
template <class Stat>
struct BnInvstd {
  const Stat* var;
  double eps;
  double* invstd;
  TOWERS_HD void operator()(int64_t ch) const { invstd[ch] = bn_invstd(var[ch], eps); }
};

// y from given statistics: the running ones (float, evaluation) or the batch's (double, on the
// device), and the channels' invstd (BnInvstd).
template <class I, class Stat>
struct BnNormalize {
  Divisor<I> c, hw;
  const float *x, *gamma, *beta;
  const Stat* mean;
  const double* invstd;
  float* y;
  TOWERS_HD void operator()(I i) const { body(c, hw, x, gamma, beta, mean, invstd, y, i); }
  static TOWERS_HD void body(const Divisor<I>& c, const Divisor<I>& hw, const float* __restrict__ x,
                             const float* __restrict__ gamma, const float* __restrict__ beta,
                             const Stat* __restrict__ mean, const double* __restrict__ invstd,
                             float* __restrict__ y, I i) {
    const I ch = channel_of(c, hw, i);
    y[i] = bn_normalize(x[i], mean[ch], invstd[ch], gamma[ch], beta[ch]);
  }
};

// dx of element i from the statistics (the mean and the channels' invstd) and the sums over m
// elements per channel.
template <class I>
struct BnDx {
  Divisor<I> c, hw;
  double m;
  const float *x, *dy, *gamma;
  const double *mean, *invstd, *sdy, *sdyx;
  float* dx;
  TOWERS_HD void operator()(I i) const {
    body(c, hw, m, x, dy, gamma, mean, invstd, sdy, sdyx, dx, i);
  }
  static TOWERS_HD void body(const Divisor<I>& c, const Divisor<I>& hw, double m,
                             const float* __restrict__ x, const float* __restrict__ dy,
                             const float* __restrict__ gamma, const double* __restrict__ mean,
                             const double* __restrict__ invstd, const double* __restrict__ sdy,
                             const double* __restrict__ sdyx, float* __restrict__ dx, I i) {
    const I ch = channel_of(c, hw, i);
    const double is = invstd[ch];
    dx[i] = bn_dx(dy[i], bn_xhat(x[i], mean[ch], is), m, static_cast<double>(gamma[ch]) * is,
                  sdy[ch], sdyx[ch]);
  }
};

// The call's scratch (batchnorm_work_doubles): two sets of lane sums, then three per-channel
// values.
struct BnWork {
  double *a, *b, *sdy, *sdyx, *invstd;
};
BnWork bn_work(int64_t c, double* work) {
  double* lanes = work + 2 * c * kBnLanes;
  return {work, work + c * kBnLanes, lanes, lanes + c, lanes + 2 * c};
}

int64_t lanes_of(const BnShape& s) { return s.c * kBnLanes; }

// out[ch] = the sum over channel ch of x, or (center non-null) of (x - center[ch])^2, divided
// by `divisor`; `lanes` holds C x kBnLanes doubles.
void channel_sums(CUstream_st* st, const BnShape& s, const float* x, const double* center,
                  double divisor, double* out, double* lanes) {
  for_each_index(st, lanes_of(s), BnLaneSums{s, x, center, lanes}, lane_block(s));
  for_each_index(st, s.c, BnLaneTotals{lanes, divisor, out});
}

// The batch mean and biased variance of every channel.
void moments(CUstream_st* st, const BnShape& s, const float* x, double* mean, double* var,
             const BnWork& w) {
  const double m = static_cast<double>(s.n * s.hw);
  channel_sums(st, s, x, nullptr, m, mean, w.a);
  channel_sums(st, s, x, mean, m, var, w.a);
}

void backward_sums(CUstream_st* st, const BnShape& s, const float* x, const float* dy,
                   const double* mean, const double* var, double* sdy, double* sdyx,
                   const BnWork& w) {
  for_each_index(st, lanes_of(s), BnBackwardLaneSums{s, x, dy, mean, var, w.a, w.b}, lane_block(s));
  for_each_index(st, s.c, BnLaneTotals{w.a, 1.0, sdy});
  for_each_index(st, s.c, BnLaneTotals{w.b, 1.0, sdyx});
}

// For every element of (n, C, HW), the functor make(c, hw) builds from the shape's divisors, at
// the narrower index width where it fits.
template <class Make>
void for_each_element(CUstream_st* st, const BnShape& s, Make make) {
  const int64_t count = s.n * s.c * s.hw;
  launch_narrow_or_wide(st, count, fits_int32_indices(count), [&](auto i) {
    using I = decltype(i);
    return make(Divisor<I>(static_cast<I>(s.c)), Divisor<I>(static_cast<I>(s.hw)));
  });
}

// y from the statistics mean and var; invstd: C doubles of scratch.
template <class Stat>
void normalize(CUstream_st* st, const BnShape& s, const float* x, const float* gamma,
               const float* beta, const Stat* mean, const Stat* var, float* y, double* invstd) {
  for_each_index(st, s.c, BnInvstd<Stat>{var, s.eps, invstd});
  for_each_element(st, s, [&](auto c, auto hw) {
    using I = decltype(c.value());
    return BnNormalize<I, Stat>{c, hw, x, gamma, beta, mean, invstd, y};
  });
}

// The per-channel outputs from `stats`' statistics and the sums own_sdy, own_sdyx; dx (where
// wanted) from the sums sdy, sdyx over m elements per channel. invstd: C doubles of scratch.
void outputs_and_dx(CUstream_st* st, const BnShape& s, const BnShape& stats, double m,
                    const float* x, const float* dy, const float* gamma, const double* mean,
                    const double* var, const double* sdy, const double* sdyx, const double* own_sdy,
                    const double* own_sdyx, const float* running_mean, const float* running_var,
                    const BnGrads& g, double* invstd) {
  for_each_index(
      st, s.c,
      BnOutputs{stats, mean, var, own_sdy, own_sdyx, running_mean, running_var, g, invstd});
  if (g.dx == nullptr) return;
  for_each_element(st, s, [&](auto c, auto hw) {
    using I = decltype(c.value());
    return BnDx<I>{c, hw, m, x, dy, gamma, mean, invstd, sdy, sdyx, g.dx};
  });
}

}  // namespace

void batchnorm_forward_train(CUstream_st* st, const BnShape& s, const float* x, const float* gamma,
                             const float* beta, float* y, double* mean, double* var, double* work) {
  if (s.c == 0 || s.n * s.hw == 0) return;
  const BnWork w = bn_work(s.c, work);
  moments(st, s, x, mean, var, w);
  normalize(st, s, x, gamma, beta, mean, var, y, w.invstd);
}

void batchnorm_forward_eval(CUstream_st* st, const BnShape& s, const float* x, const float* gamma,
                            const float* beta, const float* mean, const float* var, float* y,
                            double* work) {
  normalize(st, s, x, gamma, beta, mean, var, y, bn_work(s.c, work).invstd);
}

void batchnorm_backward(CUstream_st* st, const BnShape& s, const float* x, const float* dy,
                        const float* gamma, const double* mean, const double* var,
                        const float* running_mean, const float* running_var, const BnGrads& g,
                        double* work) {
  if (s.c == 0 || s.n * s.hw == 0) return;
  const BnWork w = bn_work(s.c, work);
  backward_sums(st, s, x, dy, mean, var, w.sdy, w.sdyx, w);
  outputs_and_dx(st, s, s, static_cast<double>(s.n * s.hw), x, dy, gamma, mean, var, w.sdy, w.sdyx,
                 w.sdy, w.sdyx, running_mean, running_var, g, w.invstd);
}

void batchnorm_channel_sums(CUstream_st* st, const BnShape& s, const float* x, const double* center,
                            double* out, double* work) {
  if (s.c == 0) return;
  channel_sums(st, s, x, center, 1.0, out, bn_work(s.c, work).a);
}

void batchnorm_forward_with(CUstream_st* st, const BnShape& s, const float* x, const float* gamma,
                            const float* beta, const double* mean, const double* var, float* y,
                            double* work) {
  normalize(st, s, x, gamma, beta, mean, var, y, bn_work(s.c, work).invstd);
}

void batchnorm_backward_sums(CUstream_st* st, const BnShape& s, const float* x, const float* dy,
                             const double* mean, const double* var, double* sdy, double* sdyx,
                             double* work) {
  if (s.c == 0) return;
  backward_sums(st, s, x, dy, mean, var, sdy, sdyx, bn_work(s.c, work));
}

void batchnorm_backward_with(CUstream_st* st, const BnShape& s, double m, const float* x,
                             const float* dy, const float* gamma, const double* mean,
                             const double* var, const double* sdy, const double* sdyx,
                             const double* own_sdy, const double* own_sdyx,
                             const float* running_mean, const float* running_var, const BnGrads& g,
                             double* work) {
  if (s.c == 0) return;
  BnShape global = s;  // the state deltas' unbiased variance counts the global batch
  global.n = static_cast<int64_t>(m) / s.hw;
  outputs_and_dx(st, s, global, m, x, dy, gamma, mean, var, sdy, sdyx, own_sdy, own_sdyx,
                 running_mean, running_var, g, bn_work(s.c, work).invstd);
}

}  // namespace towers::kernels::cuda
