#include "towers/tower.h"

#include <algorithm>

#include "core/check.h"
#include "core/relaxed.h"

#if TOWERS_HAVE_CUDA
#include "towers/cuda_tower.h"
#endif

namespace towers {

Tower::Tower(const Graph& graph, int64_t max_batch) : graph_(graph), max_batch_(max_batch) {
  TOWERS_CHECK(max_batch > 0, "a tower needs a positive batch, got {}", max_batch);
  const ParameterLayout& layout = graph.layout();
  for (const auto& l : graph.layers()) {
    bool has_vars = !l->params().empty();
    w_off_.push_back(has_vars ? layout.find(l->name() + "/weight").offset : -1);
    b_off_.push_back(has_vars ? layout.find(l->name() + "/bias").offset : -1);
  }
}

void Tower::allocate_activations(Device& dev) {
  int64_t widest = numel(graph_.input_shape());
  for (const auto& l : graph_.layers()) {
    act_.emplace_back(dev, max_batch_ * numel(l->out_shape()));
    saved_.emplace_back(dev, max_batch_ * l->saved_per_example());
    widest = std::max(widest, numel(l->out_shape()));
  }
  for (auto& d : dact_) d = DeviceBuffer(dev, max_batch_ * widest);
}

void Tower::release_activations() {
  act_.clear();
  saved_.clear();
  for (auto& d : dact_) d = DeviceBuffer();
}

ForwardArgs Tower::forward_args(size_t i, int64_t n, const float* x, const float* params,
                                bool training) {
  ForwardArgs a;
  a.n = n;
  a.x = x;
  a.y = act_[i].data();
  a.w = w_off_[i] >= 0 ? params + w_off_[i] : nullptr;
  a.b = b_off_[i] >= 0 ? params + b_off_[i] : nullptr;
  a.saved = saved_[i].data();
  a.training = training;
  return a;
}

BackwardArgs Tower::backward_args(size_t i, int64_t n, const float* images, int cur,
                                  const float* params, float* grads) {
  BackwardArgs a;
  a.n = n;
  a.x = i == 0 ? images : act_[i - 1].data();
  a.y = act_[i].data();
  a.dy = dact_[cur].data();
  a.dx = i == 0 ? nullptr : dact_[1 - cur].data();
  a.w = w_off_[i] >= 0 ? params + w_off_[i] : nullptr;
  a.b = b_off_[i] >= 0 ? params + b_off_[i] : nullptr;
  a.dw = w_off_[i] >= 0 ? grads + w_off_[i] : nullptr;
  a.db = b_off_[i] >= 0 ? grads + b_off_[i] : nullptr;
  a.saved = saved_[i].data();
  return a;
}

void Tower::check_batch(int64_t n) const {
  TOWERS_CHECK(n > 0 && n <= max_batch_, "batch of {} for a tower built for {}", n, max_batch_);
}

std::unique_ptr<Tower> make_tower(const Graph& graph, int64_t max_batch, const TowerPlacement& p) {
  if (p.kind == DeviceKind::Cpu) return std::make_unique<CpuTower>(graph, max_batch, p.threads);
#if TOWERS_HAVE_CUDA
  return std::make_unique<CudaTower>(graph, max_batch, p);
#else
  TOWERS_BAD_INPUT("--device cuda: this towers was built without CUDA (no nvcc at configure time)");
#endif
}

CpuTower::CpuTower(const Graph& graph, int64_t max_batch, int threads)
    : Tower(graph, max_batch), device_(threads) {
  const ParameterLayout& layout = graph.layout();
  params_ = DeviceBuffer(device_, layout.total());
  grads_ = DeviceBuffer(device_, layout.total());
  allocate_activations(device_);
}

void CpuTower::load_params(const float* host) {
  device_.copy_in(params_.data(), host, graph().layout().total());
}

void CpuTower::load_params_shared(const float* host) {
  load_relaxed(host, params_.data(), graph().layout().total());
}

const float* CpuTower::forward(const float* images, int64_t n, bool training) {
  check_batch(n);
  const auto& layers = graph().layers();
  const float* x = images;
  for (size_t i = 0; i < layers.size(); ++i) {
    ForwardArgs a = forward_args(i, n, x, params_.data(), training);
    layers[i]->forward(a);
    x = a.y;
  }
  return x;
}

StepStats CpuTower::compute_gradients(const float* images, const int32_t* labels, int64_t n,
                                   float grad_scale) {
  return device_.execute([&] {
    const float* logits = forward(images, n, true);
    const int64_t k = graph().num_classes();
    float* dy = dact_[0].data();
    auto r = kernels::cpu::softmax_xent(n, k, logits, labels, grad_scale, dy);
    const auto& layers = graph().layers();
    int cur = 0;
    for (size_t i = layers.size(); i-- > 0;) {
      layers[i]->backward(backward_args(i, n, images, cur, params_.data(), grads_.data()));
      cur = 1 - cur;
    }
    return StepStats{r.loss_sum, r.correct, n};
  });
}

StepStats CpuTower::evaluate(const float* images, const int32_t* labels, int64_t n) {
  return device_.execute([&] {
    const float* logits = forward(images, n, false);
    auto r = kernels::cpu::softmax_xent(n, graph().num_classes(), logits, labels, 0.0f, nullptr);
    return StepStats{r.loss_sum, r.correct, n};
  });
}

}  // namespace towers
