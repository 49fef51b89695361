#include "optim/optimizer.h"

#include <algorithm>
#include <cmath>

#include <fmt/ranges.h>

#include "core/check.h"
#include "core/parallel.h"
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

void Optimizer::apply(float* params, const float* grads, float lr) {
  ++updates_;
  const double t = static_cast<double>(updates_);
  const float adam_lr = static_cast<float>(lr * std::sqrt(1.0 - std::pow(cfg_.beta2, t)) /
                                           (1.0 - std::pow(cfg_.beta1, t)));
  const std::string& n = cfg_.name;
  float* s0 = slot_buffers_.size() > 0 ? slot_buffers_[0].data() : nullptr;
  float* s1 = slot_buffers_.size() > 1 ? slot_buffers_[1].data() : nullptr;
  for (const Variable& v : layout_.variables()) {
    const float wd = v.spec.weight_decay;
    // Element-wise, so any split is exact; chunks keep both cores busy on big variables.
    for_chunks(v.size, 1 << 16, [&](int64_t, int64_t b, int64_t e) {
      const int64_t o = v.offset + b, cnt = e - b;
      float* w = params + o;
      const float* g = grads + o;
      if (n == "sgd") kernels::cpu::sgd_update(cnt, w, g, lr, wd);
      else if (n == "momentum")
        kernels::cpu::momentum_update(cnt, w, s0 + o, g, lr, *cfg_.momentum, cfg_.nesterov, wd);
      else if (n == "adagrad") kernels::cpu::adagrad_update(cnt, w, s0 + o, g, lr, wd);
      else if (n == "adam")
        kernels::cpu::adam_update(cnt, w, s0 + o, s1 + o, g, adam_lr, cfg_.beta1, cfg_.beta2,
                                  cfg_.epsilon, wd);
      else
        kernels::cpu::rmsprop_update(cnt, w, s0 + o, s1 + o, g, lr, cfg_.rho, *cfg_.momentum,
                                     cfg_.rms_epsilon, wd);
    });
  }
}

nlohmann::json Optimizer::state() const {
  return {{"name", cfg_.name}, {"updates", updates_}, {"momentum", *cfg_.momentum}};
}

void Optimizer::load_state(const nlohmann::json& s) {
  TOWERS_REQUIRE(s.is_object() && s.contains("updates") && s["updates"].is_number_integer() &&
                     s["updates"].get<int64_t>() >= 0,
                 "checkpoint optimizer state is malformed: {}", s.dump());
  TOWERS_REQUIRE(s.contains("name") && s["name"] == cfg_.name,
                 "checkpoint was written by optimizer {} but this run uses {}",
                 s.value("name", std::string("?")), cfg_.name);
  updates_ = s.at("updates").get<int64_t>();
}

}  // namespace towers
