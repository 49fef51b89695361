#include "kernels/optimizer.h"

#include "kernels/optimizer_rules.h"  // the per-element formulas shared with the CUDA twin

namespace towers::kernels::cpu {

void optimizer_update(int64_t n, float* w, float* s0, float* s1, const float* g,
                      const RuleArgs& a) {
  with_rule(a.rule, [&](auto rule) {
    using R = decltype(rule);
    const RuleArgs args = a;  // a local copy: the loop keeps the scalars in registers
    for (int64_t i = 0; i < n; ++i) R::at(i, w, s0, s1, g, args);
  });
}

}  // namespace towers::kernels::cpu
