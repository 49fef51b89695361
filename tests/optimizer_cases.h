// optimizer_cases.h — one case per optimizer rule (kernels/optimizer_rules.h), with scalars
// like training's, for the tests that compare the twins: the CPU loop against the rule
// element-wise (rules_math_test.cpp) and the CUDA kernel against the CPU loop
// (gpu/math_gpu_test.cpp).
#pragma once

#include <string>
#include <vector>

#include "kernels/optimizer_rules.h"

namespace towers::cases {

struct RuleCase {
  std::string name;
  kernels::RuleArgs args;
  int slots;
};

inline std::vector<RuleCase> rule_cases() {
  using kernels::OptRule;
  auto make = [](OptRule r) {
    kernels::RuleArgs a;
    a.rule = r;
    a.wd = 0.004f;
    return a;
  };
  std::vector<RuleCase> out;
  kernels::RuleArgs a = make(OptRule::Sgd);
  a.lr = 0.1f;
  out.push_back({"sgd", a, 0});
  for (bool nesterov : {false, true}) {
    a = make(OptRule::Momentum);
    a.lr = 0.1f, a.mu = 0.9f, a.nesterov = nesterov;
    out.push_back({nesterov ? "nesterov" : "momentum", a, 1});
  }
  a = make(OptRule::Adagrad);
  a.lr = 0.1f;
  out.push_back({"adagrad", a, 1});
  a = make(OptRule::Adam);
  a.lr = 0.001f, a.b1 = 0.9f, a.b2 = 0.999f, a.eps = 1e-8f;
  out.push_back({"adam", a, 2});
  a = make(OptRule::Rmsprop);
  a.lr = 0.01f, a.rho = 0.9f, a.mu = 0.5f, a.eps = 1e-10f;
  out.push_back({"rmsprop", a, 2});
  return out;
}

}  // namespace towers::cases
