// hogwild.h — the async policy, which the SSP gate (ssp.cpp) extends with a bound.
#pragma once

#include <cstdint>
#include <vector>

#include "towers/modes/mode.h"

namespace towers {

class Hogwild : public ModePolicy {
 public:
  explicit Hogwild(const EngineConfig&) {}
  int64_t examples_per_update(int64_t batch, int towers) const override;
  // A tower that may start takes its ticket (the number of its update) there, so that every
  // step that starts is pushed and none computes a gradient the run then drops.
  bool may_start(int tower, ModeContext& ctx) final;
  Submitted submit(const TowerStep& s, ModeContext& ctx) override;
  void begin(ModeContext& ctx) override;

 protected:
  // Whether tower may start a step now, before its ticket (with ctx.mu held).
  virtual bool gate_open(int /*tower*/, ModeContext& /*ctx*/) { return true; }
  virtual bool recheck_after_push() const { return false; }

 private:
  // Under ctx.mu: the next ticket, and each tower's (-1: none; a ticket is kept from the
  // may_start that takes it to the push, across a park and a wake).
  int64_t next_ticket_ = 0;
  std::vector<int64_t> held_;
};

}  // namespace towers
