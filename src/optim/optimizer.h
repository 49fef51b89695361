// optimizer.h — applies gradients to the flat parameter array, variable by variable (each has
// its own weight decay). Slots (momentum, Adam's moments, ...) share the parameter layout, so a
// checkpoint stores them exactly like parameters: "optimizer/<slot>/<variable>".
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/tensor.h"
#include "params/layout.h"

namespace towers {

struct OptimizerConfig {
  std::string name = "momentum";  // sgd | momentum | adagrad | adam | rmsprop
  std::optional<float> momentum;  // unset: 0.9 for momentum, 0 for rmsprop (TF v1 defaults)
  bool nesterov = false;
  float beta1 = 0.9f, beta2 = 0.999f, epsilon = 1e-8f;  // adam (TF v1 defaults)
  float rho = 0.9f, rms_epsilon = 1e-10f;               // rmsprop (TF v1 defaults)
};

std::vector<std::string> optimizer_names();

class Optimizer {
 public:
  Optimizer(const ParameterLayout& layout, OptimizerConfig cfg);  // throws on an unknown name

  const OptimizerConfig& config() const { return cfg_; }
  // params -= update(grads, lr); grads has the layout too. Increments the update count.
  void apply(float* params, const float* grads, float lr);

  const std::vector<std::string>& slot_names() const { return slot_names_; }
  std::vector<std::pair<std::string, const float*>> slots() const;
  float* slot(const std::string& name);
  int64_t updates() const { return updates_; }

  nlohmann::json state() const;              // scalars: {"updates": t}
  void load_state(const nlohmann::json& s);  // from a checkpoint

 private:
  const ParameterLayout& layout_;
  OptimizerConfig cfg_;
  std::vector<std::string> slot_names_;
  std::vector<HostBuffer> slot_buffers_;
  int64_t updates_ = 0;
};

}  // namespace towers
