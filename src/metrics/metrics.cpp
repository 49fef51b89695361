#include "metrics/metrics.h"

#include <cerrno>
#include <cmath>
#include <cstring>

#include <fmt/format.h>
#include <unistd.h>

#include "core/check.h"

namespace towers {

MetricsWriter::MetricsWriter(const std::string& path, bool append) : path_(path) {
  if (path.empty()) return;
  file_ = std::fopen(path.c_str(), append ? "a" : "w");
  TOWERS_REQUIRE(file_ != nullptr, "--metrics: cannot open '{}' for writing: {}", path,
                 std::strerror(errno));
}

MetricsWriter::~MetricsWriter() {
  if (file_ != nullptr) std::fclose(file_);
}

void MetricsWriter::write(const nlohmann::json& event) {
  if (file_ == nullptr) return;
  std::string s = event.dump() + "\n";
  TOWERS_REQUIRE(std::fwrite(s.data(), 1, s.size(), file_) == s.size() && std::fflush(file_) == 0,
                 "--metrics: writing '{}' failed: {}", path_, std::strerror(errno));
}

std::string format_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  auto t = static_cast<int64_t>(s + 0.5);
  if (t >= 3600) return fmt::format("{}h{:02}m", t / 3600, t % 3600 / 60);
  if (t >= 60) return fmt::format("{}m{:02}s", t / 60, t % 60);
  return fmt::format("{}s", t);
}

Progress::Progress(std::FILE* out) : out_(out), live_(isatty(fileno(out)) != 0) {}

void Progress::update(int64_t step, int64_t total, double epoch, double loss, double ips,
                      double eta, int64_t every) {
  const auto now = std::chrono::steady_clock::now();
  std::string text = fmt::format("step {}/{}  epoch {:.2f}  loss {:.4f}  {:.0f} images/s  ETA {}",
                                 step, total, epoch, loss, ips, format_duration(eta));
  if (live_) {
    // Redraw at most 10 times a second; always show the last step.
    if (step != total && now - last_ < std::chrono::milliseconds(100)) return;
    fmt::print(out_, "\r\033[K{}", text);
    std::fflush(out_);
    dirty_ = true;
  } else if (step % every == 0 || step == total) {
    fmt::print(out_, "{}\n", text);
    std::fflush(out_);
  }
  last_ = now;
}

void Progress::line(const std::string& text) {
  if (dirty_) fmt::print(out_, "\n");
  dirty_ = false;
  fmt::print(out_, "{}\n", text);
  std::fflush(out_);
}

}  // namespace towers
