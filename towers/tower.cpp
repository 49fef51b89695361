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
    std::vector<const Variable*> vs;
    int64_t lo = layout.total(), hi = 0;
    for (const ParamSpec& spec : l->params()) {
      const Variable& v = layout.find(spec.name);
      vs.push_back(&v);
      lo = std::min(lo, v.offset);
      hi = std::max(hi, v.offset + v.size);
    }
    TOWERS_CHECK(static_cast<int>(vs.size()) <= kMaxLayerVars, "layer {} has {} variables (at most {})",
                 l->name(), vs.size(), kMaxLayerVars);
    vars_.push_back(std::move(vs));
    grad_span_.emplace_back(lo < hi ? lo : 0, lo < hi ? hi : 0);
  }
}

void Tower::allocate_activations(Device& dev) {
  int64_t widest = numel(graph_.input_shape());
  for (const auto& l : graph_.layers()) {
    act_.emplace_back(dev, max_batch_ * numel(l->out_shape()));
    saved_.emplace_back(dev, saved_floats(*l, max_batch_));
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
  bind_variables(i, const_cast<float*>(params), 0, a);
  a.saved = saved_[i].data();
  a.training = training;
  a.noise = noise_arg_;
  a.exchange = training ? exchange_ : nullptr;
  return a;
}

void Tower::bind_variables(size_t i, float* params, int64_t origin, ForwardArgs& a) const {
  for (size_t k = 0; k < vars_[i].size(); ++k) {
    const Variable& v = *vars_[i][k];
    float* p = params + (v.offset - origin);
    a.params[k] = p;
    // State is written through the same pointer: the tower's own copy of the variables.
    if (!v.spec.trainable) a.state[k] = p;
  }
}

void Tower::bind_variables(size_t i, const float* params, float* grads, int64_t origin,
                           BackwardArgs& a) const {
  for (size_t k = 0; k < vars_[i].size(); ++k) {
    const Variable& v = *vars_[i][k];
    a.params[k] = params + (v.offset - origin);
    a.grads[k] = grads + (v.offset - origin);  // state: its running average's delta
  }
}

BackwardArgs Tower::backward_args(size_t i, int64_t n, const float* images, int cur,
                                  const float* params, float* grads, float grad_scale) {
  BackwardArgs a;
  a.n = n;
  a.state_weight = static_cast<float>(n) * grad_scale;
  a.x = i == 0 ? images : act_[i - 1].data();
  a.y = act_[i].data();
  a.dy = dact_[cur].data();
  a.dx = i == 0 ? nullptr : dact_[1 - cur].data();
  bind_variables(i, params, grads, 0, a);
  a.saved = saved_[i].data();
  a.noise = noise_arg_;
  a.exchange = exchange_;
  return a;
}

namespace {
[[noreturn]] void no_device_input(Device& d) {
  TOWERS_BAD_INPUT("--input device: a tower on {} cannot make its batches on the device; it "
                   "needs a GPU tower (--device cuda)", d.name());
}
}  // namespace

void Tower::hold_train_data(const data::Dataset&, const data::AugmentConfig&) {
  no_device_input(device());
}

StepStats Tower::compute_gradients_planned(const kernels::ExamplePlan*, const int32_t*, int64_t,
                                           float) {
  no_device_input(device());
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
    LossArgs la;
    la.n = n;
    la.classes = graph().num_classes();
    la.logits = forward(images, n, true);
    la.labels = labels;
    la.grad_scale = grad_scale;
    la.dlogits = dact_[0].data();
    const LossSums r = graph().loss().forward(la);
    const auto& layers = graph().layers();
    int cur = 0;
    for (size_t i = layers.size(); i-- > 0;) {
      layers[i]->backward(
          backward_args(i, n, images, cur, params_.data(), grads_.data(), grad_scale));
      cur = 1 - cur;
    }
    return StepStats{r.loss_sum, r.correct, n};
  });
}

void CpuTower::copy_logits(float* out, int64_t n) {
  check_batch(n);
  std::memcpy(out, logits(), sizeof(float) * n * graph().num_classes());
}

StepStats CpuTower::evaluate(const float* images, const int32_t* labels, int64_t n) {
  return device_.execute([&] {
    LossArgs la;
    la.n = n;
    la.classes = graph().num_classes();
    la.logits = forward(images, n, false);
    la.labels = labels;
    const LossSums r = graph().loss().forward(la);
    return StepStats{r.loss_sum, r.correct, n};
  });
}

}  // namespace towers
