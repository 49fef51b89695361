// io_faults_test.cpp — what a run does when the disk under it fails: a full disk during a
// checkpoint write, a checkpoint folder that becomes read-only, a metrics file that cannot be
// written, a dataset file that changes under a running job. Each must end in a clear error
// naming the file (exit 1, never a crash), with the last good checkpoint intact and loadable
// and no half-written file visible.
//
// The faults are real: each test mounts a small tmpfs of its own (mount(2); root or
// CAP_SYS_ADMIN). Where mounting is not allowed the test skips and says why.
#include <sys/mount.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "cli_util.h"

namespace towers {
namespace {

namespace fs = std::filesystem;
using testutil::run_towers;
using testutil::test_path;

// A tmpfs of `kib` KiB mounted on a fresh folder for the life of the object.
class Tmpfs {
 public:
  explicit Tmpfs(int kib) : dir_(test_path("mnt")) {
    fs::create_directories(dir_);
    const std::string opts = "size=" + std::to_string(kib) + "k,mode=0755";
    if (::mount("tmpfs", dir_.c_str(), "tmpfs", 0, opts.c_str()) != 0)
      why_not_ = std::string("cannot mount a tmpfs here: ") + std::strerror(errno);
  }
  ~Tmpfs() {
    if (why_not_.empty()) ::umount2(dir_.c_str(), MNT_DETACH);
  }
  bool mounted() const { return why_not_.empty(); }
  const std::string& why_not() const { return why_not_; }
  const std::string& dir() const { return dir_; }
  // Read-only from now on. Retries while a file is still open for writing (EBUSY).
  bool make_read_only() const {
    for (int i = 0; i < 2000; ++i) {
      if (::mount("tmpfs", dir_.c_str(), "tmpfs", MS_REMOUNT | MS_RDONLY, nullptr) == 0)
        return true;
      if (errno != EBUSY) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return false;
  }

 private:
  std::string dir_, why_not_;
};

#define SKIP_UNLESS_MOUNTED(t) \
  if (!(t).mounted()) GTEST_SKIP() << (t).why_not()

// A towers process in the background, its output in a file.
class Background {
 public:
  Background(const std::string& args, const std::string& log) {
    const std::string cmd = testutil::towers_binary() + " " + args + " > " + log + " 2>&1";
    pid_ = ::fork();
    if (pid_ == 0) {
      ::execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
  }
  ~Background() {
    if (pid_ > 0 && !done_) {
      ::kill(pid_, SIGKILL);
      wait();
    }
  }
  bool running() {
    if (done_) return false;
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == 0) return true;
    done_ = true;
    rc_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128;
    return false;
  }
  int wait() {
    if (done_) return rc_;
    int status = 0;
    ::waitpid(pid_, &status, 0);
    done_ = true;
    rc_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128;
    return rc_;
  }

 private:
  pid_t pid_ = -1;
  bool done_ = false;
  int rc_ = -1;
};

std::vector<std::string> files_in(const std::string& dir) {
  std::vector<std::string> out;
  if (!fs::exists(dir)) return out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Every file of dir is a finished checkpoint (no temporary file is visible) that
// `towers eval` loads (on synthetic data of the model's shape, so that the check does not
// depend on the run's dataset); returns how many there are.
int expect_only_loadable_checkpoints(const std::string& dir) {
  int n = 0;
  for (const std::string& f : files_in(dir)) {
    EXPECT_TRUE(f.starts_with("ckpt-") && f.ends_with(".safetensors")) << "stray file " << f;
    std::string out;
    EXPECT_EQ(run_towers("eval --dataset synthetic --checkpoint " + dir + "/" + f, &out), 0) << out;
    ++n;
  }
  return n;
}

void expect_clear_error(int rc, const std::string& out, const std::vector<std::string>& needles) {
  EXPECT_EQ(rc, 1) << out;
  for (const std::string& s : needles)
    EXPECT_NE(out.find(s), std::string::npos) << "missing '" << s << "' in: " << out;
  EXPECT_EQ(out.find("internal error"), std::string::npos) << out;
}

// mlp with momentum: a checkpoint (parameters and one slot) is about 800 KiB.
const std::string kRun =
    "train --model mlp --dataset synthetic --synthetic-size 2000 --optimizer momentum --quiet "
    "--threads-per-tower 1 ";

TEST(IoFaults, FullDiskDuringACheckpointKeepsThePreviousOne) {
  // Room for one checkpoint, not for a second one beside it (keep 1 still writes the new file
  // before it deletes the old one).
  Tmpfs disk(1200);
  SKIP_UNLESS_MOUNTED(disk);
  const std::string ck = disk.dir() + "/ck";
  std::string out;
  // 40 steps an epoch: checkpoints at steps 20, 40, ...
  const int rc = run_towers(kRun + "--batch 50 --steps 200 --checkpoint-every 0.5 --keep-checkpoints 1 "
                            "--checkpoint-dir " + ck, &out);
  expect_clear_error(rc, out, {"ckpt-000000040.safetensors", "No space left on device"});
  EXPECT_EQ(files_in(ck), std::vector<std::string>{"ckpt-000000020.safetensors"});
  EXPECT_EQ(expect_only_loadable_checkpoints(ck), 1);
}

TEST(IoFaults, CheckpointFolderThatBecomesReadOnly) {
  Tmpfs disk(8192);
  SKIP_UNLESS_MOUNTED(disk);
  const std::string ck = disk.dir() + "/ck", log = test_path("log.txt");
  // 4000 steps of at least 2 ms each with a checkpoint every 20: the folder turns read-only
  // while the run is in its middle.
  Background run(kRun + "--batch 10 --steps 4000 --slow-tower 0:2 --checkpoint-every 0.1 "
                 "--keep-checkpoints 2 --checkpoint-dir " + ck, log);
  const auto t0 = std::chrono::steady_clock::now();
  while (!fs::exists(ck + "/ckpt-000000020.safetensors") && run.running() &&
         std::chrono::steady_clock::now() - t0 < std::chrono::seconds(120))
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_TRUE(fs::exists(ck + "/ckpt-000000020.safetensors")) << read_file(log);
  ASSERT_TRUE(disk.make_read_only()) << std::strerror(errno);
  ASSERT_TRUE(run.running()) << "the run ended before its folder turned read-only";
  const int rc = run.wait();
  const std::string out = read_file(log);
  expect_clear_error(rc, out, {ck, "Read-only file system"});
  EXPECT_GE(expect_only_loadable_checkpoints(ck), 1);
}

TEST(IoFaults, ReadOnlyCheckpointFolderIsRefusedBeforeTraining) {
  Tmpfs disk(64);
  SKIP_UNLESS_MOUNTED(disk);
  fs::create_directories(disk.dir() + "/ck");
  ASSERT_TRUE(disk.make_read_only());
  const std::string metrics = test_path("m.jsonl");
  std::string out;
  const int rc = run_towers(kRun + "--batch 50 --steps 5 --metrics " + metrics + " --checkpoint-dir " +
                            disk.dir() + "/ck", &out);
  expect_clear_error(rc, out, {"--checkpoint-dir", disk.dir() + "/ck", "not writable"});
  EXPECT_FALSE(fs::exists(metrics)) << "nothing is written before every input is checked";
}

TEST(IoFaults, MetricsFileOnAFullDiskStopsTheRunAndKeepsItsCheckpoints) {
  Tmpfs disk(32);  // about 130 step records
  SKIP_UNLESS_MOUNTED(disk);
  const std::string ck = test_path("ck"), metrics = disk.dir() + "/m.jsonl";
  std::string out;
  // 200 steps an epoch: a checkpoint every 20 steps.
  const int rc = run_towers(kRun + "--batch 10 --steps 2000 --checkpoint-every 0.1 --metrics " +
                            metrics + " --checkpoint-dir " + ck, &out);
  expect_clear_error(rc, out, {"--metrics", metrics, "No space left on device"});
  EXPECT_GE(expect_only_loadable_checkpoints(ck), 1);
}

TEST(IoFaults, MetricsFileThatCannotBeWrittenIsAnErrorBeforeTraining) {
  // /dev/full opens, and every write to it fails: the config record, before the first step.
  const std::string ck = test_path("ck");
  std::string out;
  const int rc = run_towers(kRun + "--batch 50 --steps 5 --metrics /dev/full --checkpoint-dir " + ck, &out);
  expect_clear_error(rc, out, {"--metrics", "/dev/full", "No space left on device"});
  EXPECT_TRUE(!fs::exists(ck) || files_in(ck).empty());
}

// The dataset is read whole when a job starts, so a file that changes size under a running
// job does not touch it; a job that later resumes on the changed file is told which file is
// wrong.
TEST(IoFaults, DatasetFileThatShrinksUnderARunningJob) {
  const fs::path src = "/usr/share/datasets/fashion-mnist";
  if (!fs::exists(src / "train-images-idx3-ubyte.gz")) GTEST_SKIP() << "no Fashion-MNIST at " << src;
  const std::string data = test_path("fashion"), ck = test_path("ck"), log = test_path("log.txt");
  fs::create_directories(data);
  for (const auto& e : fs::directory_iterator(src))
    if (e.path().extension() == ".gz") fs::copy_file(e.path(), fs::path(data) / e.path().filename());
  const std::string train =
      "train --model mlp --dataset fashion-mnist --data " + data +
      " --batch 100 --threads-per-tower 1 --eval-every 0 --checkpoint-every 0.1 "
      "--checkpoint-dir " + ck;
  // 300 steps of at least 10 ms: the file shrinks while the job runs.
  Background run(train + " --steps 300 --slow-tower 0:10 --log-every 1", log);
  const auto t0 = std::chrono::steady_clock::now();
  while (read_file(log).find("step ") == std::string::npos && run.running() &&
         std::chrono::steady_clock::now() - t0 < std::chrono::seconds(120))
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  const fs::path images = fs::path(data) / "train-images-idx3-ubyte.gz";
  const auto running = read_file(log);
  ASSERT_NE(running.find("step "), std::string::npos) << running;
  ASSERT_TRUE(run.running()) << "the job ended before the file changed";
  fs::resize_file(images, fs::file_size(images) / 2);
  EXPECT_EQ(run.wait(), 0) << read_file(log);
  EXPECT_GE(expect_only_loadable_checkpoints(ck), 1);

  std::string out;
  const int rc = run_towers(train + " --steps 400 --resume --quiet", &out);
  expect_clear_error(rc, out, {images.string()});
  EXPECT_GE(expect_only_loadable_checkpoints(ck), 1);
}

}  // namespace
}  // namespace towers
