// optimizer_rules.h — the per-element optimizer rules that kernels/cpu/optimizer.cpp loops over
// and kernels/cuda/optimizer.cu runs one thread per element: one formula for both twins. The
// formulas and their TF v1 semantics are documented in kernels/optimizer.h; g' = g + wd * w.
// The expressions are the contract: the CPU updates (and so checkpoint resume) stay bitwise
// what they were only while each rule keeps its operations and their order. Both compilers may
// contract a * b + c into an FMA (g++'s C++ default is -ffp-contract=fast, nvcc's --fmad=true),
// each with its own choice of pairs; so the files that run these rules are built with
// contraction off (-ffp-contract=off, --fmad=false: CMakeLists.txt), and the CPU loop, the CUDA
// kernel and the rule round identically.
#pragma once

#include <math.h>  // sqrtf (host); nvcc provides the device sqrtf

#include "kernels/hd.h"

namespace towers::kernels {

// w -= lr * g'
TOWERS_HD void sgd_rule(float& w, float g, float lr, float wd) { w -= lr * (g + wd * w); }

// a = mu * a + g';  w -= lr * a  (Nesterov: w -= lr * (g' + mu * a))
TOWERS_HD void momentum_rule(float& w, float& a, float g, float lr, float mu, bool nesterov,
                             float wd) {
  const float gi = g + wd * w;
  a = mu * a + gi;
  w -= nesterov ? lr * (gi + mu * a) : lr * a;
}

// acc += g'^2;  w -= lr * g' / sqrt(acc)
TOWERS_HD void adagrad_rule(float& w, float& acc, float g, float lr, float wd) {
  const float gi = g + wd * w;
  acc += gi * gi;
  w -= lr * gi / sqrtf(acc);
}

// m = b1 m + (1-b1) g';  v = b2 v + (1-b2) g'^2;  w -= lr_t * m / (sqrt(v) + eps)
TOWERS_HD void adam_rule(float& w, float& m, float& v, float g, float lr_t, float b1, float b2,
                         float eps, float wd) {
  const float gi = g + wd * w;
  m = b1 * m + (1.0f - b1) * gi;
  v = b2 * v + (1.0f - b2) * gi * gi;
  w -= lr_t * m / (sqrtf(v) + eps);
}

// ms = rho ms + (1-rho) g'^2;  mom = mu mom + lr g' / sqrt(ms + eps);  w -= mom
TOWERS_HD void rmsprop_rule(float& w, float& ms, float& mom, float g, float lr, float rho, float mu,
                            float eps, float wd) {
  const float gi = g + wd * w;
  ms = rho * ms + (1.0f - rho) * gi * gi;
  mom = mu * mom + lr * gi / sqrtf(ms + eps);
  w -= mom;
}

}  // namespace towers::kernels
