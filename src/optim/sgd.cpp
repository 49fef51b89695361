// sgd.cpp — plain gradient descent (tf.compat.v1.train.GradientDescentOptimizer):
// w -= lr * g'. No slots.
#include "optim/optimizer.h"

namespace towers {

OptimizerDef sgd_optimizer() {
  return {"sgd", "plain gradient descent", {}, 0.0f,
          [](const OptimizerConfig&, float lr, int64_t) {
            kernels::RuleArgs a;
            a.rule = kernels::OptRule::Sgd;
            a.lr = lr;
            return a;
          }};
}

}  // namespace towers
