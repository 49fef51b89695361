// standardize_rules.h — the rules of cuda::standardize (kernels/cuda/standardize.cu), one block
// per image: each thread's partial sums over its strided share of the image, the mean and
// inverse scale from the block's totals, and the element-wise normalisation. The kernel joins
// the partials with a CUB block reduction. Plain C++17 with TOWERS_HD: compiled by g++ without
// CUDA headers as well as by nvcc.
#pragma once

#include <cmath>  // sqrt (host); nvcc provides the device sqrt
#include <cstdint>

#include "kernels/hd.h"

namespace towers::kernels::cuda {

// std::max for doubles, usable on the device.
TOWERS_HD double standardize_max(double a, double b) { return a < b ? b : a; }

// Thread t of `threads`: sum and sum of squares, in double, of the image's elements
// i = t, t + threads, ... of its m floats x. nvcc contracts ss + v * v into an fma; that rounds
// as the host does, since the square of a float is exact in double.
TOWERS_HD void standardize_partial(int64_t m, const float* x, int64_t t, int64_t threads,
                                   double& sum, double& sumsq) {
  double s = 0.0, ss = 0.0;
  for (int64_t i = t; i < m; i += threads) {
    const double v = x[i];
    s += v, ss += v * v;
  }
  sum = s;
  sumsq = ss;
}

// The image's mean and 1 / max(stddev, 1 / sqrt(m)) from its totals, as cpu::standardize forms
// them (in double, then rounded to float).
TOWERS_HD void standardize_stats(double sum, double sumsq, int64_t m, float& mean, float& inv) {
  const double mu = sum / m;
  const double var = standardize_max(sumsq / m - mu * mu, 0.0);
  const double adj = standardize_max(sqrt(var), 1.0 / sqrt(static_cast<double>(m)));
  mean = static_cast<float>(mu);
  inv = static_cast<float>(1.0 / adj);
}

// One element: (x - mean) * inv.
TOWERS_HD float standardize_at(float x, float mean, float inv) { return (x - mean) * inv; }

}  // namespace towers::kernels::cuda
