// registry.cpp — the optimizers a run can use: one line each. --help and the errors for an
// unknown name list them from here.
#include "optim/optimizer.h"

namespace towers {

// One per file of this folder.
OptimizerDef sgd_optimizer();
OptimizerDef momentum_optimizer();
OptimizerDef adagrad_optimizer();
OptimizerDef adam_optimizer();
OptimizerDef rmsprop_optimizer();

const std::vector<OptimizerDef>& optimizers() {
  static const std::vector<OptimizerDef> all = {
      sgd_optimizer(), momentum_optimizer(), adagrad_optimizer(), adam_optimizer(),
      rmsprop_optimizer(),
  };
  return all;
}

}  // namespace towers
