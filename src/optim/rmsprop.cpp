// rmsprop.cpp — RMSProp (tf.compat.v1.train.RMSPropOptimizer): ms = rho ms + (1-rho) g'^2;
// mom = mu mom + lr g' / sqrt(ms + eps);  w -= mom. The mean square starts at 1, TF's
// default; mu defaults to 0.
#include "optim/optimizer.h"

namespace towers {

OptimizerDef rmsprop_optimizer() {
  return {"rmsprop", "RMSProp (decay 0.9; --momentum, default 0)", {{"rms", 1.0f}, {"momentum", 0.0f}},
          0.0f,
          [](const OptimizerConfig& c, float lr, int64_t) {
            kernels::RuleArgs a;
            a.rule = kernels::OptRule::Rmsprop;
            a.lr = lr;
            a.rho = c.rho;
            a.mu = *c.momentum;
            a.eps = c.rms_epsilon;
            return a;
          }};
}

}  // namespace towers
