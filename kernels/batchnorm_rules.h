// batchnorm_rules.h — the per-channel rules of batch normalization (kernels/batchnorm.h), run by
// the CPU loop (kernels/cpu/batchnorm.cpp), the CUDA kernels (kernels/cuda/batchnorm.cu, a
// thread per lane of every channel) and the emulator. Plain C++17 with TOWERS_HD.
//
// Element j of channel ch (j in [0, n x HW)) is x[((j / HW) x C + ch) x HW + j % HW]. A
// channel sum is taken in kBnLanes lanes: lane l adds the elements j = l, l + kBnLanes, ... in
// order, in double; then the lanes are added in order 0, 1, ... (bn_lanes_total). A CUDA thread
// walks one lane (bn_lane_sum), the CPU walks the same lanes (bn_channel_lanes), so the sums
// agree bitwise.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/batchnorm.h"
#include "kernels/hd.h"

namespace towers::kernels {

TOWERS_HD int64_t bn_index(const BnShape& s, int64_t ch, int64_t j) {
  return ((j / s.hw) * s.c + ch) * s.hw + j % s.hw;
}

TOWERS_HD double bn_lanes_total(const double* lanes) {
  double t = 0.0;
  for (int l = 0; l < kBnLanes; ++l) t += lanes[l];
  return t;
}

TOWERS_HD double bn_invstd(double var, double eps) { return 1.0 / sqrt(var + eps); }

TOWERS_HD double bn_xhat(float x, double mean, double invstd) {
  return (static_cast<double>(x) - mean) * invstd;
}

// y of one element from its statistics (batch or running).
TOWERS_HD float bn_normalize(float x, double mean, double invstd, float gamma, float beta) {
  return static_cast<float>(bn_xhat(x, mean, invstd) * static_cast<double>(gamma) +
                            static_cast<double>(beta));
}

// dx of one element: gamma x invstd / m x (m dy - sum dy - xhat sum(dy xhat)).
TOWERS_HD float bn_dx(float dy, double xhat, double m, double gamma_invstd, double sdy,
                      double sdyx) {
  const double inner = m * static_cast<double>(dy) - sdy - xhat * sdyx;
  return static_cast<float>(gamma_invstd / m * inner);
}

// The unbiased variance the running average follows (the biased one of a single element).
TOWERS_HD double bn_unbiased(double var, double m) { return m > 1.0 ? var * m / (m - 1.0) : var; }

// ---- one lane of one channel, on one thread (a CUDA thread's share) --------------------------

// Lane l of channel ch: its elements j = l, l + kBnLanes, ... below n x HW, in order, as offsets
// into (n, C, HW), by additions alone. From j to j + kBnLanes the example moves on by
// kBnLanes / HW and the position by kBnLanes % HW, carrying once where the position passes HW;
// one division per lane where bn_index takes two per element.
struct BnLane {
  int64_t left = 0;          // elements still to visit
  int64_t plane = 0, p = 0;  // the offset of (example, ch)'s plane, and the position in it
  int64_t hw = 1, cplane = 0, skip = 0, dp = 0;  // HW; C x HW; planes passed per step; the rest
  TOWERS_HD int64_t next() {
    const int64_t o = plane + p;
    plane += skip;
    p += dp;
    if (p >= hw) {
      p -= hw;
      plane += cplane;
    }
    --left;
    return o;
  }
};

TOWERS_HD BnLane bn_lane(const BnShape& s, int64_t ch, int64_t l) {
  BnLane w;
  const int64_t m = s.n * s.hw;
  if (l >= m) return w;  // no elements (HW may be 0): nothing to walk
  w.left = (m - l + kBnLanes - 1) / kBnLanes;
  w.hw = s.hw;
  w.cplane = s.c * s.hw;
  const int64_t e = l / s.hw, per = kBnLanes / s.hw;
  w.p = l - e * s.hw;
  w.plane = (e * s.c + ch) * s.hw;
  w.skip = per * w.cplane;
  w.dp = kBnLanes - per * s.hw;
  return w;
}

// How many of a lane's loads a thread issues before it adds them: a lane is a chain of
// dependent additions, and the loads ahead of it keep memory busy. A lane of 392 elements
// (24 channels of 128 x 28 x 28) waits for memory 25 times, one of 25 elements twice.
inline constexpr int kBnBatch = 16;

// Lane l of channel ch's sum of x - center, or (squares) of (x - center)^2: bn_channel_lanes's
// lane l, bit for bit.
TOWERS_HD double bn_lane_sum(const BnShape& s, int64_t ch, int64_t l, const float* __restrict__ x,
                             double center, bool squares) {
  BnLane w = bn_lane(s, ch, l);
  double a = 0.0;
  while (w.left > 0) {
    const int64_t k_n = w.left < kBnBatch ? w.left : kBnBatch;
    float v[kBnBatch];
    TOWERS_UNROLL
    for (int k = 0; k < kBnBatch; ++k)
      if (k < k_n) v[k] = x[w.next()];
    TOWERS_UNROLL
    for (int k = 0; k < kBnBatch; ++k)
      if (k < k_n) {
        const double d = static_cast<double>(v[k]) - center;
        a += squares ? d * d : d;
      }
  }
  return a;
}

// Lane l of channel ch's sums of dy and of dy x xhat: bn_channel_backward_sums's lane l.
TOWERS_HD void bn_lane_backward_sums(const BnShape& s, int64_t ch, int64_t l,
                                     const float* __restrict__ x, const float* __restrict__ dy,
                                     double mean, double invstd, double& sdy, double& sdyx) {
  BnLane w = bn_lane(s, ch, l);
  double a = 0.0, b = 0.0;
  while (w.left > 0) {
    const int64_t k_n = w.left < kBnBatch ? w.left : kBnBatch;
    float xv[kBnBatch], gv[kBnBatch];
    TOWERS_UNROLL
    for (int k = 0; k < kBnBatch; ++k)
      if (k < k_n) {
        const int64_t o = w.next();
        xv[k] = x[o];
        gv[k] = dy[o];
      }
    TOWERS_UNROLL
    for (int k = 0; k < kBnBatch; ++k)
      if (k < k_n) {
        const double g = static_cast<double>(gv[k]);
        a += g;
        b += g * bn_xhat(xv[k], mean, invstd);
      }
  }
  sdy = a;
  sdyx = b;
}

// ---- one channel, lane by lane, on one thread (the CPU loop and the emulator) ----------------

// Calls f(example, first lane, first position in its plane, count) for the runs of each
// example's HW elements that land on consecutive lanes: element j goes to lane j % kBnLanes,
// so a run ends where the lanes wrap.
// Walking the examples in order keeps each lane's additions in order j = l, l + kBnLanes, ...;
// the runs only let the compiler vectorize across lanes.
template <class F>
inline void bn_channel_runs(const BnShape& s, F&& f) {
  int64_t l = 0;
  for (int64_t e = 0; e < s.n; ++e) {
    for (int64_t i = 0; i < s.hw;) {
      const int64_t len = std::min<int64_t>(s.hw - i, kBnLanes - l);
      f(e, l, i, len);
      i += len;
      l = l + len == kBnLanes ? 0 : l + len;
    }
  }
}

// The lane sums of x, or (squares) of (x - mean)^2.
inline void bn_channel_lanes(const BnShape& s, int64_t ch, const float* x, double mean,
                             bool squares, double* lanes) {
  for (int l = 0; l < kBnLanes; ++l) lanes[l] = 0.0;
  bn_channel_runs(s, [&](int64_t e, int64_t l, int64_t i, int64_t len) {
    const float* xe = x + (e * s.c + ch) * s.hw + i;
    double* a = lanes + l;
    if (squares) {
      for (int64_t k = 0; k < len; ++k) {
        const double d = static_cast<double>(xe[k]) - mean;
        a[k] += d * d;
      }
    } else {
      for (int64_t k = 0; k < len; ++k) a[k] += static_cast<double>(xe[k]) - mean;
    }
  });
}

// The batch mean and biased variance of channel ch.
inline void bn_channel_moments(const BnShape& s, int64_t ch, const float* x, double& mean,
                               double& var) {
  double lanes[kBnLanes];
  const double m = static_cast<double>(s.n * s.hw);
  bn_channel_lanes(s, ch, x, 0.0, false, lanes);
  mean = bn_lanes_total(lanes) / m;
  bn_channel_lanes(s, ch, x, mean, true, lanes);
  var = bn_lanes_total(lanes) / m;
}

// The lane sums of dy and of dy x xhat over channel ch.
inline void bn_channel_backward_sums(const BnShape& s, int64_t ch, const float* x, const float* dy,
                                     double mean, double invstd, double& sdy, double& sdyx) {
  double a[kBnLanes], b[kBnLanes];
  for (int l = 0; l < kBnLanes; ++l) a[l] = b[l] = 0.0;
  bn_channel_runs(s, [&](int64_t e, int64_t l, int64_t i, int64_t len) {
    const int64_t o = (e * s.c + ch) * s.hw + i;
    for (int64_t k = 0; k < len; ++k) {
      const double g = static_cast<double>(dy[o + k]);
      a[l + k] += g;
      b[l + k] += g * bn_xhat(x[o + k], mean, invstd);
    }
  });
  sdy = bn_lanes_total(a);
  sdyx = bn_lanes_total(b);
}

// y of channel ch from its statistics (the batch's, the running ones, a global batch's).
inline void bn_channel_normalize(const BnShape& s, int64_t ch, const float* x, double mean,
                                 double invstd, const float* gamma, const float* beta, float* y) {
  for (int64_t e = 0; e < s.n; ++e) {
    const int64_t o = (e * s.c + ch) * s.hw;
    for (int64_t i = 0; i < s.hw; ++i)
      y[o + i] = bn_normalize(x[o + i], mean, invstd, gamma[ch], beta[ch]);
  }
}

// dx of channel ch from the statistics and the sums of dy and dy x xhat over m elements.
inline void bn_channel_dx(const BnShape& s, int64_t ch, const float* x, const float* dy,
                          double mean, double invstd, double m, float gamma, double sdy,
                          double sdyx, float* dx) {
  const double gi = static_cast<double>(gamma) * invstd;
  for (int64_t e = 0; e < s.n; ++e) {
    const int64_t o = (e * s.c + ch) * s.hw;
    for (int64_t i = 0; i < s.hw; ++i)
      dx[o + i] = bn_dx(dy[o + i], bn_xhat(x[o + i], mean, invstd), m, gi, sdy, sdyx);
  }
}

// The whole training forward of channel ch; its batch statistics go to mean and var, for the
// backward.
inline void bn_channel_forward_train(const BnShape& s, int64_t ch, const float* x,
                                     const float* gamma, const float* beta, float* y, double& mean,
                                     double& var) {
  bn_channel_moments(s, ch, x, mean, var);
  bn_channel_normalize(s, ch, x, mean, bn_invstd(var, s.eps), gamma, beta, y);
}

inline void bn_channel_forward_eval(const BnShape& s, int64_t ch, const float* x,
                                    const float* gamma, const float* beta, const float* mean,
                                    const float* var, float* y) {
  bn_channel_normalize(s, ch, x, mean[ch], bn_invstd(var[ch], s.eps), gamma, beta, y);
}

// Writes channel ch's gradients and state deltas (the per-channel outputs of g are written by
// whoever finishes the channel's sums).
TOWERS_HD void bn_channel_outputs(const BnShape& s, int64_t ch, double mean, double var,
                                  double sdy, double sdyx, const float* running_mean,
                                  const float* running_var, const BnGrads& g) {
  const double m = static_cast<double>(s.n * s.hw), w = g.state_weight;
  if (g.dgamma != nullptr) g.dgamma[ch] = static_cast<float>(sdyx);
  if (g.dbeta != nullptr) g.dbeta[ch] = static_cast<float>(sdy);
  if (g.dmean != nullptr)
    g.dmean[ch] = static_cast<float>((mean - static_cast<double>(running_mean[ch])) * w);
  if (g.dvar != nullptr)
    g.dvar[ch] =
        static_cast<float>((bn_unbiased(var, m) - static_cast<double>(running_var[ch])) * w);
}

// The training backward of channel ch, from the forward's batch statistics mean and var.
inline void bn_channel_backward(const BnShape& s, int64_t ch, const float* x, const float* dy,
                                const float* gamma, double mean, double var,
                                const float* running_mean, const float* running_var,
                                const BnGrads& g) {
  double sdy, sdyx;
  const double invstd = bn_invstd(var, s.eps);
  bn_channel_backward_sums(s, ch, x, dy, mean, invstd, sdy, sdyx);
  bn_channel_outputs(s, ch, mean, var, sdy, sdyx, running_mean, running_var, g);
  if (g.dx != nullptr)
    bn_channel_dx(s, ch, x, dy, mean, invstd, static_cast<double>(s.n * s.hw), gamma[ch], sdy,
                  sdyx, g.dx);
}

}  // namespace towers::kernels
