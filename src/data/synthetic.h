// synthetic.h — a learnable stand-in for a real dataset, for tests and benchmarks that must
// run anywhere. Each class has a fixed smooth random prototype image; an example is its
// class prototype plus per-pixel Gaussian noise, clamped to 0..255. Smooth prototypes keep
// their class identity under random crops and flips, so training on it drives loss down.
#pragma once

#include <cstdint>

#include "data/dataset.h"

namespace towers::data {

// A pure function of its arguments (any thread count gives the same bytes). Train and test
// share the prototypes but draw different examples. Labels are uniform random per example.
DataSplit make_synthetic(int64_t channels, int64_t height, int64_t width, int num_classes,
                         int64_t train_size, int64_t test_size, uint64_t seed);

}  // namespace towers::data
