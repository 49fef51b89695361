// adam.cpp — Adam (tf.compat.v1.train.AdamOptimizer): moments m and v start at 0; update t
// uses lr_t = lr sqrt(1 - b2^t) / (1 - b1^t), computed here in double once per update.
#include <cmath>

#include "optim/optimizer.h"

namespace towers {

OptimizerDef adam_optimizer() {
  return {"adam", "Adam (beta1 0.9, beta2 0.999, epsilon 1e-8)", {{"m", 0.0f}, {"v", 0.0f}}, 0.0f,
          [](const OptimizerConfig& c, float lr, int64_t t) {
            const double td = static_cast<double>(t);
            kernels::RuleArgs a;
            a.rule = kernels::OptRule::Adam;
            a.lr = static_cast<float>(lr * std::sqrt(1.0 - std::pow(c.beta2, td)) /
                                      (1.0 - std::pow(c.beta1, td)));
            a.b1 = c.beta1;
            a.b2 = c.beta2;
            a.eps = c.epsilon;
            return a;
          }};
}

}  // namespace towers
