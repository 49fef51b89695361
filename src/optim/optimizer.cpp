#include "optim/optimizer.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

#include <fmt/ranges.h>

#include "core/check.h"
#include "core/parallel.h"
#include "core/relaxed.h"
#include "kernels/optimizer.h"

namespace towers {

std::vector<std::string> optimizer_names() {
  return {"sgd", "momentum", "adagrad", "adam", "rmsprop"};
}

Optimizer::Optimizer(const ParameterLayout& layout, OptimizerConfig cfg)
    : layout_(layout), cfg_(std::move(cfg)) {
  const std::string& n = cfg_.name;
  if (!cfg_.momentum) cfg_.momentum = n == "momentum" ? 0.9f : 0.0f;
  if (n == "momentum") slot_names_ = {"momentum"};
  else if (n == "adagrad") slot_names_ = {"accumulator"};
  else if (n == "adam") slot_names_ = {"m", "v"};
  else if (n == "rmsprop") slot_names_ = {"rms", "momentum"};
  else if (n != "sgd")
    TOWERS_BAD_INPUT("--optimizer: unknown optimizer '{}' (known: {})", n,
                     fmt::join(optimizer_names(), ", "));
  var_locks_ = std::make_unique<std::mutex[]>(layout.variables().size());
  for (const std::string& s : slot_names_) {
    HostBuffer b(layout.total());
    // TF v1 starts Adagrad's accumulator at 0.1 and RMSProp's mean square at 1.
    float init = (s == "accumulator") ? 0.1f : (s == "rms") ? 1.0f : 0.0f;
    std::fill(b.data(), b.data() + b.size(), init);
    slot_buffers_.push_back(std::move(b));
  }
}

std::vector<std::pair<std::string, const float*>> Optimizer::slots() const {
  std::vector<std::pair<std::string, const float*>> out;
  for (size_t i = 0; i < slot_names_.size(); ++i)
    out.emplace_back(slot_names_[i], slot_buffers_[i].data());
  return out;
}

float* Optimizer::slot(const std::string& name) {
  for (size_t i = 0; i < slot_names_.size(); ++i)
    if (slot_names_[i] == name) return slot_buffers_[i].data();
  TOWERS_FAIL("optimizer {} has no slot '{}'", cfg_.name, name);
}

Optimizer::Rates Optimizer::rates(float lr, int64_t t) const {
  const double td = static_cast<double>(t);
  return {lr, static_cast<float>(lr * std::sqrt(1.0 - std::pow(cfg_.beta2, td)) /
                                 (1.0 - std::pow(cfg_.beta1, td)))};
}

void Optimizer::update(int64_t n, float* w, float* s0, float* s1, const float* g, Rates r,
                       float wd) const {
  const std::string& name = cfg_.name;
  if (name == "sgd") kernels::cpu::sgd_update(n, w, g, r.lr, wd);
  else if (name == "momentum")
    kernels::cpu::momentum_update(n, w, s0, g, r.lr, *cfg_.momentum, cfg_.nesterov, wd);
  else if (name == "adagrad") kernels::cpu::adagrad_update(n, w, s0, g, r.lr, wd);
  else if (name == "adam")
    kernels::cpu::adam_update(n, w, s0, s1, g, r.adam_lr, cfg_.beta1, cfg_.beta2, cfg_.epsilon, wd);
  else
    kernels::cpu::rmsprop_update(n, w, s0, s1, g, r.lr, cfg_.rho, *cfg_.momentum, cfg_.rms_epsilon,
                                 wd);
}

void Optimizer::apply(float* params, const float* grads, float lr) {
  const Rates r = rates(lr, ++updates_);
  float* s0 = slot_buffers_.size() > 0 ? slot_buffers_[0].data() : nullptr;
  float* s1 = slot_buffers_.size() > 1 ? slot_buffers_[1].data() : nullptr;
  for (const Variable& v : layout_.variables()) {
    // Element-wise, so any split is exact; chunks keep every core busy on big variables.
    for_chunks(v.size, 1 << 16, [&](int64_t, int64_t b, int64_t e) {
      const int64_t o = v.offset + b;
      update(e - b, params + o, s0 ? s0 + o : nullptr, s1 ? s1 + o : nullptr, grads + o, r,
             v.spec.weight_decay);
    });
  }
}


void Optimizer::apply_shared(float* params, const float* grads, float lr, bool use_locking) {
  const Rates r = rates(lr, ++updates_);
  float* s0 = slot_buffers_.size() > 0 ? slot_buffers_[0].data() : nullptr;
  float* s1 = slot_buffers_.size() > 1 ? slot_buffers_[1].data() : nullptr;
  const auto& vars = layout_.variables();
  for (size_t vi = 0; vi < vars.size(); ++vi) {
    const Variable& v = vars[vi];
    std::unique_lock<std::mutex> lock(var_locks_[vi], std::defer_lock);
    if (use_locking) lock.lock();
    constexpr int64_t kChunk = 1 << 14;
    for_chunks(v.size, kChunk, [&](int64_t, int64_t b, int64_t e) {
      // Work on private copies of the chunk, read and written back with relaxed atomics.
      thread_local std::vector<float> w, a, c;
      const int64_t n = e - b, o = v.offset + b;
      w.resize(kChunk), a.resize(kChunk), c.resize(kChunk);
      load_relaxed(params + o, w.data(), n);
      if (s0) load_relaxed(s0 + o, a.data(), n);
      if (s1) load_relaxed(s1 + o, c.data(), n);
      update(n, w.data(), s0 ? a.data() : nullptr, s1 ? c.data() : nullptr, grads + o, r,
             v.spec.weight_decay);
      store_relaxed(w.data(), params + o, n);
      if (s0) store_relaxed(a.data(), s0 + o, n);
      if (s1) store_relaxed(c.data(), s1 + o, n);
    });
  }
}

nlohmann::json Optimizer::state() const {
  return {{"name", cfg_.name}, {"updates", updates_.load()}, {"momentum", *cfg_.momentum}};
}

void Optimizer::load_state(const nlohmann::json& s) {
  TOWERS_REQUIRE(s.is_object() && s.contains("updates") && s["updates"].is_number_integer() &&
                     s["updates"].get<int64_t>() >= 0,
                 "checkpoint optimizer state is malformed: {}", s.dump());
  TOWERS_REQUIRE(s.contains("name") && s["name"] == cfg_.name,
                 "checkpoint was written by optimizer {} but this run uses {}",
                 s.value("name", std::string("?")), cfg_.name);
  updates_.store(s.at("updates").get<int64_t>());
}

}  // namespace towers
