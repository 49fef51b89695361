// ssp.cpp — stale synchronous parallel (Ho et al. 2013): async, but a tower whose clock (its
// pushed updates in this run) is more than `staleness` ahead of the slowest tower's waits
// until the slowest catches up. S = 0 makes the towers take turns step by step; a large S
// is async.
#include "towers/modes/hogwild.h"

namespace towers {

namespace {

class SspGate final : public Hogwild {
 public:
  explicit SspGate(const EngineConfig& cfg) : Hogwild(cfg), bound_(cfg.staleness) {}

  bool gate_open(int tower, ModeContext& ctx) override {
    return ctx.store.clock(tower) - ctx.store.min_clock() <= bound_;
  }

 protected:
  bool recheck_after_push() const override { return true; }

 private:
  int64_t bound_;
};

}  // namespace

std::unique_ptr<ModePolicy> make_ssp_gate(const EngineConfig& cfg) {
  return std::make_unique<SspGate>(cfg);
}

}  // namespace towers
