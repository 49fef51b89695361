// optimizer.h — applies gradients to the flat parameter array, variable by variable (each has
// its own weight decay). Slots (momentum, Adam's moments, ...) share the parameter layout, so a
// checkpoint stores them exactly like parameters: "optimizer/<slot>/<variable>".
//
// Each optimizer is defined in a file of its own (src/optim/<name>.cpp: its slots and their
// initial values, its defaults, and the rule's scalars for an update) and listed in
// src/optim/registry.cpp; its per-element rule is in kernels/optimizer_rules.h, shared by the
// CPU and CUDA twins. Adding an optimizer touches exactly those three files.
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
#include "kernels/optimizer_rules.h"
#include "params/layout.h"

namespace towers {

struct OptimizerConfig {
  std::string name = "momentum";  // sgd | momentum | adagrad | adam | rmsprop
  std::optional<float> momentum;  // unset: 0.9 for momentum, 0 for rmsprop (TF v1 defaults)
  bool nesterov = false;
  float beta1 = 0.9f, beta2 = 0.999f, epsilon = 1e-8f;  // adam (TF v1 defaults)
  float rho = 0.9f, rms_epsilon = 1e-10f;               // rmsprop (TF v1 defaults)
  // Wrappers of any rule, each an extra slot of the flat layout, updated after every update:
  // ema > 0: an exponential moving average of every variable (TF's ExponentialMovingAverage
  // with num_updates: decay min(ema, (1 + t) / (10 + t)) at update t; Keras's use_ema), the
  // weights evaluations read. lookahead_k > 0: Lookahead (Zhang et al. 2019): every k updates
  // the slow weights move alpha of the way to the fast ones, and the fast ones restart there.
  double ema = 0.0;
  int lookahead_k = 0;
  float lookahead_alpha = 0.5f;
};

// One optimizer, as its file defines it.
struct OptimizerDef {
  std::string name;
  std::string summary;  // for --help
  // Slot names and initial values, in the rule's order (s0, s1).
  std::vector<std::pair<std::string, float>> slots;
  float default_momentum = 0.0f;  // when OptimizerConfig::momentum is unset
  // The rule's scalars for update number t (1, 2, ...) at learning rate lr; the weight decay
  // is filled in per variable.
  kernels::RuleArgs (*args)(const OptimizerConfig& cfg, float lr, int64_t t);
};

const std::vector<OptimizerDef>& optimizers();           // registry.cpp
const OptimizerDef* find_optimizer(const std::string& name);  // null when unknown
std::vector<std::string> optimizer_names();

class Optimizer {
 public:
  // cfg.name must be registered (callers check find_optimizer first).
  Optimizer(const ParameterLayout& layout, OptimizerConfig cfg);
  // The optimizer of the elements [begin, end) of the flat array only (a parameter-server
  // shard's range, which may cut variables): its slots hold end - begin floats, and apply and
  // apply_shared take params and grads of the range (element 0 is element begin).
  Optimizer(const ParameterLayout& layout, OptimizerConfig cfg, int64_t begin, int64_t end);

  const OptimizerConfig& config() const { return cfg_; }
  const ParameterLayout& layout() const { return layout_; }
  // params -= update(grads, lr); grads has the layout too. Increments the update count. State
  // variables take their running-average step (ParamSpec::state_rate), at any lr.
  // The caller has the parameters and slots to itself (sync mode).
  void apply(float* params, const float* grads, float lr);
  // The same update while other threads read and apply to the same arrays (async, Hogwild):
  // every access to params and slots is a relaxed atomic, so the races are well-defined C++
  // (a reader may see a mix of old and new values; concurrent updates of one element may
  // lose one of them, as Hogwild accepts). use_locking serialises the update of each
  // variable (TF's use_locking=True); readers still never lock.
  void apply_shared(float* params, const float* grads, float lr, bool use_locking);
  // One update applied in pieces, as a sync parameter-server shard applies a round while the
  // pieces of the gradient arrive: begin_pieces() takes the update's number t once, then
  // apply_piece() applies update t to the range-relative elements [lo, hi), grads holding
  // element lo first. Disjoint pieces that cover the range, in any order and on any threads,
  // give bitwise apply()'s result: every step of every rule and wrapper is element-wise. The
  // caller has the pieces' parameters and slots to itself; one piece runs on one thread.
  int64_t begin_pieces() { return ++updates_; }
  void apply_piece(float* params, const float* grads, int64_t lo, int64_t hi, float lr, int64_t t);
  // The same for apply_shared: update t (begin_pieces) on the range-relative elements [lo, hi)
  // while other threads read and apply to the same arrays. Pieces that cover the range, each
  // holding whole variables, give apply_shared's update.
  void apply_shared_piece(float* params, const float* grads, int64_t lo, int64_t hi, float lr,
                          int64_t t, bool use_locking);

  // For a store that runs the update itself (on a device: kernels::cuda::optimizer_update,
  // state_update and the wrappers' kernels): the scalars of the next update (number
  // updates() + 1) at lr, with weight decay 0 (the caller sets each variable's), and, once
  // that update is applied, its count. The slots are the rule's first (rule_slots() of
  // them), then "ema" and "lookahead" when on; wrapper_args(t) are the wrappers' scalars.
  kernels::RuleArgs next_rule_args(float lr) const { return rule_args(lr, updates_.load() + 1); }
  // The same for update number t (a device replica that counts its own updates).
  kernels::RuleArgs rule_args(float lr, int64_t t) const { return def_->args(cfg_, lr, t); }
  void count_update() { ++updates_; }
  kernels::WrapperArgs wrapper_args(int64_t t) const;
  int rule_slots() const;

  int64_t begin() const { return begin_; }
  int64_t end() const { return end_; }
  const std::vector<std::string>& slot_names() const { return slot_names_; }
  std::vector<std::pair<std::string, const float*>> slots() const;
  float* slot(const std::string& name);
  int64_t updates() const { return updates_.load(); }

  nlohmann::json state() const;              // scalars: {"updates": t}
  void load_state(const nlohmann::json& s);  // from a checkpoint

 private:
  // The wrappers' step after update t (OptimizerConfig::ema, lookahead_k) over the range;
  // shared: as relaxed atomics, like apply_shared, with use_locking taking each variable's
  // lock for the Lookahead reset. Concurrent updates (async modes) may interleave their EMA
  // steps and lose one, as Hogwild loses parameter updates; the average stays an average of
  // the weights it saw.
  // [lo, hi): range-relative elements (apply: all of them).
  void apply_wrappers(float* params, int64_t t, bool shared, bool use_locking, int64_t lo,
                      int64_t hi);
  // Before the rule of update t: update 1 copies the parameters into the wrappers' slots.
  void begin_update(const float* params, int64_t t, bool shared, int64_t lo, int64_t hi);
  // Update t over the range-relative elements [lo, hi) (grads: element lo first), with the
  // caller holding the arrays: apply and apply_piece.
  void apply_range(float* params, const float* grads, int64_t lo, int64_t hi, float lr, int64_t t);
  // The same as relaxed atomics (apply_shared, apply_shared_piece).
  void apply_shared_range(float* params, const float* grads, int64_t lo, int64_t hi, float lr,
                          int64_t t, bool use_locking);

  // Calls f(variable index, variable, range-relative offset, first element, elements) for the
  // part of every trainable variable inside [begin_, end_).
  template <class F>
  void for_each_part(F&& f) const;
  // The running averages of the state variables (ParamSpec::state_rate > 0) inside
  // [begin_, end_) and range-relative [lo, hi): state += state_rate x delta (grads holds the
  // update's deltas, element lo first); shared: as relaxed atomics, like apply_shared.
  void apply_state(float* params, const float* grads, bool shared, int64_t lo, int64_t hi) const;

  const ParameterLayout& layout_;
  OptimizerConfig cfg_;
  int64_t begin_ = 0, end_ = 0;
  std::vector<std::string> slot_names_;
  std::vector<HostBuffer> slot_buffers_;  // the rule's slots, then "ema", then "lookahead"
  float* ema_ = nullptr;    // slot "ema" when cfg_.ema > 0
  float* slow_ = nullptr;   // slot "lookahead" when cfg_.lookahead_k > 0
  std::atomic<int64_t> updates_{0};
  std::unique_ptr<std::mutex[]> var_locks_;  // one per variable, for use_locking
  const OptimizerDef* def_;
};

}  // namespace towers
