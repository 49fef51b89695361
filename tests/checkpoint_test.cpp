// checkpoint_test.cpp — safetensors files and training checkpoints: bitwise round trips,
// rotation, atomic saves, and every kind of bad file giving an error that names the file.
#include <sys/stat.h>  // chmod
#include <sys/wait.h>  // waitpid
#include <unistd.h>    // geteuid

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include <gtest/gtest.h>

#include "core/check.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"

namespace towers::io {
namespace {
namespace fs = std::filesystem;

// gtest alone (no gmock is linked): a substring check that prints both strings on failure.
#define EXPECT_CONTAINS(text, part)                          \
  EXPECT_NE(std::string(text).find(part), std::string::npos) \
      << "'" << (text) << "' lacks '" << (part) << "'"

// A fresh, empty directory under the test temp dir, named after the running test; removed at
// the end of the test.
struct ScratchDir {
  std::string path;
  ScratchDir() {
    const auto* info = testing::UnitTest::GetInstance()->current_test_info();
    fs::path dir =
        fs::path(testing::TempDir()) /
        fmt::format("towers_ckpt_{}_{}_{}", info->test_suite_name(), info->name(), ::getpid());
    fs::remove_all(dir);
    fs::create_directories(dir);
    path = dir.string();
  }
  ~ScratchDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

// Sizes are not multiples of 16, so the layout has padding between variables.
ParameterLayout small_layout() {
  return ParameterLayout({{"conv1/weight", {4, 3, 5, 5}, Init::constant(0)},
                          {"conv1/bias", {4}, Init::constant(0)},
                          {"fc/weight", {10, 7}, Init::constant(0)},
                          {"fc/bias", {10}, Init::constant(0)}});
}

// Random bit patterns (NaNs, denormals, -0 included) in the variables, 0 in the padding.
HostBuffer random_buffer(const ParameterLayout& layout, uint32_t seed) {
  HostBuffer b(layout.total());
  std::mt19937 rng(seed);
  for (const Variable& v : layout.variables())
    for (int64_t i = 0; i < v.size; ++i) {
      uint32_t bits = rng();
      std::memcpy(&b[v.offset + i], &bits, sizeof bits);
    }
  return b;
}

bool bitwise_equal(const HostBuffer& a, const HostBuffer& b) {
  return a.size() == b.size() &&
         std::memcmp(a.data(), b.data(), static_cast<size_t>(a.size()) * 4) == 0;
}

CheckpointMeta sample_meta(int64_t step) {
  CheckpointMeta m;
  m.model = "cifar10_tutorial";
  m.step = step;
  m.examples_seen = step * 128;
  m.epoch = 1.0 / 3.0 + static_cast<double>(step);
  m.config = {{"batch_size", 128}, {"mode", "sync"}, {"towers", 2}, {"lr", 0.1}};
  m.optimizer_state = {{"t", step}, {"beta1_power", 0.9}};
  return m;
}

// Saves a checkpoint of small_layout() at `step` with params and one slot from fixed seeds.
std::string save_small(const std::string& dir, int64_t step, int keep_last = 0) {
  ParameterLayout layout = small_layout();
  HostBuffer p = random_buffer(layout, 1), m = random_buffer(layout, 2);
  return save_checkpoint(dir, sample_meta(step), layout, p.data(), {{"momentum", m.data()}},
                         keep_last);
}

std::vector<std::string> file_names(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

// A safetensors file made by hand: header text, then `data_bytes` zero bytes.
std::string raw_file(const std::string& header, size_t data_bytes) {
  uint64_t n = header.size();
  std::string out(reinterpret_cast<const char*>(&n), 8);
  return out + header + std::string(data_bytes, '\0');
}

// Runs f, expects a towers::Error, and returns its message.
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "no towers::Error thrown";
  return "";
}

TEST(Safetensors, RoundTripWithAlignedHeaderAndMetadata) {
  ScratchDir scratch;
  std::string path = scratch.path + "/t.safetensors";
  std::vector<float> a = {1, 2, 3, 4, 5, 6}, b = {-7.5f};
  write_safetensors(path,
                    {{"a", {2, 3}, a.data()}, {"scalar", {}, b.data()}, {"empty", {0, 4}, nullptr}},
                    {{"k", "v"}, {"x", "{\"json\": 1}"}});

  std::string bytes = read_bytes(path);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ(n % 8, 0u);
  EXPECT_EQ(bytes[8], '{');
  EXPECT_EQ(bytes.size(), 8 + n + 7 * 4);

  SafetensorsFile f = read_safetensors(path);
  EXPECT_EQ(f.header.metadata, (Metadata{{"k", "v"}, {"x", "{\"json\": 1}"}}));
  ASSERT_EQ(f.header.tensors.size(), 3u);
  const TensorEntry* ta = f.header.find("a");
  ASSERT_NE(ta, nullptr);
  EXPECT_EQ(ta->shape, (Shape{2, 3}));
  std::vector<float> back(6);
  f.copy_to(*ta, back.data());
  EXPECT_EQ(back, a);
  ASSERT_NE(f.header.find("scalar"), nullptr);
  EXPECT_EQ(f.header.find("scalar")->shape, Shape{});
  EXPECT_EQ(f.header.find("empty")->end - f.header.find("empty")->begin, 0);
  EXPECT_EQ(f.header.find("missing"), nullptr);
}

TEST(Safetensors, RejectsOtherDtypesOverlapsAndBadOffsets) {
  ScratchDir scratch;
  std::string dir = scratch.path;
  auto check = [&](const std::string& header, size_t data, const std::string& expected) {
    std::string path = dir + "/bad.safetensors";
    write_bytes(path, raw_file(header, data));
    std::string msg = error_of([&] { read_safetensors_header(path); });
    EXPECT_CONTAINS(msg, path) << header;
    EXPECT_CONTAINS(msg, expected) << header;
  };
  check(R"({"w": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}})", 4, "dtype BF16");
  check(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
        12, "overlap");
  check(R"({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})", 8, "needs 12 bytes");
  check(R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})", 4,
        "outside the data section");
  check(R"({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}})", 8, "dimension");
  check(R"({"w": {"dtype": "F32", "shape": [4611686018427387904, 4], "data_offsets": [0, 8]}})", 8,
        "too many");
  check(R"({"w": {"dtype": "F32", "shape": [2]}})", 8, "data_offsets");
  check(R"({"__metadata__": {"k": 1}})", 0, "not a string");
  check(R"([1, 2])", 0, "not an object");
  check(R"({"w": )", 0, "not valid JSON");
}

// nlohmann's dump recurses once per level of nesting, and error messages print what they
// reject, so a 2 MB header whose shape nests a million arrays deep would overflow the stack.
// JSON from a file (the header; a checkpoint's config and optimizer state) nests at most 64 deep.
TEST(Safetensors, DeeplyNestedJsonIsAnError) {
  ScratchDir scratch;
  auto nested = [](int depth) { return std::string(depth, '[') + "1" + std::string(depth, ']'); };
  std::string path = scratch.path + "/deep.safetensors";
  write_bytes(path, raw_file(R"({"w": {"dtype": "F32", "shape": )" + nested(1'000'000) +
                                 R"(, "data_offsets": [0, 4]}})",
                             4));
  std::string msg = error_of([&] { read_safetensors_header(path); });
  EXPECT_CONTAINS(msg, path);
  EXPECT_CONTAINS(msg, "header nests arrays and objects more than 64 deep");

  ParameterLayout layout = small_layout();
  HostBuffer p = random_buffer(layout, 4);
  CheckpointMeta meta = sample_meta(3);
  meta.config = nlohmann::json::parse(nested(64));
  std::string saved = save_checkpoint(scratch.path, meta, layout, p.data(), {}, 0);
  EXPECT_EQ(read_checkpoint_meta(saved).config, meta.config);
  meta.config = nlohmann::json::parse(nested(65));
  saved = save_checkpoint(scratch.path, meta, layout, p.data(), {}, 0);
  msg = error_of([&] { read_checkpoint_meta(saved); });
  EXPECT_CONTAINS(msg, saved);
  EXPECT_CONTAINS(msg, "metadata 'config' nests arrays and objects more than 64 deep");
}

TEST(Checkpoint, RoundTripIsBitwise) {
  ScratchDir scratch;
  std::string dir = scratch.path + "/new/nested";  // created by the save
  ParameterLayout layout = small_layout();
  HostBuffer p = random_buffer(layout, 11), m = random_buffer(layout, 12),
             v = random_buffer(layout, 13);
  CheckpointMeta meta = sample_meta(1234);
  std::string path =
      save_checkpoint(dir, meta, layout, p.data(), {{"m", m.data()}, {"v", v.data()}}, 3);
  EXPECT_EQ(path, (fs::path(dir) / "ckpt-000001234.safetensors").string());

  Checkpoint c = load_checkpoint(path, layout, {"v", "m"});
  EXPECT_TRUE(bitwise_equal(c.params, p));
  ASSERT_EQ(c.slots.size(), 2u);
  EXPECT_EQ(c.slots[0].first, "v");
  EXPECT_TRUE(bitwise_equal(c.slots[0].second, v));
  EXPECT_EQ(c.slots[1].first, "m");
  EXPECT_TRUE(bitwise_equal(c.slots[1].second, m));

  for (const CheckpointMeta& back : {c.meta, read_checkpoint_meta(path)}) {
    EXPECT_EQ(back.model, meta.model);
    EXPECT_EQ(back.step, meta.step);
    EXPECT_EQ(back.examples_seen, meta.examples_seen);
    EXPECT_EQ(back.epoch, meta.epoch);  // exact: the text is the shortest round-trip form
    EXPECT_EQ(back.config, meta.config);
    EXPECT_EQ(back.optimizer_state, meta.optimizer_state);
  }

  // The tensors are named as documented, and eval can load parameters without the slots.
  SafetensorsHeader h = read_safetensors_header(path);
  ASSERT_NE(h.find("optimizer/m/conv1/weight"), nullptr);
  EXPECT_EQ(h.find("fc/weight")->shape, (Shape{10, 7}));
  EXPECT_EQ(h.metadata.at("format"), "towers-checkpoint-v1");
  EXPECT_EQ(h.metadata.at("checksum").size(), 8u);
  EXPECT_TRUE(bitwise_equal(load_checkpoint(path, layout, {}).params, p));
}

TEST(Checkpoint, KeepLastDeletesOldestAndNothingElse) {
  ScratchDir scratch;
  std::string dir = scratch.path;
  write_bytes(dir + "/notes.txt", "mine");
  write_bytes(dir + "/ckpt-latest.safetensors", "not a step");
  for (int64_t step = 1; step <= 5; ++step) save_small(dir, step * 10, /*keep_last=*/2);
  EXPECT_EQ(file_names(dir),
            (std::vector<std::string>{"ckpt-000000040.safetensors", "ckpt-000000050.safetensors",
                                      "ckpt-latest.safetensors", "notes.txt"}));
  EXPECT_EQ(read_bytes(dir + "/notes.txt"), "mine");

  // keep_last < 1 keeps everything; the file just written survives even when it is the oldest.
  save_small(dir, 60, 0);
  EXPECT_EQ(file_names(dir).size(), 5u);
  save_small(dir, 5, 2);
  EXPECT_EQ(file_names(dir),
            (std::vector<std::string>{"ckpt-000000005.safetensors", "ckpt-000000060.safetensors",
                                      "ckpt-latest.safetensors", "notes.txt"}));
}

TEST(Checkpoint, LatestPicksHighestStep) {
  ScratchDir scratch;
  std::string dir = scratch.path;
  EXPECT_EQ(latest_checkpoint(dir + "/missing"), std::nullopt);
  EXPECT_EQ(latest_checkpoint(dir), std::nullopt);
  for (int64_t step : {5, 100, 20, 999999999}) save_small(dir, step);
  save_small(dir, 1234567890);  // past 9 digits: ordered by number, not by name
  write_bytes(dir + "/ckpt-9999999999.safetensors.tmp-1", "a stray temp file");
  EXPECT_EQ(latest_checkpoint(dir), (fs::path(dir) / "ckpt-1234567890.safetensors").string());
  EXPECT_EQ(read_checkpoint_meta(*latest_checkpoint(dir)).step, 1234567890);
}

// A save killed before its rename leaves ckpt-N.safetensors.tmp-PID; the next run removes it
// when PID is gone, and leaves alone a temporary file of a live process and every other file.
TEST(Checkpoint, StaleTemporariesOfDeadProcessesAreRemoved) {
  ScratchDir scratch;
  const std::string dir = scratch.path;
  const std::string kept = save_small(dir, 7);
  const pid_t dead = ::fork();
  if (dead == 0) ::_exit(0);
  ASSERT_GT(dead, 0);
  ::waitpid(dead, nullptr, 0);  // reaped: no process has this pid now
  const std::string stale = fmt::format("{}/ckpt-000000008.safetensors.tmp-{}", dir, dead);
  const std::string live = fmt::format("{}/ckpt-000000009.safetensors.tmp-{}", dir, ::getpid());
  const std::string other = dir + "/notes.tmp-1";
  for (const std::string& f : {stale, live, other}) write_bytes(f, "partial");
  EXPECT_EQ(remove_stale_temporaries(dir), std::vector<std::string>{stale});
  EXPECT_FALSE(fs::exists(stale));
  EXPECT_TRUE(fs::exists(live));
  EXPECT_TRUE(fs::exists(other));
  EXPECT_TRUE(fs::exists(kept));
  EXPECT_TRUE(remove_stale_temporaries(dir + "/missing").empty());
}

TEST(Checkpoint, FailedSaveLeavesNoTempFileAndKeepsThePrevious) {
  ScratchDir scratch;
  std::string dir = scratch.path;
  std::string first = save_small(dir, 1);
  std::string before = read_bytes(first);
  auto no_temp_files = [&] {
    for (const std::string& name : file_names(dir))
      EXPECT_EQ(name.find(".tmp-"), std::string::npos) << name;
  };

  // The rename fails after the temp file is fully written: a directory sits at the target.
  fs::create_directories(dir + "/ckpt-000000002.safetensors/occupied");
  std::string msg = error_of([&] { save_small(dir, 2); });
  EXPECT_CONTAINS(msg, "ckpt-000000002.safetensors");
  no_temp_files();
  EXPECT_EQ(read_bytes(first), before);
  EXPECT_EQ(latest_checkpoint(dir), first);  // the directory is not mistaken for a checkpoint

  // The checkpoint "directory" is a file.
  std::string file = dir + "/plain_file";
  write_bytes(file, "x");
  msg = error_of([&] { save_small(file, 3); });
  EXPECT_CONTAINS(msg, file);
  EXPECT_CONTAINS(msg, "not a directory");
  EXPECT_EQ(read_bytes(file), "x");

  // A read-only directory (root ignores permissions, so only as another user).
  if (::geteuid() != 0) {
    ASSERT_EQ(::chmod(dir.c_str(), 0555), 0);
    msg = error_of([&] { save_small(dir, 4); });
    ::chmod(dir.c_str(), 0755);
    EXPECT_CONTAINS(msg, "ckpt-000000004.safetensors");
    no_temp_files();
    EXPECT_EQ(read_bytes(first), before);
  }
  EXPECT_TRUE(bitwise_equal(load_checkpoint(first, small_layout(), {"momentum"}).params,
                            random_buffer(small_layout(), 1)));
}

TEST(Checkpoint, CorruptedDataFailsTheChecksum) {
  ScratchDir scratch;
  std::string path = save_small(scratch.path, 7);
  std::string bytes = read_bytes(path);
  bytes[bytes.size() - 5] ^= 0x10;
  write_bytes(path, bytes);
  read_checkpoint_meta(path);  // the header is intact and read_checkpoint_meta does not checksum
  std::string msg = error_of([&] { load_checkpoint(path, small_layout(), {"momentum"}); });
  EXPECT_CONTAINS(msg, path);
  EXPECT_CONTAINS(msg, "checksum");
  EXPECT_CONTAINS(msg, "does not match");
}

TEST(Checkpoint, TruncatedFileNamesTheFile) {
  ScratchDir scratch;
  std::string path = save_small(scratch.path, 7);
  std::string bytes = read_bytes(path);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  for (size_t keep : {size_t{0}, size_t{4}, size_t{8}, size_t{8 + n / 2}, size_t{8 + n + 100},
                      bytes.size() - 1}) {
    write_bytes(path, bytes.substr(0, keep));
    std::string msg = error_of([&] { load_checkpoint(path, small_layout(), {}); });
    EXPECT_CONTAINS(msg, path) << keep;
  }
}

TEST(Checkpoint, GarbageHeaderNamesTheFile) {
  ScratchDir scratch;
  std::string dir = scratch.path;
  std::string path = dir + "/ckpt-000000001.safetensors";
  write_bytes(path, raw_file("this is not json at all!", 16));
  std::string msg = error_of([&] { load_checkpoint(path, small_layout(), {}); });
  EXPECT_CONTAINS(msg, path);
  EXPECT_CONTAINS(msg, "not valid JSON");

  write_bytes(path, std::string("\xff\xff\xff\xff\xff\xff\xff\x7f", 8) + "{}");
  msg = error_of([&] { read_checkpoint_meta(path); });
  EXPECT_CONTAINS(msg, path);
  EXPECT_CONTAINS(msg, "header length");

  uint64_t big = 200'000'000;
  write_bytes(path, std::string(reinterpret_cast<const char*>(&big), 8) + "{}");
  msg = error_of([&] { read_checkpoint_meta(path); });
  EXPECT_CONTAINS(msg, "100 MB");
}

TEST(Checkpoint, ForeignSafetensorsIsNotACheckpoint) {
  ScratchDir scratch;
  std::string path = scratch.path + "/model.safetensors";
  ParameterLayout layout = small_layout();
  HostBuffer p = random_buffer(layout, 3);
  std::vector<TensorView> tensors;
  for (const Variable& v : layout.variables())
    tensors.push_back({v.spec.name, v.spec.shape, p.data() + v.offset});
  write_safetensors(path, tensors, {{"source", "somewhere else"}});
  for (auto f : {+[](const std::string& s) { read_checkpoint_meta(s); },
                 +[](const std::string& s) { load_checkpoint(s, small_layout(), {}); }}) {
    std::string msg = error_of([&] { f(path); });
    EXPECT_CONTAINS(msg, path);
    EXPECT_CONTAINS(msg, "not a towers checkpoint");
  }
  write_safetensors(path, tensors, {{"format", "towers-checkpoint-v0"}});
  EXPECT_CONTAINS(error_of([&] { read_checkpoint_meta(path); }), "towers-checkpoint-v0");
}

TEST(Checkpoint, LayoutMismatchNamesVariableAndShapes) {
  ScratchDir scratch;
  std::string path = save_small(scratch.path, 1);
  ParameterLayout wider({{"conv1/weight", {8, 3, 5, 5}, Init::constant(0)},
                         {"conv1/bias", {4}, Init::constant(0)},
                         {"fc/weight", {10, 7}, Init::constant(0)},
                         {"fc/bias", {10}, Init::constant(0)}});
  std::string msg = error_of([&] { load_checkpoint(path, wider, {}); });
  EXPECT_CONTAINS(msg, path);
  EXPECT_CONTAINS(msg, "'conv1/weight'");
  EXPECT_CONTAINS(msg, "[4, 3, 5, 5]");
  EXPECT_CONTAINS(msg, "[8, 3, 5, 5]");

  ParameterLayout more({{"conv1/weight", {4, 3, 5, 5}, Init::constant(0)},
                        {"conv1/bias", {4}, Init::constant(0)},
                        {"conv2/weight", {4, 4, 3, 3}, Init::constant(0)},
                        {"fc/weight", {10, 7}, Init::constant(0)},
                        {"fc/bias", {10}, Init::constant(0)}});
  msg = error_of([&] { load_checkpoint(path, more, {}); });
  EXPECT_CONTAINS(msg, "no tensor 'conv2/weight'");
  EXPECT_CONTAINS(msg, "[4, 4, 3, 3]");

  ParameterLayout fewer({{"conv1/weight", {4, 3, 5, 5}, Init::constant(0)}});
  msg = error_of([&] { load_checkpoint(path, fewer, {}); });
  EXPECT_CONTAINS(msg, "fc/weight");
  EXPECT_CONTAINS(msg, "the model does not");

  msg = error_of([&] { load_checkpoint(path, small_layout(), {"momentum", "adam_v"}); });
  EXPECT_CONTAINS(msg, "no optimizer slot 'adam_v'");
  EXPECT_CONTAINS(msg, "momentum");
}

TEST(Checkpoint, MissingFileNamesTheFile) {
  ScratchDir scratch;
  std::string path = scratch.path + "/ckpt-000000042.safetensors";
  for (auto f : {+[](const std::string& s) { read_checkpoint_meta(s); },
                 +[](const std::string& s) { load_checkpoint(s, small_layout(), {}); }}) {
    std::string msg = error_of([&] { f(path); });
    EXPECT_CONTAINS(msg, path);
    EXPECT_CONTAINS(msg, "does not exist");
  }
}

// Decision 8: any safetensors reader opens the files. Skips where Python lacks the package.
TEST(Checkpoint, PythonSafetensorsReadsIt) {
  ScratchDir scratch;
  if (std::system("python3 -c 'import safetensors.numpy, numpy' >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "python3 with the safetensors and numpy packages is not available";
  std::string dir = scratch.path;
  ParameterLayout layout = small_layout();
  HostBuffer p(layout.total()), m(layout.total());
  const Variable& fc = layout.find("fc/weight");
  for (int64_t i = 0; i < fc.size; ++i) p[fc.offset + i] = 0.25f * static_cast<float>(i);
  m[layout.find("conv1/bias").offset + 3] = -1.5f;
  std::string path = save_checkpoint(dir, sample_meta(3), layout, p.data(), {{"m", m.data()}}, 1);

  std::string script = dir + "/read.py";
  write_bytes(
      script,
      "import sys\n"
      "from safetensors import safe_open\n"
      "from safetensors.numpy import load_file\n"
      "assert len(load_file(sys.argv[1])) == 8\n"
      "with safe_open(sys.argv[1], framework='np') as f:\n"
      "    w = f.get_tensor('fc/weight')\n"
      "    b = f.get_tensor('optimizer/m/conv1/bias')\n"
      "    print(w.dtype, list(w.shape), float(w[2, 3]), float(b[3]), f.metadata()['model'])\n");
  FILE* pipe = ::popen(fmt::format("python3 '{}' '{}' 2>&1", script, path).c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string out;
  char buf[256];
  while (std::fgets(buf, sizeof buf, pipe) != nullptr) out += buf;
  EXPECT_EQ(::pclose(pipe), 0) << out;
  EXPECT_EQ(out, "float32 [10, 7] 4.25 -1.5 cifar10_tutorial\n");  // w[2, 3] = 0.25 * 17
}

// And the other way: towers reads what the reference writer wrote, and refuses its F16 clearly.
TEST(Safetensors, ReadsWhatPythonWrites) {
  ScratchDir scratch;
  if (std::system("python3 -c 'import safetensors.numpy, numpy' >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "python3 with the safetensors and numpy packages is not available";
  std::string dir = scratch.path;
  std::string script = dir + "/write.py";
  write_bytes(
      script,
      "import sys, numpy as np\n"
      "from safetensors.numpy import save_file\n"
      "d = sys.argv[1]\n"
      "save_file({'b': np.arange(5, dtype=np.float32), 'a/w': np.full((2, 3), -2, np.float32)},\n"
      "          d + '/f32.safetensors', metadata={'who': 'python'})\n"
      "save_file({'h': np.zeros(4, np.float16)}, d + '/f16.safetensors')\n");
  ASSERT_EQ(std::system(fmt::format("python3 '{}' '{}'", script, dir).c_str()), 0);

  SafetensorsFile f = read_safetensors(dir + "/f32.safetensors");
  EXPECT_EQ(f.header.metadata, (Metadata{{"who", "python"}}));
  ASSERT_NE(f.header.find("a/w"), nullptr);
  EXPECT_EQ(f.header.find("a/w")->shape, (Shape{2, 3}));
  std::vector<float> b(5), w(6);
  f.copy_to(*f.header.find("b"), b.data());
  f.copy_to(*f.header.find("a/w"), w.data());
  EXPECT_EQ(b, (std::vector<float>{0, 1, 2, 3, 4}));
  EXPECT_EQ(w, std::vector<float>(6, -2.0f));
  EXPECT_CONTAINS(error_of([&] { read_safetensors(dir + "/f16.safetensors"); }),
                  "dtype F16; towers reads only F32");
}

}  // namespace
}  // namespace towers::io
