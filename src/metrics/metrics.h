// metrics.h — the run's record: JSON lines for machines (--metrics FILE) and a progress line
// for people (live on a terminal, plain lines otherwise).
#pragma once

#include <chrono>
#include <cstdio>
#include <string>

#include <nlohmann/json.hpp>

namespace towers {

// One JSON object per line, flushed per line so a crash loses at most the line being written.
class MetricsWriter {
 public:
  // An empty path writes nothing. append: continue the file of a resumed run.
  MetricsWriter(const std::string& path, bool append);
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;
  void write(const nlohmann::json& event);  // no-op without a file

 private:
  std::FILE* file_ = nullptr;
  std::string path_;
};

class Progress {
 public:
  explicit Progress(std::FILE* out);  // live (\r) updates when out is a terminal
  // Shows step/total, loss, images/s and the ETA. Plain mode prints every `every` steps.
  void update(int64_t step, int64_t total, double epoch, double loss, double images_per_sec,
              double eta_seconds, int64_t every);
  void line(const std::string& text);  // a permanent line (ends a live line first)

 private:
  std::FILE* out_;
  bool live_;
  bool dirty_ = false;
  std::chrono::steady_clock::time_point last_;
};

std::string format_duration(double seconds);  // "1h02m", "3m07s", "12s"

}  // namespace towers
