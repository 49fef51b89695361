// cli_util.h — what the end-to-end tests share: running the towers binary, a fresh temporary
// path per test, and reading a metrics file's events.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "target/target.h"

namespace towers::testutil {

// The towers binary under test: the build's own, or $TOWERS_BINARY where the build tree was
// moved (a build carried to a GPU machine).
inline std::string towers_binary() {
  const char* env = std::getenv("TOWERS_BINARY");
  return env != nullptr && *env != '\0' ? env : built_towers_binary();
}

// A small net with two BatchNorm layers (after a convolution and after a dense layer), as a
// model file, for the --sync-bn tests on 1x12x12 synthetic inputs.
inline constexpr const char* kBatchNormNet = R"({"name": "bn", "input": [1, 12, 12], "classes": 10, "layers": [
  {"name": "conv", "type": "conv2d", "filters": 16, "kernel": 3, "relu": false,
   "weight_init": {"stddev": 0.2}},
  {"name": "bn", "type": "batchnorm"},
  {"name": "act", "type": "relu"},
  {"name": "gap", "type": "global_avg_pool"},
  {"name": "flat", "type": "dense", "units": 32, "relu": false, "weight_init": {"stddev": 0.1}},
  {"name": "bn2", "type": "batchnorm"},
  {"name": "out", "type": "dense", "units": 10, "relu": false, "weight_init": {"stddev": 0.1}}]})";

// Runs a shell command and returns its exit code; stdout and stderr go to *output.
inline int run_command(const std::string& command, std::string* output = nullptr) {
  const std::string cmd = command + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return -1;
  std::array<char, 4096> buf{};
  std::string out;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
  int status = pclose(p);
  if (output) *output = out;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128;
}

// Runs `towers <args>` and returns its exit code; stdout and stderr go to *output.
inline int run_towers(const std::string& args, std::string* output = nullptr) {
  return run_command(towers_binary() + " " + args, output);
}

// This process's folder of tests' files: TempDir/<prefix><pid>. test_path's prefix is
// "towers_test_", cli_test.cpp's temp_dir's "towers_cli_".
inline std::filesystem::path process_folder(const std::string& prefix) {
  return std::filesystem::path(::testing::TempDir()) / (prefix + std::to_string(getpid()));
}

// The folder of a test's files: <process_folder>/<suite>.<test>.
inline std::filesystem::path test_folder(const std::string& prefix,
                                         const ::testing::TestInfo& info) {
  return process_folder(prefix) / (std::string(info.test_suite_name()) + "." + info.name());
}

// A test's folders go when it passes (or skips); a failed test's stay, and the test's output
// says where. The process's folders go at its end once they are empty. (Runs, checkpoints and
// datasets of the end-to-end tests come to about a gigabyte per run of the suite.)
class RemovePassedTestsFolders : public ::testing::EmptyTestEventListener {
 public:
  static constexpr const char* kPrefixes[] = {"towers_test_", "towers_cli_"};
  void OnTestEnd(const ::testing::TestInfo& info) override {
    namespace fs = std::filesystem;
    for (const char* prefix : kPrefixes) {
      const fs::path dir = test_folder(prefix, info);
      std::error_code ec;
      if (!fs::exists(dir, ec)) continue;
      if (info.result()->Failed()) {
        std::printf("[  KEPT    ] %s (the failed test's files)\n", dir.c_str());
        continue;
      }
      fs::remove_all(dir, ec);
      // A parameterised test's name has slashes ("Models/Suite.Test/1"): its emptied parents
      // below the process's folder go too (remove: only an empty folder).
      const fs::path top = process_folder(prefix);
      for (fs::path p = dir.parent_path(); p != top; p = p.parent_path())
        if (!fs::remove(p, ec)) break;
    }
  }
  void OnTestProgramEnd(const ::testing::UnitTest&) override {
    namespace fs = std::filesystem;
    for (const char* prefix : kPrefixes) {
      std::error_code ec;
      fs::remove(process_folder(prefix), ec);  // only an empty folder
    }
  }
};
inline const bool kRemovePassedTestsFolders = [] {
  ::testing::UnitTest::GetInstance()->listeners().Append(new RemovePassedTestsFolders);
  return true;
}();

// A path inside a folder of its own for the running test; nothing exists there yet.
inline std::string test_path(const std::string& name) {
  namespace fs = std::filesystem;
  const fs::path dir =
      test_folder("towers_test_", *::testing::UnitTest::GetInstance()->current_test_info());
  fs::create_directories(dir);
  fs::remove_all(dir / name);
  return (dir / name).string();
}

// The records of one kind ("step", "eval", "summary", ...) of JSON lines.
inline std::vector<nlohmann::json> events_in(std::istream& in, const std::string& kind) {
  std::vector<nlohmann::json> out;
  std::string line;
  while (std::getline(in, line)) {
    nlohmann::json j = nlohmann::json::parse(line);
    if (j["event"] == kind) out.push_back(j);
  }
  return out;
}

// The records of one kind of a JSON-lines metrics file.
inline std::vector<nlohmann::json> metrics_events(const std::string& path,
                                                  const std::string& kind) {
  std::ifstream in(path);
  return events_in(in, kind);
}

// The same, read while the run still writes the file: a last line without its newline is
// being written, and is left out (metrics_events would fail to parse it).
inline std::vector<nlohmann::json> live_metrics_events(const std::string& path,
                                                       const std::string& kind) {
  std::ifstream file(path);
  std::string text((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  text.resize(text.rfind('\n') + 1);  // (npos + 1 is 0: no complete line yet)
  std::istringstream in(text);
  return events_in(in, kind);
}

// Replays the towers that applied each update, in order, and returns the largest lead
// (completed steps of the fastest tower minus the slowest) ever seen.
inline int64_t max_lead(const std::vector<int>& tower_of_update, int towers) {
  std::vector<int64_t> clock(towers, 0);
  int64_t lead = 0;
  for (int t : tower_of_update) {
    ++clock[t];
    lead = std::max(lead, *std::max_element(clock.begin(), clock.end()) -
                              *std::min_element(clock.begin(), clock.end()));
  }
  return lead;
}

// The same over the "step" records of a metrics file.
inline int64_t max_lead(const std::vector<nlohmann::json>& steps, int towers) {
  std::vector<int> tower_of_update;
  for (const auto& s : steps) tower_of_update.push_back(s["tower"].get<int>());
  return max_lead(tower_of_update, towers);
}

}  // namespace towers::testutil
