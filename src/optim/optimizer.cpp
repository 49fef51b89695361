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
  std::vector<std::string> out;
  for (const OptimizerDef& d : optimizers()) out.push_back(d.name);
  return out;
}

const OptimizerDef* find_optimizer(const std::string& name) {
  for (const OptimizerDef& d : optimizers())
    if (d.name == name) return &d;
  return nullptr;
}

Optimizer::Optimizer(const ParameterLayout& layout, OptimizerConfig cfg)
    : Optimizer(layout, std::move(cfg), 0, layout.total()) {}

Optimizer::Optimizer(const ParameterLayout& layout, OptimizerConfig cfg, int64_t begin,
                     int64_t end)
    : layout_(layout), cfg_(std::move(cfg)), begin_(begin), end_(end),
      def_(find_optimizer(cfg_.name)) {
  TOWERS_CHECK(0 <= begin && begin <= end && end <= layout.total(),
               "optimizer range [{}, {}) outside the layout's {} floats", begin, end,
               layout.total());
  TOWERS_CHECK(def_, "unknown optimizer '{}' (known: {})", cfg_.name,
               fmt::join(optimizer_names(), ", "));
  if (!cfg_.momentum) cfg_.momentum = def_->default_momentum;
  var_locks_ = std::make_unique<std::mutex[]>(layout.variables().size());
  for (const auto& [name, init] : def_->slots) {
    slot_names_.push_back(name);
    HostBuffer b(end - begin);
    std::fill(b.data(), b.data() + b.size(), init);
    slot_buffers_.push_back(std::move(b));
  }
  TOWERS_CHECK(cfg_.ema >= 0.0 && cfg_.ema < 1.0, "ema decay {} outside [0, 1)", cfg_.ema);
  TOWERS_CHECK(cfg_.lookahead_k >= 0 && cfg_.lookahead_alpha > 0.0f && cfg_.lookahead_alpha <= 1.0f,
               "lookahead k {} alpha {}", cfg_.lookahead_k, cfg_.lookahead_alpha);
  // Filled from the parameters by the first update (apply_wrappers).
  if (cfg_.ema > 0.0) {
    slot_names_.push_back("ema");
    slot_buffers_.emplace_back(end - begin);
    ema_ = slot_buffers_.back().data();
  }
  if (cfg_.lookahead_k > 0) {
    slot_names_.push_back("lookahead");
    slot_buffers_.emplace_back(end - begin);
    slow_ = slot_buffers_.back().data();
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

template <class F>
void Optimizer::for_each_part(F&& f) const {
  const auto& vars = layout_.variables();
  for (size_t vi = 0; vi < vars.size(); ++vi) {
    const Variable& v = vars[vi];
    if (!v.spec.trainable) continue;  // state: not learned
    const int64_t b = std::max(v.offset, begin_), e = std::min(v.offset + v.size, end_);
    if (b < e) f(vi, v, b - begin_, e - b);
  }
}

using kernels::state_step;

void Optimizer::apply_state(float* params, const float* grads, bool shared, int64_t lo,
                            int64_t hi) const {
  for (const Variable& v : layout_.variables()) {
    if (v.spec.trainable || v.spec.state_rate == 0.0f) continue;
    // The variable's part inside [begin_, end_) and [lo, hi), range-relative.
    const int64_t b = std::max(std::max(v.offset, begin_) - begin_, lo);
    const int64_t e = std::min(std::min(v.offset + v.size, end_) - begin_, hi);
    for (int64_t i = b; i < e; ++i) {
      if (!shared) {
        params[i] = state_step(params[i], v.spec.state_rate, grads[i - lo]);
        continue;
      }
      std::atomic_ref<float> p(params[i]);
      p.store(state_step(p.load(std::memory_order_relaxed), v.spec.state_rate, grads[i - lo]),
              std::memory_order_relaxed);
    }
  }
}

void Optimizer::apply_wrappers(float* params, int64_t t, bool shared, bool use_locking,
                               int64_t lo, int64_t hi) {
  if (ema_ == nullptr && slow_ == nullptr) return;
  // Plain or relaxed-atomic access, as the update's.
  auto get = [shared](float* p) {
    return shared ? std::atomic_ref<float>(*p).load(std::memory_order_relaxed) : *p;
  };
  auto set = [shared](float* p, float v) {
    if (shared)
      std::atomic_ref<float>(*p).store(v, std::memory_order_relaxed);
    else
      *p = v;
  };
  const kernels::WrapperArgs w = wrapper_args(t);
  if (slow_ != nullptr && w.lookahead_now != 0) {
    // Trainable variables only: state variables keep their running averages.
    for_each_part([&](size_t vi, const Variable&, int64_t at, int64_t size) {
      const int64_t from = std::max(at, lo), to = std::min(at + size, hi);
      if (from >= to) return;
      // Under use_locking the reset is one more update of the variable: no other update of it
      // runs in between.
      std::unique_lock<std::mutex> lock(var_locks_[vi], std::defer_lock);
      if (use_locking) lock.lock();
      for_chunks(to - from, 1 << 16, [&](int64_t, int64_t b, int64_t e) {
        for (int64_t i = from + b; i < from + e; ++i) {
          const float moved = kernels::lookahead_step(get(slow_ + i), get(params + i), w.alpha);
          set(slow_ + i, moved);
          set(params + i, moved);
        }
      });
    });
  }
  if (ema_ != nullptr) {
    for_chunks(hi - lo, 1 << 16, [&](int64_t, int64_t b, int64_t e) {
      for (int64_t i = lo + b; i < lo + e; ++i)
        set(ema_ + i, kernels::ema_step(get(ema_ + i), get(params + i), w.decay));
    });
  }
}

kernels::WrapperArgs Optimizer::wrapper_args(int64_t t) const {
  kernels::WrapperArgs w;
  w.first = t == 1;
  w.lookahead_now = cfg_.lookahead_k > 0 && t % cfg_.lookahead_k == 0;
  w.alpha = cfg_.lookahead_alpha;
  w.decay = std::min(cfg_.ema, (1.0 + static_cast<double>(t)) / (10.0 + static_cast<double>(t)));
  return w;
}

int Optimizer::rule_slots() const { return static_cast<int>(def_->slots.size()); }

void Optimizer::begin_update(const float* params, int64_t t, bool shared, int64_t lo,
                             int64_t hi) {
  if (t != 1) return;
  for (float* s : {ema_, slow_}) {
    if (s == nullptr) continue;
    if (shared)
      load_relaxed(params + lo, s + lo, hi - lo);
    else
      std::copy(params + lo, params + hi, s + lo);
  }
}

void Optimizer::apply(float* params, const float* grads, float lr) {
  const int64_t t = ++updates_;
  apply_range(params, grads, 0, end_ - begin_, lr, t);
}

void Optimizer::apply_piece(float* params, const float* grads, int64_t lo, int64_t hi, float lr,
                            int64_t t) {
  TOWERS_CHECK(0 <= lo && lo <= hi && hi <= end_ - begin_ && 1 <= t && t <= updates_.load(),
               "apply_piece [{}, {}) of update {}: the range has {} floats and {} updates begun",
               lo, hi, t, end_ - begin_, updates_.load());
  apply_range(params, grads, lo, hi, lr, t);
}

void Optimizer::apply_range(float* params, const float* grads, int64_t lo, int64_t hi, float lr,
                            int64_t t) {
  begin_update(params, t, false, lo, hi);
  kernels::RuleArgs r = def_->args(cfg_, lr, t);
  float* s0 = def_->slots.size() > 0 ? slot_buffers_[0].data() : nullptr;
  float* s1 = def_->slots.size() > 1 ? slot_buffers_[1].data() : nullptr;
  for_each_part([&](size_t, const Variable& v, int64_t at, int64_t size) {
    const int64_t from = std::max(at, lo), to = std::min(at + size, hi);
    if (from >= to) return;
    // Element-wise, so any split is exact; chunks keep every core busy on big variables.
    r.wd = v.spec.weight_decay;
    for_chunks(to - from, 1 << 16, [&](int64_t, int64_t b, int64_t e) {
      const int64_t o = from + b;
      kernels::cpu::optimizer_update(e - b, params + o, s0 ? s0 + o : nullptr,
                                     s1 ? s1 + o : nullptr, grads + (o - lo), r);
    });
  });
  apply_state(params, grads, false, lo, hi);
  apply_wrappers(params, t, false, false, lo, hi);
}

void Optimizer::apply_shared(float* params, const float* grads, float lr, bool use_locking) {
  const int64_t t = ++updates_;
  apply_shared_range(params, grads, 0, end_ - begin_, lr, t, use_locking);
}

void Optimizer::apply_shared_piece(float* params, const float* grads, int64_t lo, int64_t hi,
                                   float lr, int64_t t, bool use_locking) {
  TOWERS_CHECK(0 <= lo && lo <= hi && hi <= end_ - begin_ && 1 <= t && t <= updates_.load(),
               "apply_shared_piece [{}, {}) of update {}: the range has {} floats and {} updates "
               "begun", lo, hi, t, end_ - begin_, updates_.load());
  apply_shared_range(params, grads, lo, hi, lr, t, use_locking);
}

void Optimizer::apply_shared_range(float* params, const float* grads, int64_t lo, int64_t hi,
                                   float lr, int64_t t, bool use_locking) {
  begin_update(params, t, true, lo, hi);
  kernels::RuleArgs r = def_->args(cfg_, lr, t);
  float* s0 = def_->slots.size() > 0 ? slot_buffers_[0].data() : nullptr;
  float* s1 = def_->slots.size() > 1 ? slot_buffers_[1].data() : nullptr;
  for_each_part([&](size_t vi, const Variable& v, int64_t at, int64_t size) {
    const int64_t from = std::max(at, lo), to = std::min(at + size, hi);
    if (from >= to) return;
    std::unique_lock<std::mutex> lock(var_locks_[vi], std::defer_lock);
    if (use_locking) lock.lock();
    r.wd = v.spec.weight_decay;
    constexpr int64_t kChunk = 1 << 14;
    for_chunks(to - from, kChunk, [&](int64_t, int64_t b, int64_t e) {
      // Work on private copies of the chunk, read and written back with relaxed atomics.
      thread_local std::vector<float> w, a, c;
      const int64_t n = e - b, o = from + b;
      w.resize(kChunk), a.resize(kChunk), c.resize(kChunk);
      load_relaxed(params + o, w.data(), n);
      if (s0) load_relaxed(s0 + o, a.data(), n);
      if (s1) load_relaxed(s1 + o, c.data(), n);
      kernels::cpu::optimizer_update(n, w.data(), s0 ? a.data() : nullptr,
                                     s1 ? c.data() : nullptr, grads + (o - lo), r);
      store_relaxed(w.data(), params + o, n);
      if (s0) store_relaxed(a.data(), s0 + o, n);
      if (s1) store_relaxed(c.data(), s1 + o, n);
    });
  });
  apply_state(params, grads, true, lo, hi);
  apply_wrappers(params, t, true, use_locking, lo, hi);
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
                 s.contains("name") ? s["name"].dump() : std::string("(none)"), cfg_.name);
  updates_.store(s.at("updates").get<int64_t>());
}

}  // namespace towers
