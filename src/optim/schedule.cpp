#include "optim/schedule.h"

#include <algorithm>
#include <cmath>

#include <fmt/ranges.h>

#include "core/check.h"

namespace towers {

std::vector<std::string> schedule_names() { return {"constant", "exponential", "cosine"}; }

void validate(const ScheduleConfig& s) {
  const auto names = schedule_names();
  TOWERS_REQUIRE(std::find(names.begin(), names.end(), s.kind) != names.end(),
                 "--lr-schedule: unknown schedule '{}' (known: {})", s.kind, fmt::join(names, ", "));
  TOWERS_REQUIRE(std::isfinite(s.lr) && s.lr > 0.0f, "--lr must be a positive number, got {}", s.lr);
  TOWERS_REQUIRE(s.decay_epochs > 0.0, "--decay-epochs must be positive, got {}", s.decay_epochs);
  TOWERS_REQUIRE(s.decay_factor > 0.0f && s.decay_factor <= 1.0f,
                 "--decay-factor must be in (0, 1], got {}", s.decay_factor);
  TOWERS_REQUIRE(s.warmup_epochs >= 0.0, "--warmup-epochs must be >= 0, got {}", s.warmup_epochs);
}

float learning_rate(const ScheduleConfig& s, double epoch) {
  double lr = s.lr;
  if (s.kind == "exponential") {
    lr *= std::pow(static_cast<double>(s.decay_factor), std::floor(epoch / s.decay_epochs));
  } else if (s.kind == "cosine") {
    double t = std::clamp(epoch / s.total_epochs, 0.0, 1.0);
    lr *= 0.5 * (1.0 + std::cos(3.141592653589793 * t));
  }
  if (s.warmup_epochs > 0.0 && epoch < s.warmup_epochs) lr *= epoch / s.warmup_epochs;
  return static_cast<float>(lr);
}

}  // namespace towers
