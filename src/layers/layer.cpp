#include "layers/layer.h"

#include "core/check.h"

namespace towers {

void Layer::forward_gpu(const GpuExec&, const ForwardArgs&) const {
  TOWERS_FAIL("{}: layer kind '{}' has no GPU twin", name(), kind());
}

void Layer::backward_gpu(const GpuExec&, const BackwardArgs&) const {
  TOWERS_FAIL("{}: layer kind '{}' has no GPU twin", name(), kind());
}

}  // namespace towers
