#include "layers/residual.h"

#include <algorithm>

#include "core/check.h"
#include "core/gpu.h"
#include "core/parallel.h"
#include "kernels/reduce.h"

#if TOWERS_HAVE_CUDA
#include <cuda_runtime.h>

#include "core/cuda_check.h"
#endif

namespace towers {

Residual::Residual(std::string name, std::vector<std::unique_ptr<Layer>> inner)
    : Layer(std::move(name)), inner_(std::move(inner)) {
  TOWERS_CHECK(!inner_.empty(), "{}: a residual block needs at least one inner layer", this->name());
}

Shape Residual::infer(const Shape& in) {
  Shape s = in;
  first_var_.clear();
  widest_ = 0;
  int vars = 0;
  for (auto& l : inner_) {
    l->bind(s);
    s = l->out_shape();
    widest_ = std::max(widest_, numel(s));
    first_var_.push_back(vars);
    vars += static_cast<int>(l->params().size());
  }
  TOWERS_CHECK(s == in, "{}: the inner layers give {}, but the shortcut carries the input {}",
               name(), to_string(s), to_string(in));
  TOWERS_CHECK(vars <= kMaxLayerVars, "{}: {} variables in the block (at most {})", name(), vars,
               kMaxLayerVars);
  return in;
}

std::vector<ParamSpec> Residual::params() const {
  std::vector<ParamSpec> out;
  for (const auto& l : inner_)
    for (ParamSpec& p : l->params()) out.push_back(std::move(p));
  return out;
}

int64_t Residual::saved_per_example() const {
  int64_t total = 2 * widest_;
  for (const auto& l : inner_) total += numel(l->out_shape()) + l->saved_per_example();
  return total;
}

// Per inner layer, its per-call floats and up to two floats of padding: its saved buffer starts
// on an even float (after its output), and saved_floats rounds its per-example part up to one.
int64_t Residual::saved_per_call() const {
  int64_t total = 0;
  for (const auto& l : inner_) total += 2 + even_floats(l->saved_per_call());
  return total;
}

int64_t Residual::flops_per_example() const {
  int64_t f = numel(in_shape());  // the sum
  for (const auto& l : inner_) f += l->flops_per_example();
  return f;
}

// The inner layers' chunks are powers of two (or 0: none); the largest is a multiple of all.
int64_t Residual::batch_chunk() const {
  int64_t c = 0;
  for (const auto& l : inner_) c = std::max(c, l->batch_chunk());
  return c;
}

Residual::Slices Residual::slices(float* saved, int64_t n) const {
  Slices s;
  int64_t at = 0;  // floats from `saved`, which starts 8-byte aligned
  for (const auto& l : inner_) {
    s.act.push_back(saved + at);
    at += even_floats(n * numel(l->out_shape()));
    s.saved.push_back(saved + at);
    at += saved_floats(*l, n);
  }
  float* p = saved + at;
  s.err[0] = p;
  s.err[1] = p + n * widest_;
  return s;
}

ForwardArgs Residual::inner_forward(size_t k, const ForwardArgs& a, const Slices& s) const {
  ForwardArgs f;
  f.n = a.n;
  f.x = k == 0 ? a.x : s.act[k - 1];
  f.y = s.act[k];
  const int v0 = first_var_[k], nv = static_cast<int>(inner_[k]->params().size());
  for (int v = 0; v < nv; ++v) f.params[v] = a.params[v0 + v], f.state[v] = a.state[v0 + v];
  f.saved = s.saved[k];
  f.training = a.training;
  f.noise = a.noise;
  f.exchange = a.exchange;
  return f;
}

BackwardArgs Residual::inner_backward(size_t k, const BackwardArgs& a, const Slices& s,
                                      const float* dy, int cur) const {
  BackwardArgs b;
  b.n = a.n;
  b.x = k == 0 ? a.x : s.act[k - 1];
  b.y = s.act[k];
  b.dy = dy;
  b.dx = k == 0 ? a.dx : s.err[cur];
  const int v0 = first_var_[k], nv = static_cast<int>(inner_[k]->params().size());
  for (int v = 0; v < nv; ++v) b.params[v] = a.params[v0 + v], b.grads[v] = a.grads[v0 + v];
  b.saved = s.saved[k];
  b.state_weight = a.state_weight;
  b.noise = a.noise;
  b.exchange = a.exchange;
  return b;
}

void Residual::forward(const ForwardArgs& a) const {
  const Slices s = slices(a.saved, a.n);
  for (size_t k = 0; k < inner_.size(); ++k) inner_[k]->forward(inner_forward(k, a, s));
  const float* f = s.act.back();
  for_chunks(a.n * numel(in_shape()), 1 << 15, [&](int64_t, int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) a.y[i] = a.x[i] + f[i];
  });
}

void Residual::backward(const BackwardArgs& a) const {
  // The saved buffer is this layer's own, in the tower: backward may use its error buffers.
  const Slices s = slices(const_cast<float*>(a.saved), a.n);
  const float* dy = a.dy;
  int cur = 0;
  for (size_t k = inner_.size(); k-- > 0;) {
    const BackwardArgs b = inner_backward(k, a, s, dy, cur);
    inner_[k]->backward(b);
    dy = b.dx;
    cur = 1 - cur;
  }
  if (a.dx == nullptr) return;
  for_chunks(a.n * numel(in_shape()), 1 << 15, [&](int64_t, int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) a.dx[i] += a.dy[i];
  });
}

#if TOWERS_HAVE_CUDA
// ---- the GPU twin ----------------------------------------------------------------------------

int64_t Residual::gpu_scratch(int64_t n) const {
  int64_t s = 0;
  for (const auto& l : inner_) s = std::max(s, l->gpu_scratch(n));
  return s;
}

int64_t Residual::gpu_lane_scratch(int64_t n) const {
  int64_t s = 0;
  for (const auto& l : inner_) s = std::max(s, l->gpu_lane_scratch(n));
  return s;
}

void Residual::forward_gpu(const GpuExec& e, const ForwardArgs& a) const {
  const Slices s = slices(a.saved, a.n);
  for (size_t k = 0; k < inner_.size(); ++k) inner_[k]->forward_gpu(e, inner_forward(k, a, s));
  const int64_t count = a.n * numel(in_shape());
  CUDA_CHECK(cudaMemcpyAsync(a.y, s.act.back(), sizeof(float) * count, cudaMemcpyDeviceToDevice,
                             e.stream));
  float* const blocks[2] = {a.y, const_cast<float*>(a.x)};  // y += x (x is only read)
  kernels::cuda::tree_sum(e.stream, blocks, 2, count);
}

void Residual::backward_gpu(const GpuExec& e, const BackwardArgs& a) const {
  const Slices s = slices(const_cast<float*>(a.saved), a.n);
  const float* dy = a.dy;
  int cur = 0;
  for (size_t k = inner_.size(); k-- > 0;) {
    const BackwardArgs b = inner_backward(k, a, s, dy, cur);
    inner_[k]->backward_gpu(e, b);
    dy = b.dx;
    cur = 1 - cur;
  }
  if (a.dx == nullptr) return;
  float* const blocks[2] = {a.dx, const_cast<float*>(a.dy)};  // dx += dy (dy is only read)
  kernels::cuda::tree_sum(e.stream, blocks, 2, a.n * numel(in_shape()));
}
#endif  // TOWERS_HAVE_CUDA

}  // namespace towers
