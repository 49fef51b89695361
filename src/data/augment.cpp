#include "data/augment.h"

#include <algorithm>
#include <cmath>

#include "core/check.h"
#include "kernels/cuda/augment_rules.h"
#include "kernels/standardize.h"

namespace towers::data {
namespace {

// Copies the out_h x out_w window whose top-left corner is (top, left) in image coordinates;
// pixels outside the image are 0, which is how both the zero padding and the eval pad work.
void crop(const Dataset& d, int64_t index, int64_t top, int64_t left, bool flip, int64_t out_h,
          int64_t out_w, float* out) {
  const uint8_t* img = d.image(index);  // (C, H, W)
  for (int64_t c = 0; c < d.channels; ++c) {
    for (int64_t y = 0; y < out_h; ++y) {
      float* row = out + (c * out_h + y) * out_w;
      const int64_t sy = top + y;
      if (sy < 0 || sy >= d.height) {
        for (int64_t x = 0; x < out_w; ++x) row[x] = 0.0f;
        continue;
      }
      const uint8_t* src = img + (c * d.height + sy) * d.width;
      for (int64_t x = 0; x < out_w; ++x) {
        const int64_t sx = left + (flip ? out_w - 1 - x : x);
        row[x] = sx >= 0 && sx < d.width ? static_cast<float>(src[sx]) : 0.0f;
      }
    }
  }
}

// tf.image.resize_image_with_crop_or_pad: offset (size - target) / 2 when cropping,
// -((target - size) / 2) when padding.
int64_t center_offset(int64_t size, int64_t target) {
  return size >= target ? (size - target) / 2 : -((target - size) / 2);
}

}  // namespace

AugmentConfig tutorial_train_config(int64_t out) {
  AugmentConfig c;
  c.out_h = c.out_w = out;
  c.random_crop = c.flip = c.brightness = c.contrast = true;
  return c;
}

AugmentConfig tutorial_eval_config(int64_t out) {
  AugmentConfig c;
  c.out_h = c.out_w = out;
  return c;
}

void validate(const AugmentConfig& c, const Dataset& d) {
  TOWERS_REQUIRE(c.out_h > 0 && c.out_w > 0, "augmentation: crop size {}x{} must be positive",
                 c.out_h, c.out_w);
  TOWERS_REQUIRE(c.pad >= 0, "augmentation: padding {} must not be negative", c.pad);
  // A plan holds the crop window's corner in 32 bits.
  TOWERS_REQUIRE(c.pad <= (1 << 20) && c.out_h <= (1 << 20) && c.out_w <= (1 << 20),
                 "augmentation: padding {} or crop size {}x{} is too large (at most 2^20)", c.pad,
                 c.out_h, c.out_w);
  TOWERS_REQUIRE(
      !c.random_crop || (c.out_h <= d.height + 2 * c.pad && c.out_w <= d.width + 2 * c.pad),
      "augmentation: random crop {}x{} is larger than the images of '{}' ({}x{}) "
      "padded by {}",
      c.out_h, c.out_w, d.name, d.height, d.width, c.pad);
  TOWERS_REQUIRE(c.max_brightness_delta >= 0,
                 "augmentation: max brightness delta {} must not be negative",
                 c.max_brightness_delta);
  TOWERS_REQUIRE(c.contrast_lower >= 0 && c.contrast_lower <= c.contrast_upper,
                 "augmentation: contrast range [{}, {}] must satisfy 0 <= lower <= upper",
                 c.contrast_lower, c.contrast_upper);
}

Shape example_shape(const AugmentConfig& c, const Dataset& d) {
  return {d.channels, c.out_h, c.out_w};
}

int64_t example_floats(const AugmentConfig& c, const Dataset& d) {
  return d.channels * c.out_h * c.out_w;
}

ExamplePlan plan_train(const AugmentConfig& c, const Dataset& d, int64_t index, Rng& rng) {
  // All five draws always happen, so turning one distortion off leaves the others unchanged.
  // TF's random_crop: offsets uniform in [0, padded - out] (ranges clamp when not cropping).
  auto offsets = [](int64_t size, int64_t out) {
    return static_cast<uint64_t>(std::max<int64_t>(size - out + 1, 1));
  };
  const uint64_t top_draw = rng.below(offsets(d.height + 2 * c.pad, c.out_h));
  const uint64_t left_draw = rng.below(offsets(d.width + 2 * c.pad, c.out_w));
  const bool flip = rng.uniform() < 0.5f;
  // Rng::uniform(lo, hi) as one fused multiply-add, as the compiler formed it here in the
  // default build (-march=native) before the draws were split from the pixels. Explicit, since
  // GCC now vectorizes the two draws together and would round the product apart.
  auto draw = [&rng](float lo, float hi) { return std::fma(hi - lo, rng.uniform(), lo); };
  const float delta = draw(-c.max_brightness_delta, c.max_brightness_delta);
  const float factor = draw(c.contrast_lower, c.contrast_upper);
  ExamplePlan p;
  p.index = index;
  p.top = static_cast<int32_t>(c.random_crop ? static_cast<int64_t>(top_draw) - c.pad
                                             : center_offset(d.height, c.out_h));
  p.left = static_cast<int32_t>(c.random_crop ? static_cast<int64_t>(left_draw) - c.pad
                                              : center_offset(d.width, c.out_w));
  p.flip = c.flip && flip ? 1 : 0;
  p.delta = delta;
  p.factor = factor;
  return p;
}

kernels::AugmentShape augment_shape(const AugmentConfig& c, const Dataset& d) {
  kernels::AugmentShape s;
  s.channels = d.channels;
  s.height = d.height;
  s.width = d.width;
  s.out_h = c.out_h;
  s.out_w = c.out_w;
  s.brightness = c.brightness;
  s.contrast = c.contrast;
  s.standardize = c.standardize;
  return s;
}

// Row by row here; the device makes each float alone (kernels::cuda::augment_pixel). The
// contrast shares the device's rules; its mean sums in order here, in a block tree there, both
// in double.
void apply_plan(const AugmentConfig& c, const Dataset& d, const ExamplePlan& p, float* out) {
  crop(d, p.index, p.top, p.left, p.flip != 0, c.out_h, c.out_w, out);  // checks the index
  const int64_t plane = c.out_h * c.out_w;
  const int64_t m = d.channels * plane;
  if (c.brightness)
    for (int64_t i = 0; i < m; ++i) out[i] += p.delta;
  if (c.contrast) {
    for (int64_t ch = 0; ch < d.channels; ++ch) {
      float* q = out + ch * plane;
      const float mean = kernels::cuda::contrast_mean(kernels::cuda::contrast_partial(plane, q, 0, 1), plane);
      for (int64_t i = 0; i < plane; ++i) q[i] = kernels::cuda::contrast_at(q[i], mean, p.factor);
    }
  }
  if (c.standardize) kernels::cpu::standardize(1, m, out, out);
}

void augment_train(const AugmentConfig& c, const Dataset& d, int64_t index, Rng& rng, float* out) {
  apply_plan(c, d, plan_train(c, d, index, rng), out);
}

void transform_eval(const AugmentConfig& c, const Dataset& d, int64_t index, float* out) {
  crop(d, index, center_offset(d.height, c.out_h), center_offset(d.width, c.out_w), false, c.out_h,
       c.out_w, out);
  if (c.standardize) kernels::cpu::standardize(1, example_floats(c, d), out, out);
}

}  // namespace towers::data
