// augment.h — the training transform of data/augment.h made on the device (--input device).
// The host draws each example's plan (which example, where its crop window lies, whether it is
// flipped, its brightness and contrast draws) exactly as it does for a batch of pixels; the
// device holds the training set as bytes and makes the pixels from the plans. The rules are in
// kernels/augment_rules.h.
#pragma once

#include <cstdint>

#include "kernels/hd.h"

namespace towers::kernels {

// One example of a training batch and the draws of its transform.
struct ExamplePlan {
  int64_t index = 0;          // in the training set
  int32_t top = 0, left = 0;  // the crop window's top-left corner in image coordinates
                              // (negative, or past the edge: those pixels are 0)
  int32_t flip = 0;           // 1: left-right
  float delta = 0.0f;         // brightness: added to every pixel
  float factor = 1.0f;        // contrast: (x - channel mean) * factor + channel mean
  int32_t unused = 0;
};
static_assert(sizeof(ExamplePlan) == 32, "a step copies 32 bytes per example");

// The stored images, the crop, and which of the draws apply.
struct AugmentShape {
  int64_t channels = 0, height = 0, width = 0;  // the stored images (N, C, H, W), bytes
  int64_t out_h = 0, out_w = 0;                 // an example out: (C, out_h, out_w) floats
  bool brightness = false, contrast = false, standardize = false;
};

namespace cuda {

// Makes n examples from their plans (device memory) into out, (n, C, out_h, out_w): crop and
// flip (one thread per float), brightness, then contrast (one block per channel of an example)
// and per-image standardization (cuda::standardize), where the shape asks for them.
void augment(CUstream_st* s, const uint8_t* images, const AugmentShape& shape,
             const ExamplePlan* plans, int64_t n, float* out);

// The contrast step alone: for each of the n * channels planes of `plane` floats of x, in place,
// (x - mean) * factor + mean, the mean over the plane (in double, rounded to float) and the
// factor of the plane's example.
void contrast(CUstream_st* s, int64_t n, int64_t channels, int64_t plane,
              const ExamplePlan* plans, float* x);

}  // namespace cuda

}  // namespace towers::kernels
