// target.h — what differs between the two test executables, answered at run time so that the
// test sources compile once for both (tests/CMakeLists.txt): towers_tests runs the GPU suite on
// the real CUDA runtime and the `towers` binary, towers_emu_tests on the CUDA emulator
// (tests/emu) and `towers_emu_cli`. tests/target/target.cpp is compiled into each with its own
// TOWERS_TARGET_BINARY and TOWERS_TARGET_EMULATED.
#pragma once

namespace towers::testutil {

// The towers binary this test executable was built with.
const char* built_towers_binary();
// Whether this test executable runs on the CUDA emulator instead of the CUDA runtime.
bool emulated_gpu();

}  // namespace towers::testutil
