// optimizer.h — applies gradients to the flat parameter array, variable by variable (each has
// its own weight decay). Slots (momentum, Adam's moments, ...) share the parameter layout, so a
// checkpoint stores them exactly like parameters: "optimizer/<slot>/<variable>".
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
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
  const ParameterLayout& layout() const { return layout_; }
  // params -= update(grads, lr); grads has the layout too. Increments the update count.
  // The caller has the parameters and slots to itself (sync mode).
  void apply(float* params, const float* grads, float lr);
  // The same update while other threads read and apply to the same arrays (async, Hogwild):
  // every access to params and slots is a relaxed atomic, so the races are well-defined C++
  // (a reader may see a mix of old and new values; concurrent updates of one element may
  // lose one of them, as Hogwild accepts). use_locking serialises the update of each
  // variable (TF's use_locking=True); readers still never lock.
  void apply_shared(float* params, const float* grads, float lr, bool use_locking);

  const std::vector<std::string>& slot_names() const { return slot_names_; }
  std::vector<std::pair<std::string, const float*>> slots() const;
  float* slot(const std::string& name);
  int64_t updates() const { return updates_.load(); }

  nlohmann::json state() const;              // scalars: {"updates": t}
  void load_state(const nlohmann::json& s);  // from a checkpoint

 private:
  const ParameterLayout& layout_;
  OptimizerConfig cfg_;
  std::vector<std::string> slot_names_;
  std::vector<HostBuffer> slot_buffers_;
  std::atomic<int64_t> updates_{0};
  std::unique_ptr<std::mutex[]> var_locks_;  // one per variable, for use_locking

  struct Rates {
    float lr, adam_lr;
  };
  Rates rates(float lr, int64_t t) const;
  // The rule on n elements: w, slot pointers and g already offset to the same element.
  void update(int64_t n, float* w, float* s0, float* s1, const float* g, Rates r, float wd) const;
};

}  // namespace towers
