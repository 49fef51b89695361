// bias.h — per-channel bias for (n, C, HW) tensors (a dense layer is HW = 1).
#pragma once

#include <cstdint>

namespace towers::kernels::cpu {

// y[b, c, :] += bias[c]
void bias_add(int64_t n, int64_t c, int64_t hw, const float* bias, float* y);
// db[c] (+)= sum_{b, i} dy[b, c, i]; accumulate selects += over =.
void bias_grad(int64_t n, int64_t c, int64_t hw, const float* dy, float* db, bool accumulate);

}  // namespace towers::kernels::cpu
