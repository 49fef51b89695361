// augment.h — per-example transforms, following distorted_inputs / inputs of the TensorFlow
// CIFAR-10 tutorial (cifar10_input.py). Pixels stay on the 0..255 scale as floats, as in the
// tutorial: random brightness deltas are in those units, and standardization rescales anyway.
#pragma once

#include <cstdint>

#include "core/rng.h"
#include "core/tensor.h"
#include "data/dataset.h"
#include "kernels/augment.h"

namespace towers::data {

struct AugmentConfig {
  int64_t out_h = 0, out_w = 0;  // crop size: 24x24 for the tutorial's CIFAR-10 net
  int64_t pad = 0;               // zero padding on every side before the random crop
  bool random_crop = false;      // off: the eval center crop is used for training as well
  bool flip = false;             // left-right with probability 1/2
  bool brightness = false;       // x + delta, delta ~ U[-max_brightness_delta, +max]
  bool contrast = false;         // (x - mean_c) * f + mean_c, f ~ U[lower, upper], per channel
  float max_brightness_delta = 63;
  float contrast_lower = 0.2f, contrast_upper = 1.8f;
  bool standardize = true;  // tf.image.per_image_standardization, last
};

// The tutorial's training transform for a crop of out x out.
AugmentConfig tutorial_train_config(int64_t out);
// The tutorial's eval transform: center crop and standardize, nothing random.
AugmentConfig tutorial_eval_config(int64_t out);

// Throws towers::Error naming the dataset when the config cannot apply to it.
void validate(const AugmentConfig& config, const Dataset& data);

// One example's float shape and size: (C, out_h, out_w).
Shape example_shape(const AugmentConfig& config, const Dataset& data);
int64_t example_floats(const AugmentConfig& config, const Dataset& data);

// Random training transform of example `index`. Every draw comes from rng, in a fixed order
// whatever the flags, so a caller that seeds rng from (seed, epoch, position) gets the same
// output on any thread. out: (C, out_h, out_w). It is apply_plan(plan_train(...)).
void augment_train(const AugmentConfig& config, const Dataset& data, int64_t index, Rng& rng,
                   float* out);

// The two halves of augment_train: the draws (the plan, which --input device hands to the GPU,
// kernels::cuda::augment), and the pixels made from them.
using ExamplePlan = kernels::ExamplePlan;
ExamplePlan plan_train(const AugmentConfig& config, const Dataset& data, int64_t index, Rng& rng);
void apply_plan(const AugmentConfig& config, const Dataset& data, const ExamplePlan& plan,
                float* out);
// What kernels::cuda::augment needs to apply plans of this config to this data.
kernels::AugmentShape augment_shape(const AugmentConfig& config, const Dataset& data);

// Deterministic eval transform: center crop (padding with zeros where out is larger than the
// image, as tf.image.resize_image_with_crop_or_pad does), then standardize if asked.
void transform_eval(const AugmentConfig& config, const Dataset& data, int64_t index, float* out);

}  // namespace towers::data
