#include "layers/dense.h"

#include <algorithm>
#include <vector>

#include "core/parallel.h"
#include "kernels/gemm.h"

namespace towers {

namespace {
constexpr int64_t kRows = 16;  // batch rows per GEMM in forward and dx
constexpr int64_t kOuts = 32;  // weight rows per GEMM in dW
}  // namespace

Shape Dense::infer(const Shape& in) {
  in_ = numel(in);
  return {cfg_.out};
}

std::vector<ParamSpec> Dense::params() const {
  return {{name() + "/weight", {cfg_.out, in_}, Init::truncated_normal(cfg_.weight_stddev),
           cfg_.weight_decay},
          {name() + "/bias", {cfg_.out}, Init::constant(cfg_.bias_init), 0.0f}};
}

void Dense::forward(const ForwardArgs& a) const {
  const int64_t o = cfg_.out;
  for_chunks(a.n, kRows, [&](int64_t, int64_t r0, int64_t r1) {
    float* y = a.y + r0 * o;
    kernels::cpu::gemm(false, true, r1 - r0, o, in_, 1.0f, a.x + r0 * in_, in_, a.w, in_, 0.0f,
                       y, o);
    for (int64_t r = 0; r < r1 - r0; ++r)
      for (int64_t j = 0; j < o; ++j) {
        float v = y[r * o + j] + a.b[j];
        y[r * o + j] = cfg_.relu ? std::max(v, 0.0f) : v;
      }
  });
}

void Dense::backward(const BackwardArgs& a) const {
  const int64_t o = cfg_.out, n = a.n;
  // g = dy masked by the ReLU: the gradient at the pre-activation.
  std::vector<float> g(n * o);
  for (int64_t i = 0; i < n * o; ++i) g[i] = (!cfg_.relu || a.y[i] > 0.0f) ? a.dy[i] : 0.0f;
  for (int64_t j = 0; j < o; ++j) {
    double s = 0.0;
    for (int64_t r = 0; r < n; ++r) s += g[r * o + j];
    a.db[j] = static_cast<float>(s);
  }
  // dW (o, in) = g^T (o, n) * x (n, in), split over weight rows: no reduction needed.
  for_chunks(o, kOuts, [&](int64_t, int64_t j0, int64_t j1) {
    kernels::cpu::gemm(true, false, j1 - j0, in_, n, 1.0f, g.data() + j0, o, a.x, in_, 0.0f,
                       a.dw + j0 * in_, in_);
  });
  if (a.dx != nullptr) {
    // dx (n, in) = g (n, o) * W (o, in), split over batch rows.
    for_chunks(n, kRows, [&](int64_t, int64_t r0, int64_t r1) {
      kernels::cpu::gemm(false, false, r1 - r0, in_, o, 1.0f, g.data() + r0 * o, o, a.w, in_,
                         0.0f, a.dx + r0 * in_, in_);
    });
  }
}

}  // namespace towers
