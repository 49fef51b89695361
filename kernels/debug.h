// debug.h — kernels that exist for tests, never for training.
#pragma once

#include <cstdint>

#include "kernels/hd.h"

namespace towers::kernels::cuda {
// One thread that spins for about `ns` nanoseconds on the stream. Before each layer's backward
// (TowerPlacement::test_backward_delay_ns) it makes the compute stream lag far behind the copy
// stream, so that a copy missing its wait on an event reads a buffer not yet written.
void spin_delay(CUstream_st* stream, int64_t ns);
}  // namespace towers::kernels::cuda
