#include "kernels/standardize.h"

#include <algorithm>
#include <cmath>

namespace towers::kernels::cpu {

void standardize(int64_t n, int64_t m, const float* x, float* y) {
  for (int64_t b = 0; b < n; ++b) {
    const float* xi = x + b * m;
    float* yi = y + b * m;
    double s = 0.0, ss = 0.0;
    for (int64_t i = 0; i < m; ++i) s += xi[i], ss += static_cast<double>(xi[i]) * xi[i];
    const double mean = s / m;
    const double var = std::max(ss / m - mean * mean, 0.0);
    const double adj = std::max(std::sqrt(var), 1.0 / std::sqrt(static_cast<double>(m)));
    const float fm = static_cast<float>(mean), inv = static_cast<float>(1.0 / adj);
    for (int64_t i = 0; i < m; ++i) yi[i] = (xi[i] - fm) * inv;
  }
}

}  // namespace towers::kernels::cpu
