// momentum.cpp — heavy-ball momentum, or Nesterov's (tf.compat.v1.train.MomentumOptimizer):
// a = mu a + g';  w -= lr a  (Nesterov: w -= lr (g' + mu a)). One slot, starting at 0; mu
// defaults to 0.9, the TF tutorial's.
#include "optim/optimizer.h"

namespace towers {

OptimizerDef momentum_optimizer() {
  return {"momentum", "momentum (--momentum, default 0.9; --nesterov)", {{"momentum", 0.0f}}, 0.9f,
          [](const OptimizerConfig& c, float lr, int64_t) {
            kernels::RuleArgs a;
            a.rule = kernels::OptRule::Momentum;
            a.lr = lr;
            a.mu = *c.momentum;
            a.nesterov = c.nesterov;
            return a;
          }};
}

}  // namespace towers
