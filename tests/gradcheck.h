// gradcheck.h — the one numerical gradient checker every layer test uses.
// Central differences with the loss accumulated in double. Kink guard: where the one-sided
// differences disagree (the step crossed a ReLU or max-pool kink), the coordinate is skipped
// and counted, since neither side is the true derivative there.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "layers/layer.h"

namespace towers::testing {

struct GradCheckResult {
  int64_t checked = 0, skipped_kinks = 0;
  double max_error = 0.0;  // max over checked of |analytic - numeric| / (atol + rtol * scale)
  std::string worst;       // description of the worst coordinate
  bool ok() const { return max_error <= 1.0; }
};

// loss() reads x; x[i] is perturbed in place by +-eps and restored.
GradCheckResult check_gradient(const std::function<double()>& loss, float* x,
                               const float* analytic, const std::vector<int64_t>& indices,
                               const std::string& label, float eps = 1e-3f, double atol = 1e-4,
                               double rtol = 2e-2);

// Up to `count` indices spread over [0, n) (all of them when n <= count).
std::vector<int64_t> sample_indices(int64_t n, int64_t count, uint64_t seed);

// Checks d(sum(y * r))/d(x, w, b) of a bound layer on a random batch of n examples:
// random inputs in [-1, 1], random parameters, random r. Returns one result per tensor
// checked (input, then each variable).
std::vector<GradCheckResult> check_layer(const Layer& layer, int64_t n, uint64_t seed,
                                         int64_t samples_per_tensor = 200);

}  // namespace towers::testing
