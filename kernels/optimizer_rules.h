// optimizer_rules.h — the per-element optimizer rules that kernels/cpu/optimizer.cpp loops over
// and kernels/cuda/optimizer.cu runs one thread per element: one formula for both twins, and
// the one list of rules (OptRule, Rule<R>, with_rule) that both twins dispatch on. A new rule
// is a formula, an OptRule value, a Rule<R> and a case of with_rule, all in this file. The
// formulas and their TF v1 semantics are documented in kernels/optimizer.h; g' = g + wd * w.
// The expressions are the contract: the CPU updates (and so checkpoint resume) stay bitwise
// what they were only while each rule keeps its operations and their order. Both compilers may
// contract a * b + c into an FMA (g++'s C++ default is -ffp-contract=fast, nvcc's --fmad=true),
// each with its own choice of pairs; so the files that run these rules are built with
// contraction off (-ffp-contract=off, --fmad=false: CMakeLists.txt), and the CPU loop, the CUDA
// kernel and the rule round identically.
#pragma once

#include <math.h>  // sqrtf (host); nvcc provides the device sqrtf
#include <stdint.h>

#include <stdexcept>

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

// ---- what runs beside a rule -------------------------------------------------------------------
// In double, rounded once: the CPU store (optim/optimizer.cpp) and the device replicas
// (towers/mirrored_store.cpp) take these steps with the same bits.

// A state variable's running average (ParamSpec::state_rate): state + rate x delta.
TOWERS_HD float state_step(float state, float rate, float delta) {
  return static_cast<float>(static_cast<double>(state) +
                            static_cast<double>(rate) * static_cast<double>(delta));
}
// Lookahead's move of the slow weight alpha of the way to the fast one (both then take it).
TOWERS_HD float lookahead_step(float slow, float fast, double alpha) {
  const double s = slow;
  return static_cast<float>(s + alpha * (static_cast<double>(fast) - s));
}
// The exponential moving average's step at decay d.
TOWERS_HD float ema_step(float average, float w, double d) {
  return static_cast<float>(d * static_cast<double>(average) + (1.0 - d) * static_cast<double>(w));
}

// The scalars of the wrappers' steps of update t (optim/optimizer.h, OptimizerConfig::ema and
// lookahead_k).
struct WrapperArgs {
  int32_t first = 0;          // t == 1: the wrappers' slots start as the parameters
  int32_t lookahead_now = 0;  // t is a multiple of k: the slow weights move, the fast restart
  double alpha = 0.0;         // Lookahead's alpha
  double decay = 0.0;         // the average's decay at t: min(ema, (1 + t) / (10 + t))
};

// ---- dispatch ----------------------------------------------------------------------------------

enum class OptRule { Sgd, Momentum, Adagrad, Adam, Rmsprop };

// The scalars of one update of one variable; a rule reads the ones it needs.
struct RuleArgs {
  OptRule rule = OptRule::Sgd;
  float lr = 0.0f;      // adam: lr_t, the bias-corrected rate
  float mu = 0.0f;      // momentum, rmsprop
  bool nesterov = false;
  float b1 = 0.0f, b2 = 0.0f;  // adam
  float rho = 0.0f;     // rmsprop
  float eps = 0.0f;     // adam, rmsprop
  float wd = 0.0f;      // the variable's weight decay
};

// Rule<R>::at(i, ...) applies rule R to element i; kSlots slot arrays are read (the others
// may be null).
template <OptRule R>
struct Rule;

template <>
struct Rule<OptRule::Sgd> {
  static constexpr int kSlots = 0;
  TOWERS_HD static void at(int64_t i, float* w, float*, float*, const float* __restrict__ g,
                           const RuleArgs& a) {
    sgd_rule(w[i], g[i], a.lr, a.wd);
  }
};

template <>
struct Rule<OptRule::Momentum> {
  static constexpr int kSlots = 1;
  TOWERS_HD static void at(int64_t i, float* w, float* s0, float*, const float* __restrict__ g,
                           const RuleArgs& a) {
    momentum_rule(w[i], s0[i], g[i], a.lr, a.mu, a.nesterov, a.wd);
  }
};

template <>
struct Rule<OptRule::Adagrad> {
  static constexpr int kSlots = 1;
  TOWERS_HD static void at(int64_t i, float* w, float* s0, float*, const float* __restrict__ g,
                           const RuleArgs& a) {
    adagrad_rule(w[i], s0[i], g[i], a.lr, a.wd);
  }
};

template <>
struct Rule<OptRule::Adam> {
  static constexpr int kSlots = 2;
  TOWERS_HD static void at(int64_t i, float* w, float* s0, float* s1, const float* __restrict__ g,
                           const RuleArgs& a) {
    adam_rule(w[i], s0[i], s1[i], g[i], a.lr, a.b1, a.b2, a.eps, a.wd);
  }
};

template <>
struct Rule<OptRule::Rmsprop> {
  static constexpr int kSlots = 2;
  TOWERS_HD static void at(int64_t i, float* w, float* s0, float* s1, const float* __restrict__ g,
                           const RuleArgs& a) {
    rmsprop_rule(w[i], s0[i], s1[i], g[i], a.lr, a.rho, a.mu, a.eps, a.wd);
  }
};

// Calls f(Rule<r>{}) for the runtime rule r (host code: the twins' launchers).
template <class F>
void with_rule(OptRule r, F&& f) {
  switch (r) {
    case OptRule::Sgd: return f(Rule<OptRule::Sgd>{});
    case OptRule::Momentum: return f(Rule<OptRule::Momentum>{});
    case OptRule::Adagrad: return f(Rule<OptRule::Adagrad>{});
    case OptRule::Adam: return f(Rule<OptRule::Adam>{});
    case OptRule::Rmsprop: return f(Rule<OptRule::Rmsprop>{});
  }
  throw std::logic_error("with_rule: an OptRule without a Rule");  // a bug: exit 3
}

}  // namespace towers::kernels
