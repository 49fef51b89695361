#include "target/target.h"

namespace towers::testutil {

const char* built_towers_binary() { return TOWERS_TARGET_BINARY; }
bool emulated_gpu() { return TOWERS_TARGET_EMULATED != 0; }

}  // namespace towers::testutil
