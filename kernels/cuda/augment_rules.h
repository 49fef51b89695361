// augment_rules.h — the rules of cuda::augment (kernels/cuda/augment.cu): one output float of the
// crop window (the host makes its crop row by row, data/augment.cpp), and the contrast's rules,
// which the host's transform shares: a thread's partial sum of a channel, the mean, the contrast
// of one float.
// Plain C++17 with TOWERS_HD: compiled by g++ without CUDA headers as well as by nvcc.
#pragma once

#include <cmath>  // fmaf (host); nvcc provides the device fmaf
#include <cstdint>

#include "kernels/augment.h"
#include "kernels/hd.h"

namespace towers::kernels::cuda {

// Float (ch, y, x) of the example planned by p: its stored byte, or 0 outside the image, plus
// the brightness delta where asked.
TOWERS_HD float augment_pixel(const uint8_t* images, const AugmentShape& s, const ExamplePlan& p,
                              int64_t ch, int64_t y, int64_t x) {
  const int64_t sy = p.top + y;
  const int64_t sx = p.left + (p.flip ? s.out_w - 1 - x : x);
  float v = 0.0f;
  if (sy >= 0 && sy < s.height && sx >= 0 && sx < s.width)
    v = static_cast<float>(images[((p.index * s.channels + ch) * s.height + sy) * s.width + sx]);
  if (s.brightness) v += p.delta;
  return v;
}

// Thread t of `threads`: the sum, in double, of the plane's floats i = t, t + threads, ...
TOWERS_HD double contrast_partial(int64_t plane, const float* x, int64_t t, int64_t threads) {
  double s = 0.0;
  for (int64_t i = t; i < plane; i += threads) s += x[i];
  return s;
}

// The plane's mean, from its sum, as the host forms it.
TOWERS_HD float contrast_mean(double sum, int64_t plane) {
  return static_cast<float>(sum / static_cast<double>(plane));
}

// One float: (x - mean) * factor + mean, as one fused multiply-add on both sides. Built for the
// machine (-march=native, the default), the host's transform fused this expression anyway
// before the device twin existed; the explicit fmaf keeps that rounding and makes every build
// (with or without FMA contraction, nvcc's --fmad included) and the device round alike.
TOWERS_HD float contrast_at(float x, float mean, float factor) {
  return fmaf(x - mean, factor, mean);
}

}  // namespace towers::kernels::cuda
