// standardize.h — tf.image.per_image_standardization:
//   y = (x - mean) / max(stddev, 1 / sqrt(numel)), mean and stddev over the whole image.
#pragma once

#include <cstdint>

#include "kernels/hd.h"

namespace towers::kernels {

namespace cpu {

// n images of m floats each; in place is allowed (x == y).
void standardize(int64_t n, int64_t m, const float* x, float* y);

}  // namespace cpu

namespace cuda {
// One block per image; sums in double.
void standardize(CUstream_st* s, int64_t n, int64_t m, const float* x, float* y);
}  // namespace cuda

}  // namespace towers::kernels
