// scratch.h — per-thread scratch memory for layer calls. It grows to the largest request and
// is reused, so the hot path does not allocate. Each slot is a separate buffer.
#pragma once

#include <cstdint>
#include <vector>

namespace towers {

enum class ScratchSlot { Col, Out, Extra, Partial, Weights };

float* thread_scratch(ScratchSlot slot, int64_t count);

}  // namespace towers
