// schedule.h — learning-rate schedules as functions of the epoch (examples seen / train size),
// never of the step, so the number of towers or the batch size does not change the schedule
// (DESIGN.md, decision 6).
#pragma once

#include <string>
#include <vector>

namespace towers {

struct ScheduleConfig {
  std::string kind = "constant";  // constant | exponential | cosine
  float lr = 0.1f;
  double decay_epochs = 350.0;    // exponential: lr * factor^floor(epoch / decay_epochs)
  float decay_factor = 0.1f;
  double total_epochs = 1.0;      // cosine: lr * (1 + cos(pi * epoch / total)) / 2
  double warmup_epochs = 0.0;     // linear ramp from 0 over the first warmup epochs
};

std::vector<std::string> schedule_names();
void validate(const ScheduleConfig& s);  // throws naming the flag
float learning_rate(const ScheduleConfig& s, double epoch);

}  // namespace towers
