// run_stats.h — what a run records about its towers: the staleness of every update (a
// histogram), per-tower step counts and step-time percentiles, dropped gradients. Users must
// see stragglers.
#pragma once

#include <cstdint>
#include <map>
#include <vector>

#include <nlohmann/json.hpp>

namespace towers {

class RunStats {
 public:
  explicit RunStats(int towers) : step_seconds_(towers), examples_(towers, 0), applied_(towers, 0) {}

  // A tower finished computing a step (forward + backward) in `seconds` on `examples`.
  void tower_step(int tower, double seconds, int64_t examples);
  // An update was applied with this staleness.
  void update(int64_t staleness);
  void contributed(int tower) { ++applied_[tower]; }  // its gradient went into an update
  void dropped(int tower) { ++dropped_[tower]; }

  int64_t max_staleness() const { return histogram_.empty() ? 0 : histogram_.rbegin()->first; }
  int64_t dropped_total() const;
  // {"staleness_histogram": {"0": n, ...}, "towers": [{"tower", "steps", "applied",
  //  "dropped", "images_per_sec", "step_ms_p50", "p90", "p99"}], "dropped_gradients": n}
  nlohmann::json to_json(double wall_seconds) const;

 private:
  std::map<int64_t, int64_t> histogram_;
  std::vector<std::vector<double>> step_seconds_;
  std::vector<int64_t> examples_, applied_;
  std::map<int, int64_t> dropped_;
};

}  // namespace towers
