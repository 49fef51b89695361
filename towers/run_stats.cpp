#include "towers/run_stats.h"

#include <algorithm>
#include <string>

namespace towers {

void RunStats::tower_step(int tower, double seconds, int64_t examples) {
  step_seconds_[tower].push_back(seconds);
  examples_[tower] += examples;
}

void RunStats::update(int64_t staleness) { ++histogram_[staleness]; }

int64_t RunStats::dropped_total() const {
  int64_t n = 0;
  for (const auto& [t, d] : dropped_) n += d;
  return n;
}

namespace {
double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t k = std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1) + 0.5));
  return v[k];
}
}  // namespace

nlohmann::json RunStats::to_json(double wall_seconds) const {
  nlohmann::json hist = nlohmann::json::object();
  for (const auto& [s, n] : histogram_) hist[std::to_string(s)] = n;
  nlohmann::json towers = nlohmann::json::array();
  for (size_t t = 0; t < step_seconds_.size(); ++t) {
    const auto& v = step_seconds_[t];
    auto it = dropped_.find(static_cast<int>(t));
    towers.push_back({{"tower", t},
                      {"steps", v.size()},
                      {"applied", applied_[t]},
                      {"dropped", it == dropped_.end() ? 0 : it->second},
                      {"images_per_sec", wall_seconds > 0 ? examples_[t] / wall_seconds : 0.0},
                      {"step_ms_p50", 1e3 * percentile(v, 0.5)},
                      {"step_ms_p90", 1e3 * percentile(v, 0.9)},
                      {"step_ms_p99", 1e3 * percentile(v, 0.99)}});
  }
  return {{"staleness_histogram", hist},
          {"max_staleness", max_staleness()},
          {"dropped_gradients", dropped_total()},
          {"towers", towers}};
}

}  // namespace towers
