// hogwild.h — the async policy, which the SSP gate (ssp.cpp) extends with a bound.
#pragma once

#include <atomic>

#include "towers/modes/mode.h"

namespace towers {

class Hogwild : public ModePolicy {
 public:
  explicit Hogwild(const EngineConfig&) {}
  int64_t examples_per_update(int64_t batch, int towers) const override;
  bool may_start(int tower, ModeContext& ctx) override;
  Submitted submit(const TowerStep& s, ModeContext& ctx) override;
  void begin(ModeContext& ctx) override;

 protected:
  virtual bool recheck_after_push() const { return false; }

 private:
  std::atomic<int64_t> tickets_{0};
};

}  // namespace towers
