// bench/sanitize.py, the GPU run's compute-sanitizer queue, against stand-ins for the tool: it
// must count a test as checked only where the tool printed its error summary and the job
// ended as a sanitizer run does, report errors, failures, crashes and cut jobs, end what it
// cut, and check again just the tests it did not finish. The program under the stand-ins is
// this binary with a few quick tests.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
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
constexpr const char* kRun = "memcheck|memcheck|{}|";  // of kTests
// Four parameterised tests (Suite/Name.Test/param).
constexpr const char* kShapes =
    "shapes|memcheck|Shapes/ConvTest.ForwardMatchesDirectConvolution/*|";

using testutil::run_command;

std::string read_text(const std::string& path) {
  std::ifstream f(path);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

// Whether a process lives (a zombie does not: it has ended and waits to be reaped).
bool alive(pid_t pid) {
  if (kill(pid, 0) != 0) return false;
  const std::string stat = read_text(fmt::format("/proc/{}/stat", pid));
  const size_t paren = stat.rfind(')');
  return paren == std::string::npos || stat.compare(paren, 3, ") Z") != 0;
}

// Counts a file's lines.
long lines(const std::string& path) {
  const std::string text = read_text(path);
  return static_cast<long>(std::count(text.begin(), text.end(), '\n'));
}

class SanitizeScript : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string out;
    if (run_command("python3 -c 'import sys; sys.exit(sys.version_info < (3, 8))'", &out) != 0)
      GTEST_SKIP() << "python3 (3.8 or later) is not available";
    dir_ = fs::path(testutil::test_path("sanitize")).string();
    fs::create_directories(dir_);
  }

  // A stand-in for compute-sanitizer: `args` holds the program and its flags (the tool's
  // flags dropped), `tests` the names in its --gtest_filter; then `body`.
  std::string stand_in(const std::string& name, const std::string& body) const {
    const std::string path = dir_ + "/" + name;
    std::ofstream f(path);
    f << "#!/bin/bash\nargs=()\ntests=()\nwhile [ $# -gt 0 ]; do\n  case \"$1\" in\n"
         "    --tool|--error-exitcode|--report-api-errors) shift 2 ;;\n"
         "    --gtest_filter=*) IFS=: read -ra tests <<< \"${1#--gtest_filter=}\"; "
         "args+=(\"$1\"); shift ;;\n"
         "    *) args+=(\"$1\"); shift ;;\n  esac\ndone\n"
      << body << "\n";
    f.close();
    fs::permissions(path, fs::perms::owner_all);
    return path;
  }
  // One that runs the program and then prints `summary`, exiting with the program's code.
  std::string runs_then(const std::string& name, const std::string& summary) const {
    return stand_in(name, "\"${args[@]}\"; rc=$?\necho '" + summary + "'\nexit $rc");
  }
  // One that runs nothing: it prints each test's line (FAILED, with a parameter, for
  // `fails`), the summary, and exits with `code`.
  std::string prints(const std::string& name, const std::string& fails,
                     const std::string& code) const {
    return stand_in(name,
                    "for t in \"${tests[@]}\"; do\n  if [ \"$t\" = '" + fails +
                        "' ]; then echo \"[  FAILED  ] $t, where GetParam() = (1 ms) (7 ms)\"\n"
                        "  else echo \"[       OK ] $t (3 ms)\"; fi\ndone\n"
                        "echo '========= ERROR SUMMARY: 0 errors'\nexit " +
                        code);
  }

  // One that starts two sleepers, one of them in a session of its own, writes their pids to
  // `pids`, and waits for them.
  std::string hanging(const std::string& name, const std::string& pids) const {
    return stand_in(name, "sleep 600 &\necho $! >> '" + pids + "'\nsetsid bash -c 'echo $$ >> \"" +
                              pids +
                              "\"; exec sleep 600' &\nwait\n"
                              "echo '========= ERROR SUMMARY: 0 errors'");
  }
  // Every process named in `pids` has ended (within a few seconds: a killed process may take
  // a moment to go).
  static void expect_ended(const std::string& pids) {
    ASSERT_GE(lines(pids), 2);
    std::ifstream sleepers(pids);
    for (pid_t pid; sleepers >> pid;) {
      for (int i = 0; i < 50 && alive(pid); ++i) usleep(100000);
      EXPECT_FALSE(alive(pid)) << "sleeper " << pid << " lives on";
    }
  }

  // sanitize.py with the given runs under `sanitizer`; its exit code and output.
  int sanitize(const std::string& sanitizer, const std::string& out, double seconds,
               std::string* output, const std::string& runs = "",
               const std::string& extra = "") const {
    return run_command(
        fmt::format("python3 '{}/bench/sanitize.py' --tests /proc/{}/exe --out '{}/{}' "
                    "--seconds {} --slots 2 --sanitizer '{}' {} '{}'",
                    TOWERS_SOURCE_DIR, getpid(), dir_, out, seconds, sanitizer, extra,
                    runs.empty() ? fmt::format(kRun, kTests) : runs),
        output);
  }
  std::string dir_;
};

TEST_F(SanitizeScript, CleanToolChecksEveryTestOfEveryRun) {
  const std::string tool = runs_then("clean", "========= ERROR SUMMARY: 0 errors");
  std::string out;
  const std::string runs = fmt::format(kRun, kTests) + "' '" + kShapes;
  EXPECT_EQ(sanitize(tool, "out", 120, &out, runs), 0) << out;
  EXPECT_NE(out.find("sanitizer memcheck: 0 errors; tests passed 3, failed 0, skipped 0, "
                     "unfinished 0 of 3\n"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("sanitizer shapes: 0 errors; tests passed 4, failed 0, skipped 0, "
                     "unfinished 0 of 4\n"),
            std::string::npos)
      << out;
  const std::string times = read_text(dir_ + "/out/sanitizer-times.txt");
  EXPECT_NE(times.find("memcheck|Checkpoint.RoundTripIsBitwise "), std::string::npos) << times;
  EXPECT_NE(times.find("shapes|Shapes/ConvTest.ForwardMatchesDirectConvolution/c2x7x6_k3s2_same "),
            std::string::npos)
      << times;
  EXPECT_EQ(lines(dir_ + "/out/sanitizer-times.txt"), 7) << times;
  EXPECT_EQ(read_text(dir_ + "/out/sanitizer-unfinished.txt"), "");
}

// A suite run in shards sets GTEST_TOTAL_SHARDS and GTEST_SHARD_INDEX, which the jobs must
// not inherit (they would leave their tests to other shards), nor GTEST_BRIEF.
TEST_F(SanitizeScript, TheCallersGtestEnvironmentDoesNotReachTheJobs) {
  const std::string tool = runs_then("clean", "========= ERROR SUMMARY: 0 errors");
  std::string out;
  EXPECT_EQ(
      run_command(fmt::format("GTEST_TOTAL_SHARDS=2 GTEST_SHARD_INDEX=1 GTEST_BRIEF=1 python3 "
                              "'{}/bench/sanitize.py' --tests /proc/{}/exe --out '{}/out' "
                              "--seconds 120 --slots 2 --sanitizer '{}' '{}'",
                              TOWERS_SOURCE_DIR, getpid(), dir_, tool, fmt::format(kRun, kTests)),
                  &out),
      0)
      << out;
  EXPECT_NE(out.find("tests passed 3, failed 0, skipped 0, unfinished 0 of 3\n"), std::string::npos)
      << out;
}

TEST_F(SanitizeScript, ErrorsAndRacecheckSummariesAreCounted) {
  const std::string memcheck =
      stand_in("errors", "\"${args[@]}\"\necho '========= ERROR SUMMARY: 2 errors'\nexit 99");
  std::string out;
  EXPECT_EQ(sanitize(memcheck, "out", 120, &out), 1) << out;
  // Every job's summary counts: 2 errors a job.
  const long n = lines(dir_ + "/out/sanitizer-jobs.txt");
  EXPECT_GE(n, 1);
  EXPECT_NE(out.find(fmt::format("sanitizer memcheck: {} errors; tests passed 3,", 2 * n)),
            std::string::npos)
      << out;
  const std::string racecheck =
      stand_in("races",
               "\"${args[@]}\"\necho '========= RACECHECK SUMMARY: 1 hazard displayed (1 error, "
               "0 warnings)'\nexit 99");
  EXPECT_EQ(sanitize(racecheck, "out2", 120, &out), 1) << out;
  EXPECT_NE(out.find(fmt::format("sanitizer memcheck: {} errors;", n)), std::string::npos) << out;
}

TEST_F(SanitizeScript, FailedTestsAndCrashesAfterTheSummaryFailTheRun) {
  std::string out;
  const std::string failing =
      prints("fails", "Shapes/ConvTest.ForwardMatchesDirectConvolution/c2x9x9_k4s1_same", "1");
  EXPECT_EQ(sanitize(failing, "failed", 120, &out, kShapes), 1) << out;
  EXPECT_NE(out.find("sanitizer shapes: 0 errors; tests passed 3, failed 1, skipped 0, "
                     "unfinished 0 of 4\n  failed: Shapes/ConvTest.ForwardMatchesDirectConvolution/"
                     "c2x9x9_k4s1_same\n"),
            std::string::npos)
      << out;
  // Every test passed and the tool found nothing, but the job ended with a crash.
  const std::string crashes = prints("crashes", "", "139");
  EXPECT_EQ(sanitize(crashes, "crashed", 120, &out, kShapes), 1) << out;
  EXPECT_NE(out.find("tests passed 4, failed 0, skipped 0, unfinished 0 of 4\n"), std::string::npos)
      << out;
  EXPECT_NE(out.find("a job ended abnormally after its error summary: exit 139"), std::string::npos)
      << out;
  // The same lines with a clean exit pass: the stand-in's lines are read as the tool's.
  EXPECT_EQ(sanitize(prints("passes", "", "0"), "passed", 120, &out, kShapes), 0) << out;
}

TEST_F(SanitizeScript, ATestWithoutTheToolsSummaryIsUnfinishedAndCheckedAgain) {
  // The tool prints no summary: the tests ran, but they do not count.
  std::string out;
  EXPECT_EQ(sanitize(runs_then("silent", "(no summary)"), "silent-out", 120, &out), 1) << out;
  EXPECT_NE(out.find("unfinished 3 of 3"), std::string::npos) << out;
  // A tool that hangs is cut at the time limit, and what it started is ended with it: its
  // process group, and a process it moved to a session of its own.
  const std::string pids = dir_ + "/sleepers";
  const std::string hangs = hanging("hangs", pids);
  // (10 s: listing the tests and starting the jobs must fit well inside it on a loaded machine)
  EXPECT_EQ(sanitize(hangs, "cut", 10, &out), 1) << out;
  EXPECT_NE(out.find("unfinished 3 of 3"), std::string::npos) << out;
  EXPECT_NE(read_text(dir_ + "/cut/sanitizer-jobs.txt").find("cut at the time limit"),
            std::string::npos);
  expect_ended(pids);
  const std::string unfinished = read_text(dir_ + "/cut/sanitizer-unfinished.txt");
  EXPECT_NE(unfinished.find("memcheck|Checkpoint.LatestPicksHighestStep\n"), std::string::npos)
      << unfinished;
  // Only the unfinished ones again, with a tool that finishes.
  const std::string clean = runs_then("clean", "========= ERROR SUMMARY: 0 errors");
  EXPECT_EQ(sanitize(clean, "again", 120, &out, "",
                     fmt::format("--only '{}/cut/sanitizer-unfinished.txt'", dir_)),
            0)
      << out;
  EXPECT_NE(out.find("unfinished 0 of 3"), std::string::npos) << out;
}

// The lease's time limit ends a phase by signalling its whole session: the tools and the
// script at once. The script still ends what the tools started, and writes its report.
TEST_F(SanitizeScript, ASignalToTheWholeSessionEndsEverythingAndLeavesTheReport) {
  std::string out;
  if (run_command("command -v pkill && command -v setsid", &out) != 0)
    GTEST_SKIP() << "pkill or setsid is not available";
  const std::string pids = dir_ + "/sleepers";
  const std::string hangs = hanging("hangs", pids);
  EXPECT_EQ(
      run_command(
          fmt::format("setsid python3 '{}/bench/sanitize.py' --tests /proc/{}/exe --out "
                      "'{}/out' --seconds 120 --slots 2 --sanitizer '{}' '{}' > '{}/log' 2>&1 "
                      "& p=$!; while [ $(cat '{}' 2>/dev/null | wc -l) -lt 4 ]; do sleep 0.1; "
                      "done; pkill -TERM -s $p; wait $p",
                      TOWERS_SOURCE_DIR, getpid(), dir_, hangs, fmt::format(kRun, kTests), dir_,
                      pids),
          &out),
      1)
      << out << read_text(dir_ + "/log");
  const std::string log = read_text(dir_ + "/log");
  EXPECT_NE(log.find("unfinished 3 of 3"), std::string::npos) << log;
  EXPECT_NE(log.find("(ended by a signal)"), std::string::npos) << log;
  expect_ended(pids);
}

TEST_F(SanitizeScript, AFilterOfNoTestsAndStaleEntriesFailTheRun) {
  const std::string clean = runs_then("clean", "========= ERROR SUMMARY: 0 errors");
  std::string out;
  EXPECT_EQ(sanitize(clean, "none", 120, &out, "memcheck|memcheck|NoSuchSuite.*|"), 1) << out;
  EXPECT_NE(out.find("unfinished 0 of 0 (its filter selects no test)"), std::string::npos) << out;
  std::ofstream(dir_ + "/stale.txt") << "memcheck|Checkpoint.RoundTripIsBitwise\n"
                                     << "memcheck|Checkpoint.NoLongerThere\n";
  EXPECT_EQ(sanitize(clean, "stale", 120, &out, "", fmt::format("--only '{}/stale.txt'", dir_)), 1)
      << out;
  EXPECT_NE(out.find("tests passed 1, failed 0, skipped 0, unfinished 0 of 1"), std::string::npos)
      << out;
  EXPECT_NE(out.find("--only: 'memcheck|Checkpoint.NoLongerThere' names no test of the runs"),
            std::string::npos)
      << out;
}

TEST_F(SanitizeScript, BadArgumentsAreRefused) {
  std::string out;
  const std::string tests = fmt::format("/proc/{}/exe", getpid());
  const auto call = [&](const std::string& args) {
    return run_command(fmt::format("python3 '{}/bench/sanitize.py' {}", TOWERS_SOURCE_DIR, args),
                       &out);
  };
  EXPECT_NE(call(fmt::format("--tests {} --out '{}' --seconds 10 --slots 0 '{}'", tests, dir_,
                             fmt::format(kRun, kTests))),
            0);
  EXPECT_NE(out.find("--slots must be at least 1"), std::string::npos) << out;
  EXPECT_NE(call(fmt::format("--tests {} --out '{}' --seconds 10 --slots 1 'memcheck|memcheck'",
                             tests, dir_)),
            0);
  EXPECT_NE(out.find("a run is NAME|TOOL|GTEST_FILTER|EXTRA_FLAGS"), std::string::npos) << out;
  EXPECT_NE(call(fmt::format("--tests '{}/none' --out '{}' --seconds 10 --slots 1 '{}'", dir_, dir_,
                             fmt::format(kRun, kTests))),
            0);
  EXPECT_NE(out.find("--tests: '" + dir_ + "/none' is not an executable file"), std::string::npos)
      << out;
  EXPECT_NE(call(fmt::format("--tests {} --out '{}' --seconds 10 --slots 1 --sanitizer "
                             "no-such-sanitizer '{}'",
                             tests, dir_, fmt::format(kRun, kTests))),
            0);
  EXPECT_NE(out.find("--sanitizer: 'no-such-sanitizer' is not a program on the PATH"),
            std::string::npos)
      << out;
}

}  // namespace
}  // namespace towers
