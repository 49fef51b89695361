// bench/sanitize.py, the GPU run's compute-sanitizer queue, against stand-ins for the tool: it
// must count a test as checked only where the tool printed its error summary, report errors
// and cut jobs, and check again just the tests it did not finish. The program under the
// stand-ins is this binary with a few quick tests.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include <fmt/format.h>

#include "cli_util.h"

namespace towers {
namespace {

namespace fs = std::filesystem;

constexpr const char* kTests =
    "Safetensors.RoundTripWithAlignedHeaderAndMetadata:Checkpoint.RoundTripIsBitwise:"
    "Checkpoint.LatestPicksHighestStep";

// Runs a shell command; its exit code, and stdout and stderr in *out.
int run(const std::string& cmd, std::string* out) {
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (p == nullptr) return -1;
  std::array<char, 4096> buf{};
  size_t n;
  out->clear();
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) out->append(buf.data(), n);
  const int status = pclose(p);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128;
}

// A stand-in for compute-sanitizer: drops the tool's flags, runs `before`, then the program,
// then prints `summary` as the tool's last line; exits with `exit_code` (or the program's).
std::string stand_in(const std::string& dir, const std::string& name, const std::string& before,
                     const std::string& summary, const std::string& exit_code = "$rc") {
  const std::string path = dir + "/" + name;
  std::ofstream f(path);
  f << "#!/bin/bash\nargs=()\nwhile [ $# -gt 0 ]; do\n  case \"$1\" in\n"
       "    --tool|--error-exitcode|--report-api-errors) shift 2 ;;\n"
       "    *) args+=(\"$1\"); shift ;;\n  esac\ndone\n"
    << before << "\n\"${args[@]}\"; rc=$?\necho '" << summary << "'\nexit " << exit_code << "\n";
  f.close();
  fs::permissions(path, fs::perms::owner_all);
  return path;
}

// sanitize.py with one run of the three tests under `sanitizer`; its exit code and output.
int sanitize(const std::string& sanitizer, const std::string& out, double seconds,
             std::string* output, const std::string& extra = "") {
  return run(fmt::format("python3 '{}/bench/sanitize.py' --tests /proc/{}/exe --out '{}' "
                         "--seconds {} --slots 2 --sanitizer '{}' {} 'memcheck|memcheck|{}|'",
                         TOWERS_SOURCE_DIR, getpid(), out, seconds, sanitizer, extra, kTests),
             output);
}

std::string read_text(const std::string& path) {
  std::ifstream f(path);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

class SanitizeScript : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string out;
    if (run("python3 -c 'import sys; sys.exit(sys.version_info < (3, 8))'", &out) != 0)
      GTEST_SKIP() << "python3 (3.8 or later) is not available";
    dir_ = fs::path(testutil::test_path("sanitize")).string();
    fs::create_directories(dir_);
  }
  std::string dir_;
};

TEST_F(SanitizeScript, CleanToolRunsEveryTestOnce) {
  const std::string tool = stand_in(dir_, "clean", "", "========= ERROR SUMMARY: 0 errors");
  std::string out;
  EXPECT_EQ(sanitize(tool, dir_ + "/out", 120, &out), 0) << out;
  EXPECT_NE(out.find("sanitizer memcheck: 0 errors; tests passed 3, failed 0, skipped 0, "
                     "unfinished 0 of 3"),
            std::string::npos)
      << out;
  const std::string times = read_text(dir_ + "/out/sanitizer-times.txt");
  EXPECT_NE(times.find("memcheck|Checkpoint.RoundTripIsBitwise "), std::string::npos) << times;
  EXPECT_EQ(std::count(times.begin(), times.end(), '\n'), 3) << times;
  EXPECT_EQ(read_text(dir_ + "/out/sanitizer-unfinished.txt"), "");
}

TEST_F(SanitizeScript, ErrorsAndRacecheckSummariesAreCounted) {
  const std::string memcheck =
      stand_in(dir_, "errors", "", "========= ERROR SUMMARY: 2 errors", "99");
  std::string out;
  EXPECT_EQ(sanitize(memcheck, dir_ + "/out", 120, &out), 1) << out;
  // Every job's summary counts: 2 errors a job.
  const std::string jobs = read_text(dir_ + "/out/sanitizer-jobs.txt");
  const auto n = std::count(jobs.begin(), jobs.end(), '\n');
  EXPECT_GE(n, 1);
  EXPECT_NE(out.find(fmt::format("sanitizer memcheck: {} errors; tests passed 3,", 2 * n)),
            std::string::npos)
      << out;
  const std::string racecheck =
      stand_in(dir_, "races", "",
               "========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)", "99");
  EXPECT_EQ(sanitize(racecheck, dir_ + "/out2", 120, &out), 1) << out;
  EXPECT_NE(out.find(fmt::format("sanitizer memcheck: {} errors;", n)), std::string::npos) << out;
}

TEST_F(SanitizeScript, ATestWithoutTheToolsSummaryIsUnfinishedAndCheckedAgain) {
  // The tool prints no summary: the tests ran, but they do not count.
  const std::string silent = stand_in(dir_, "silent", "", "(no summary)");
  std::string out;
  EXPECT_EQ(sanitize(silent, dir_ + "/silent-out", 120, &out), 1) << out;
  EXPECT_NE(out.find("unfinished 3 of 3"), std::string::npos) << out;
  // A tool that hangs is cut at the time limit, and says so.
  const std::string hangs =
      stand_in(dir_, "hangs", "sleep 600", "========= ERROR SUMMARY: 0 errors");
  EXPECT_EQ(sanitize(hangs, dir_ + "/cut", 2, &out), 1) << out;
  EXPECT_NE(out.find("unfinished 3 of 3"), std::string::npos) << out;
  EXPECT_NE(read_text(dir_ + "/cut/sanitizer-jobs.txt").find("cut at the time limit"),
            std::string::npos);
  const std::string unfinished = read_text(dir_ + "/cut/sanitizer-unfinished.txt");
  EXPECT_NE(unfinished.find("memcheck|Checkpoint.LatestPicksHighestStep\n"), std::string::npos)
      << unfinished;
  // Only the unfinished ones again, with a tool that finishes.
  const std::string clean = stand_in(dir_, "clean", "", "========= ERROR SUMMARY: 0 errors");
  EXPECT_EQ(sanitize(clean, dir_ + "/again", 120, &out,
                     fmt::format("--only '{}/cut/sanitizer-unfinished.txt'", dir_)),
            0)
      << out;
  EXPECT_NE(out.find("unfinished 0 of 3"), std::string::npos) << out;
}

TEST_F(SanitizeScript, BadArgumentsAreRefused) {
  std::string out;
  EXPECT_NE(run(fmt::format("python3 '{}/bench/sanitize.py' --tests /proc/{}/exe --out '{}' "
                            "--seconds 10 --slots 0 'memcheck|memcheck|{}|'",
                            TOWERS_SOURCE_DIR, getpid(), dir_, kTests),
                &out),
            0);
  EXPECT_NE(out.find("--slots must be at least 1"), std::string::npos) << out;
  EXPECT_NE(run(fmt::format("python3 '{}/bench/sanitize.py' --tests /proc/{}/exe --out '{}' "
                            "--seconds 10 --slots 1 'memcheck|memcheck'",
                            TOWERS_SOURCE_DIR, getpid(), dir_),
                &out),
            0);
  EXPECT_NE(out.find("a run is NAME|TOOL|GTEST_FILTER|EXTRA_FLAGS"), std::string::npos) << out;
  EXPECT_NE(run(fmt::format("python3 '{}/bench/sanitize.py' --tests '{}/none' --out '{}' "
                            "--seconds 10 --slots 1 'memcheck|memcheck|{}|'",
                            TOWERS_SOURCE_DIR, dir_, dir_, kTests),
                &out),
            0);
  EXPECT_NE(out.find("--tests: '" + dir_ + "/none' is not an executable file"), std::string::npos)
      << out;
}

}  // namespace
}  // namespace towers
