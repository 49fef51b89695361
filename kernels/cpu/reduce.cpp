#include "kernels/reduce.h"

namespace towers::kernels::cpu {

void tree_sum(float* const* blocks, int64_t count, int64_t begin, int64_t end) {
  for (int64_t s = 1; s < count; s *= 2)
    for (int64_t i = 0; i + s < count; i += 2 * s) {
      float* a = blocks[i];
      const float* b = blocks[i + s];
      for (int64_t j = begin; j < end; ++j) a[j] += b[j];
    }
}

}  // namespace towers::kernels::cpu
