// adagrad.cpp — Adagrad (tf.compat.v1.train.AdagradOptimizer): acc += g'^2;
// w -= lr g' / sqrt(acc). The accumulator starts at 0.1, TF's default.
#include "optim/optimizer.h"

namespace towers {

OptimizerDef adagrad_optimizer() {
  return {"adagrad", "Adagrad", {{"accumulator", 0.1f}}, 0.0f,
          [](const OptimizerConfig&, float lr, int64_t) {
            kernels::RuleArgs a;
            a.rule = kernels::OptRule::Adagrad;
            a.lr = lr;
            return a;
          }};
}

}  // namespace towers
