#include "layers/dense.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include <oneapi/tbb/parallel_for.h>

#include "core/parallel.h"
#include "kernels/gemm.h"
#include "kernels/reduce.h"
#include "layers/scratch.h"
#include "core/gpu.h"
#include "kernels/activation.h"
#include "kernels/bias.h"

namespace towers {

namespace {
constexpr int64_t kRows = 16;  // batch rows per GEMM in forward and dx
constexpr int64_t kOuts = 32;      // weight rows per GEMM in dW
constexpr int64_t kGradRows = 64;  // examples per partial weight gradient
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

// The gradient partials' rows; the forward and dx blocks (kRows) divide them.
int64_t Dense::batch_chunk() const { return kGradRows; }

void Dense::forward(const ForwardArgs& a) const {
  const int64_t o = cfg_.out;
  for_chunks(a.n, kRows, [&](int64_t, int64_t r0, int64_t r1) {
    float* y = a.y + r0 * o;
    kernels::cpu::gemm(false, true, r1 - r0, o, in_, 1.0f, a.x + r0 * in_, in_, a.params[kWeight], in_, 0.0f,
                       y, o);
    for (int64_t r = 0; r < r1 - r0; ++r)
      for (int64_t j = 0; j < o; ++j) {
        float v = y[r * o + j] + a.params[kBias][j];
        y[r * o + j] = cfg_.relu ? std::max(v, 0.0f) : v;
      }
  });
}

void Dense::backward(const BackwardArgs& a) const {
  const int64_t o = cfg_.out, n = a.n;
  // g = dy masked by the ReLU: the gradient at the pre-activation.
  float* g = thread_scratch(ScratchSlot::Extra, n * o);
  for (int64_t i = 0; i < n * o; ++i) g[i] = (!cfg_.relu || a.y[i] > 0.0f) ? a.dy[i] : 0.0f;
  // dW (o, in) = g^T (o, n) * x (n, in) and db = column sums of g, as one partial per chunk of
  // kGradRows examples, tree-summed (kernels/reduce.h) like the conv layers' partials; the
  // first partial is dW itself. Each partial is split over weight rows so that a single chunk
  // still uses every thread.
  const int64_t chunks = ceil_div(n, kGradRows), wsz = o * in_;
  float* extra = thread_scratch(ScratchSlot::Partial, (chunks - 1) * wsz + chunks * o);
  std::vector<float*> dw(chunks), db(chunks);
  for (int64_t k = 0; k < chunks; ++k) {
    dw[k] = k == 0 ? a.grads[kWeight] : extra + (k - 1) * wsz;
    db[k] = k == 0 ? a.grads[kBias] : extra + (chunks - 1) * wsz + k * o;
  }
  const int64_t row_blocks = ceil_div(o, kOuts);
  oneapi::tbb::parallel_for(int64_t{0}, chunks * row_blocks, [&](int64_t job) {
    const int64_t k = job / row_blocks, j0 = (job % row_blocks) * kOuts;
    const int64_t j1 = std::min(j0 + kOuts, o), r0 = k * kGradRows, r1 = std::min(r0 + kGradRows, n);
    kernels::cpu::gemm(true, false, j1 - j0, in_, r1 - r0, 1.0f, g + r0 * o + j0, o,
                       a.x + r0 * in_, in_, 0.0f, dw[k] + j0 * in_, in_);
    for (int64_t j = j0; j < j1; ++j) {
      double s = 0.0;
      for (int64_t r = r0; r < r1; ++r) s += g[r * o + j];
      db[k][j] = static_cast<float>(s);
    }
  });
  if (chunks > 1) {
    for_chunks(wsz, 1 << 14, [&](int64_t, int64_t b, int64_t e) {
      kernels::cpu::tree_sum(dw.data(), chunks, b, e);
    });
    kernels::cpu::tree_sum(db.data(), chunks, 0, o);
  }
  if (a.dx != nullptr) {
    // dx (n, in) = g (n, o) * W (o, in), split over batch rows.
    for_chunks(n, kRows, [&](int64_t, int64_t r0, int64_t r1) {
      kernels::cpu::gemm(false, false, r1 - r0, in_, o, 1.0f, g + r0 * o, o, a.params[kWeight], in_, 0.0f,
                         a.dx + r0 * in_, in_);
    });
  }
}

#if TOWERS_HAVE_CUDA
// ---- the GPU twin ----------------------------------------------------------------------------
namespace kc = kernels::cuda;

namespace {
// Where the bias gradient's segment sums (doubles) start in the scratch: after the masked dy,
// 8-byte aligned.
int64_t partials_at(int64_t n, int64_t out) { return (n * out + 1) / 2 * 2; }
}  // namespace

// The masked dy, then the bias gradient's segment sums.
int64_t Dense::gpu_scratch(int64_t n) const {
  return partials_at(n, cfg_.out) + 2 * kc::bias_grad_partials(n, cfg_.out, 1);
}

// The weight-gradient branch keeps the segment sums where the main stream would.
int64_t Dense::gpu_lane_scratch(int64_t n) const { return gpu_scratch(n); }

void Dense::forward_gpu(const GpuExec& e, const ForwardArgs& a) const {
  const int64_t o = cfg_.out;
  // y (n, o) = x (n, in) * W^T (in, o), then + b and the ReLU in place
  kc::gemm(e.blas, false, true, a.n, o, in_, 1.0f, a.x, in_, a.params[kWeight], in_, 0.0f, a.y, o);
  kc::bias_add(e.stream, a.n, o, 1, a.params[kBias], a.y, cfg_.relu);
}

void Dense::backward_gpu(const GpuExec& e, const BackwardArgs& a) const {
  const int64_t o = cfg_.out, n = a.n;
  const float* g = a.dy;
  if (cfg_.relu) {
    float* masked = gpu_scratch_at(e, 0, n * o, name());
    kc::relu_backward(e.stream, n * o, a.y, a.dy, masked);
    g = masked;
  }
  // The bias and weight gradients are a branch on the exec's lane, w, beside the input
  // gradient on the main stream (without a lane w is e: the branch runs first).
  const GpuExec w = fork_lane(e);
  const int64_t partials = kc::bias_grad_partials(n, o, 1);
  kc::bias_grad(w.stream, n, o, 1, g, a.grads[kBias], false,
                partials == 0 ? nullptr
                              : reinterpret_cast<double*>(gpu_scratch_at(
                                    w, partials_at(n, o), 2 * partials, name())));
  // dW (o, in) = g^T (o, n) * x (n, in)
  kc::gemm(w.blas, true, false, o, in_, n, 1.0f, g, o, a.x, in_, 0.0f, a.grads[kWeight], in_);
  // dx (n, in) = g (n, o) * W (o, in)
  if (a.dx != nullptr)
    kc::gemm(e.blas, false, false, n, in_, o, 1.0f, g, o, a.params[kWeight], in_, 0.0f, a.dx, in_);
  join_lane(e);
}
#endif  // TOWERS_HAVE_CUDA

}  // namespace towers
