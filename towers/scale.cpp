#include "towers/scale.h"

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/check.h"
#include "towers/tower_group.h"

namespace towers {

namespace {

// The first Python that has matplotlib (a Debian machine's may not be first on PATH).
std::string python_with_matplotlib() {
  for (const char* py : {"python3", "/usr/bin/python3"}) {
    std::string cmd = fmt::format("{} -c 'import matplotlib' >/dev/null 2>&1", py);
    if (std::system(cmd.c_str()) == 0) return py;
  }
  return "";
}

}  // namespace

void run_scale(const ScaleConfig& cfg) {
  TOWERS_REQUIRE(!cfg.towers.empty(), "--towers needs at least one count");
  for (int n : cfg.towers) TOWERS_REQUIRE(n >= 1, "--towers: counts must be >= 1, got {}", n);
  for (const auto& m : cfg.modes)
    TOWERS_REQUIRE(mode_named(m), "--modes: unknown mode '{}' (known: {})", m, mode_names());
  TOWERS_REQUIRE(!cfg.base.resume && cfg.base.checkpoint_dir.empty(),
                 "towers scale writes no checkpoints and resumes nothing");
  // Check the whole sweep's flags before the first run starts.
  for (const auto& m : cfg.modes)
    for (int n : cfg.towers) {
      TrainConfig c = cfg.base;
      c.mode = m, c.towers = n, c.staleness = m == "ssp" ? cfg.ssp_staleness : -1;
      validate(c);
    }
  std::filesystem::create_directories(cfg.out_dir);

  nlohmann::json rows = nlohmann::json::array();
  std::map<std::string, double> base_ips;
  for (const auto& m : cfg.modes)
    for (int n : cfg.towers) {
      TrainConfig c = cfg.base;
      c.mode = m;
      c.towers = n;
      c.staleness = m == "ssp" ? cfg.ssp_staleness : -1;
      c.metrics_path = fmt::format("{}/{}-{}.jsonl", cfg.out_dir, m, n);
      if (!c.quiet) fmt::print(stderr, "== {} x {} tower(s)\n", m, n);
      TrainSummary s = train(c);
      if (s.interrupted) return;
      const double ips = s.train_images_per_sec;
      // Efficiency is relative to the first (smallest) tower count of the sweep.
      if (n == cfg.towers.front()) base_ips[m] = ips / n;
      rows.push_back({{"mode", m},
                      {"towers", n},
                      {"threads_per_tower", c.threads_per_tower},
                      {"steps", s.steps},
                      {"epochs", s.epochs},
                      {"images_per_sec", ips},
                      {"efficiency", ips / (n * base_ips[m])},
                      {"test_accuracy", s.test_accuracy},
                      {"wall_seconds", s.wall_seconds},
                      {"time_to_target", s.time_to_target >= 0 ? nlohmann::json(s.time_to_target) : nlohmann::json()},
                      {"max_staleness", s.tower_stats["max_staleness"]},
                      {"dropped_gradients", s.tower_stats["dropped_gradients"]},
                      {"metrics", c.metrics_path}});
    }

  const std::string json_path = cfg.out_dir + "/scale.json", csv_path = cfg.out_dir + "/scale.csv";
  nlohmann::json doc = {{"config", to_json(cfg.base)},
                        {"target_accuracy", cfg.base.target_accuracy},
                        {"runs", rows}};
  std::ofstream(json_path) << doc.dump(2) << "\n";
  std::ofstream csv(csv_path);
  csv << "mode,towers,threads_per_tower,steps,epochs,images_per_sec,efficiency,test_accuracy,"
         "wall_seconds,time_to_target,max_staleness,dropped_gradients\n";
  for (const auto& r : rows) {
    const auto ttt = r["time_to_target"];
    csv << fmt::format("{},{},{},{},{:.4f},{:.2f},{:.4f},{:.4f},{:.2f},{},{},{}\n",
                       r["mode"].get<std::string>(), r["towers"].get<int>(),
                       r["threads_per_tower"].get<int>(), r["steps"].get<int64_t>(),
                       r["epochs"].get<double>(), r["images_per_sec"].get<double>(),
                       r["efficiency"].get<double>(), r["test_accuracy"].get<double>(),
                       r["wall_seconds"].get<double>(),
                       ttt.is_null() ? std::string() : fmt::format("{:.2f}", ttt.get<double>()),
                       r["max_staleness"].get<int64_t>(), r["dropped_gradients"].get<int64_t>());
  }
  csv.close();
  fmt::print("towers scale: wrote {} and {}\n", csv_path, json_path);
  for (const auto& r : rows)
    fmt::print("  {:<6} {:>2} tower(s): {:>8.0f} images/s  efficiency {:>5.2f}  test accuracy {:.2f}%{}\n",
               r["mode"].get<std::string>(), r["towers"].get<int>(),
               r["images_per_sec"].get<double>(), r["efficiency"].get<double>(),
               100.0 * r["test_accuracy"].get<double>(),
               r["time_to_target"].is_null() ? std::string()
                                             : fmt::format("  time to target {:.0f} s", r["time_to_target"].get<double>()));

  if (cfg.plot_script.empty()) return;
  const std::string py = python_with_matplotlib();
  if (py.empty()) {
    fmt::print(stderr, "towers scale: no Python with matplotlib found; no plot (data is in {})\n", csv_path);
    return;
  }
  const std::string cmd = fmt::format("{} '{}' '{}'", py, cfg.plot_script, cfg.out_dir);
  if (std::system(cmd.c_str()) != 0)
    fmt::print(stderr, "towers scale: the plot script failed: {}\n", cmd);
}

}  // namespace towers
