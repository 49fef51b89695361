#include "layers/scratch.h"

#include <array>

namespace towers {

float* thread_scratch(ScratchSlot slot, int64_t count) {
  thread_local std::array<std::vector<float>, 5> buffers;
  auto& b = buffers[static_cast<int>(slot)];
  if (static_cast<int64_t>(b.size()) < count) b.resize(count);
  return b.data();
}

}  // namespace towers
