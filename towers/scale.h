// scale.h — `towers scale`: a tower-scaling experiment in one command. For each mode and tower
// count it trains (fixed steps, or until a target test accuracy), keeps each run's metrics,
// and writes scale.csv / scale.json and, with Python and matplotlib, scale.png:
// images/s and scaling efficiency against towers, and test accuracy against training time.
#pragma once

#include <string>
#include <vector>

#include "towers/trainer.h"

namespace towers {

struct ScaleConfig {
  TrainConfig base;                 // model, data, optimizer, length...
  std::vector<int> towers = {1, 2};
  std::vector<std::string> modes = {"sync", "async"};
  int64_t ssp_staleness = 2;        // the bound of the ssp runs
  std::string out_dir = "runs/scale";
  std::string plot_script;          // bench/plot_scale.py; empty: no plot
};

// Efficiency of N towers = images/s(N) / (N * images/s(1 tower of the same mode)).
void run_scale(const ScaleConfig& cfg);

}  // namespace towers
