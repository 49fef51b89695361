// gradcheck.h — the one numerical gradient checker every layer test uses.
// Central differences with the loss accumulated in double. Kink guard: where the one-sided
// differences disagree (the step crossed a ReLU or max-pool kink), the coordinate is skipped
// and counted, since neither side is the true derivative there. Resolution guard: where the
// central differences at eps and eps / 2 disagree by more than a quarter of the tolerance,
// the numeric derivative is not resolved (a kink the first guard missed, or float rounding of
// the loss that depends on the machine's BLAS kernels), and the coordinate is skipped and
// counted too.
// Callers require a minimum number of checked coordinates, so a check cannot pass on nothing.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "layers/layer.h"
#include "towers/tower.h"

namespace towers::testing {

struct GradCheckResult {
  int64_t checked = 0, skipped_kinks = 0;  // skipped: either guard
  double max_error = 0.0;  // max over checked of |analytic - numeric| / (atol + rtol * scale)
  std::string worst;       // description of the worst coordinate
  std::string label;       // the tensor checked
  double max_abs_analytic = 0.0;  // the largest |analytic| over the coordinates sampled
  int64_t over = 0;        // checked coordinates beyond the tolerance (max_error > 1)
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
// checked (input, then each trainable variable; state is not a function the loss depends on).
std::vector<GradCheckResult> check_layer(const Layer& layer, int64_t n, uint64_t seed,
                                         int64_t samples_per_tensor = 200);

// The whole cifar10 net's gradient through a tower (CPU or GPU, with batch >= 2), against
// central differences of the tower's own evaluation: parameters from seed 3 with larger
// logits weights (so the early layers' loss is not flat), two random images; coordinates are
// drawn 24 at a time (up to 192) until 8 per variable have passed both guards of
// check_gradient; the rest are counted as skipped. Every checked coordinate must match, but of
// a convolution's weights one in ten (at least one) may lie up to twice the tolerance off: the
// loss is piecewise linear
// (ReLU, max-pool), and conv1's weights each move every position of their channel, so a kink
// closer than any step the float loss resolves can move a difference quotient by most of the
// slope's jump at all usable steps alike, where the guards cannot see it (seen: conv1/weight
// with an analytic 0.0570 and central differences of 0.0539, 0.0542 and 0.0539 at steps of
// 2e-3, 1e-3 and 5e-4, 1.02 of the tolerance). A wrong gradient is off at most coordinates.
// analytic_scale multiplies the tower's gradient before the comparison: a test of the check
// itself sets it off 1 and expects failures.
void expect_cifar10_gradients_match_numerical(Tower& tower, float analytic_scale = 1.0f);

}  // namespace towers::testing
