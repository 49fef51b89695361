// debug.h — kernels that exist for tests and for set-up checks, never for training.
#pragma once

#include <cstdint>
#include <string>

#include "kernels/hd.h"

namespace towers::kernels::cuda {
// One thread that spins for about `ns` nanoseconds on the stream. Before each layer's backward
// (TowerPlacement::test_backward_delay_ns) it makes the compute stream lag far behind the copy
// stream, so that a copy missing its wait on an event reads a buffer not yet written.
void spin_delay(CUstream_st* stream, int64_t ns);

// Whether this build has GPU code that runs on the current device: empty if so, else CUDA's
// reason (a build for sm_90 on an Ampere GPU: "no kernel image is available ..."). Asks the
// runtime for the attributes of one of towers' kernels; launches nothing.
std::string device_code_missing();
}  // namespace towers::kernels::cuda
