#include "io/checkpoint.h"

#include <signal.h>
#include <zlib.h>  // crc32

#include <cerrno>

#include <algorithm>
#include <charconv>
#include <filesystem>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/check.h"
#include "io/safetensors.h"

namespace towers::io {
namespace fs = std::filesystem;
namespace {

constexpr const char* kPrefix = "ckpt-";
constexpr const char* kSuffix = ".safetensors";
const std::string kSlotPrefix = "optimizer/";

std::string slot_tensor_name(const std::string& slot, const std::string& var) {
  return kSlotPrefix + slot + "/" + var;
}

uint32_t crc32_update(uint32_t crc, const unsigned char* p, size_t bytes) {
  while (bytes > 0) {  // zlib takes 32-bit lengths
    auto chunk = static_cast<uInt>(std::min<size_t>(bytes, size_t{1} << 30));
    crc = static_cast<uint32_t>(::crc32(crc, p, chunk));
    p += chunk;
    bytes -= chunk;
  }
  return crc;
}

// The step of a file named ckpt-<digits>.safetensors, or -1.
int64_t step_of(const std::string& file_name) {
  const std::string prefix = kPrefix, suffix = kSuffix;
  if (file_name.size() <= prefix.size() + suffix.size() || !file_name.starts_with(prefix) ||
      !file_name.ends_with(suffix))
    return -1;
  std::string_view digits(file_name.data() + prefix.size(),
                          file_name.size() - prefix.size() - suffix.size());
  if (digits.size() > 18 ||
      !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return -1;
  int64_t step = 0;
  std::from_chars(digits.data(), digits.data() + digits.size(), step);
  return step;
}

// (step, path) of every checkpoint file in `dir`, highest step first; empty when dir is missing.
std::vector<std::pair<int64_t, std::string>> list_checkpoints(const std::string& dir) {
  std::error_code ec;
  if (!fs::exists(dir, ec)) return {};
  TOWERS_REQUIRE(fs::is_directory(dir, ec), "checkpoint directory '{}' is not a directory", dir);
  std::vector<std::pair<int64_t, std::string>> found;
  std::error_code list_ec;
  for (fs::directory_iterator it(dir, list_ec), end; !list_ec && it != end; it.increment(list_ec)) {
    int64_t step = step_of(it->path().filename().string());
    if (step >= 0 && it->is_regular_file(ec)) found.emplace_back(step, it->path().string());
  }
  TOWERS_REQUIRE(!list_ec, "cannot list checkpoint directory '{}': {}", dir, list_ec.message());
  std::sort(found.begin(), found.end(), std::greater<>());
  return found;
}

const std::string& require_key(const std::string& path, const Metadata& m, const std::string& key) {
  auto it = m.find(key);
  TOWERS_REQUIRE(it != m.end(), "checkpoint '{}': metadata has no '{}'", path, key);
  return it->second;
}

template <typename T>
T parse_number(const std::string& path, const Metadata& m, const std::string& key) {
  const std::string& text = require_key(path, m, key);
  T value{};
  auto [end, err] = std::from_chars(text.data(), text.data() + text.size(), value);
  TOWERS_REQUIRE(err == std::errc() && end == text.data() + text.size() && !text.empty(),
                 "checkpoint '{}': metadata '{}' is '{}', not a number", path, key, text);
  return value;
}

nlohmann::json parse_json(const std::string& path, const Metadata& m, const std::string& key) {
  return parse_file_json(require_key(path, m, key),
                         fmt::format("checkpoint '{}': metadata '{}'", path, key));
}

CheckpointMeta parse_meta(const std::string& path, const Metadata& m) {
  auto format = m.find("format");
  TOWERS_REQUIRE(
      format != m.end(),
      "'{}' is a safetensors file but not a towers checkpoint (its metadata has no format tag)",
      path);
  TOWERS_REQUIRE(format->second == kCheckpointFormat,
                 "'{}' has checkpoint format '{}'; this build of towers reads '{}'", path,
                 format->second, kCheckpointFormat);
  CheckpointMeta meta;
  meta.model = require_key(path, m, "model");
  meta.step = parse_number<int64_t>(path, m, "step");
  meta.examples_seen = parse_number<int64_t>(path, m, "examples_seen");
  meta.epoch = parse_number<double>(path, m, "epoch");
  meta.config = parse_json(path, m, "config");
  meta.optimizer_state = parse_json(path, m, "optimizer_state");
  return meta;
}

std::string json_text(const nlohmann::json& j) {
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

// Finds `name` in the file and checks its shape; fills `out` (layout-sized) at the variable.
void load_tensor(const std::string& path, const SafetensorsFile& file, const std::string& name,
                 const Variable& var, float* out) {
  const TensorEntry* t = file.header.find(name);
  TOWERS_REQUIRE(t != nullptr, "checkpoint '{}' has no tensor '{}' (the model expects shape {})",
                 path, name, to_string(var.spec.shape));
  TOWERS_REQUIRE(t->shape == var.spec.shape,
                 "checkpoint '{}': tensor '{}' has shape {} in the file but the model expects {}",
                 path, name, to_string(t->shape), to_string(var.spec.shape));
  file.copy_to(*t, out + var.offset);
}

}  // namespace

std::string save_checkpoint(const std::string& dir_arg, const CheckpointMeta& meta,
                            const ParameterLayout& layout, const float* params,
                            const std::vector<std::pair<std::string, const float*>>& slots,
                            int keep_last) {
  TOWERS_CHECK(params != nullptr, "save_checkpoint without parameters");
  TOWERS_CHECK(meta.step >= 0, "checkpoint step {} is negative", meta.step);
  const std::string dir = dir_arg.empty() ? "." : dir_arg;

  std::error_code ec;
  TOWERS_REQUIRE(!fs::exists(dir, ec) || fs::is_directory(dir, ec),
                 "checkpoint directory '{}' exists and is not a directory", dir);
  fs::create_directories(dir, ec);
  TOWERS_REQUIRE(!ec, "cannot create checkpoint directory '{}': {}", dir, ec.message());

  std::vector<TensorView> tensors;
  for (const Variable& v : layout.variables()) {
    TOWERS_CHECK(!v.spec.name.starts_with(kSlotPrefix), "variable '{}' uses the slot prefix",
                 v.spec.name);
    tensors.push_back({v.spec.name, v.spec.shape, params + v.offset});
  }
  std::set<std::string> slot_names;
  for (const auto& [slot, data] : slots) {
    TOWERS_CHECK(!slot.empty() && slot.find('/') == std::string::npos, "bad slot name '{}'", slot);
    TOWERS_CHECK(slot_names.insert(slot).second, "duplicate slot '{}'", slot);
    TOWERS_CHECK(data != nullptr, "slot '{}' has no data", slot);
    for (const Variable& v : layout.variables())
      tensors.push_back({slot_tensor_name(slot, v.spec.name), v.spec.shape, data + v.offset});
  }

  // write_safetensors lays the tensors back to back in this order: their bytes are the data
  // section.
  uint32_t crc = static_cast<uint32_t>(::crc32(0L, Z_NULL, 0));
  for (const TensorView& t : tensors)
    crc = crc32_update(crc, reinterpret_cast<const unsigned char*>(t.data),
                       static_cast<size_t>(numel(t.shape)) * sizeof(float));

  const Metadata metadata = {
      {"format", kCheckpointFormat},
      {"model", meta.model},
      {"step", fmt::format("{}", meta.step)},
      {"examples_seen", fmt::format("{}", meta.examples_seen)},
      {"epoch", fmt::format("{}", meta.epoch)},  // shortest text that reads back to the same double
      {"config", json_text(meta.config)},
      {"optimizer_state", json_text(meta.optimizer_state)},
      {"checksum", fmt::format("{:08x}", crc)},
  };
  const std::string path = checkpoint_path(dir, meta.step);
  write_safetensors(path, tensors, metadata);

  if (keep_last >= 1) {
    int kept = 1;  // the file just written
    for (const auto& [step, old] : list_checkpoints(dir)) {
      if (step == meta.step) continue;
      if (kept < keep_last) {
        ++kept;
        continue;
      }
      TOWERS_REQUIRE(fs::remove(old, ec) || !ec,
                     "wrote '{}' but cannot delete the old checkpoint '{}': {}", path, old,
                     ec.message());
    }
  }
  return path;
}

CheckpointMeta read_checkpoint_meta(const std::string& path) {
  const auto header = read_safetensors_header(path);
  CheckpointMeta meta = parse_meta(path, header.metadata);
  std::set<std::string> slots;
  for (const TensorEntry& t : header.tensors) {
    if (!t.name.starts_with(kSlotPrefix)) continue;
    const std::string rest = t.name.substr(kSlotPrefix.size());
    slots.insert(rest.substr(0, rest.find('/')));
  }
  meta.slots.assign(slots.begin(), slots.end());
  return meta;
}

Checkpoint load_checkpoint(const std::string& path, const ParameterLayout& layout,
                           const std::vector<std::string>& expected_slots) {
  const SafetensorsFile file = read_safetensors(path);
  Checkpoint ckpt;
  ckpt.meta = parse_meta(path, file.header.metadata);

  const std::string& expected = require_key(path, file.header.metadata, "checksum");
  const uint32_t actual = crc32_update(static_cast<uint32_t>(::crc32(0L, Z_NULL, 0)),
                                       file.data.data(), file.data.size());
  TOWERS_REQUIRE(expected == fmt::format("{:08x}", actual),
                 "checkpoint '{}' is corrupt: the checksum of its data ({:08x}) does not match the "
                 "one recorded "
                 "({})",
                 path, actual, expected);

  std::vector<std::string> unexpected;
  std::set<std::string> slots_in_file;
  for (const TensorEntry& t : file.header.tensors) {
    if (t.name.starts_with(kSlotPrefix)) {
      std::string rest = t.name.substr(kSlotPrefix.size());
      slots_in_file.insert(rest.substr(0, rest.find('/')));
      continue;
    }
    bool known = std::any_of(layout.variables().begin(), layout.variables().end(),
                             [&](const Variable& v) { return v.spec.name == t.name; });
    if (!known) unexpected.push_back(t.name);
  }
  TOWERS_REQUIRE(unexpected.empty(),
                 "checkpoint '{}' has variables the model does not: {} (a different model?)", path,
                 fmt::join(unexpected, ", "));

  ckpt.params = HostBuffer(layout.total());
  for (const Variable& v : layout.variables())
    load_tensor(path, file, v.spec.name, v, ckpt.params.data());

  for (const std::string& slot : expected_slots) {
    TOWERS_REQUIRE(
        slots_in_file.count(slot) == 1,
        "checkpoint '{}' has no optimizer slot '{}' (it has: [{}]; saved with another optimizer?)",
        path, slot, fmt::join(slots_in_file, ", "));
    HostBuffer buffer(layout.total());
    for (const Variable& v : layout.variables())
      load_tensor(path, file, slot_tensor_name(slot, v.spec.name), v, buffer.data());
    ckpt.slots.emplace_back(slot, std::move(buffer));
  }
  return ckpt;
}

std::string checkpoint_path(const std::string& dir, int64_t step) {
  return (fs::path(dir) / fmt::format("{}{:09d}{}", kPrefix, step, kSuffix)).string();
}

std::optional<std::string> checkpoint_of(const std::string& dir, int64_t step) {
  const std::string path = checkpoint_path(dir, step);
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) return std::nullopt;
  return path;
}

std::optional<std::string> latest_checkpoint(const std::string& dir) {
  auto found = list_checkpoints(dir.empty() ? "." : dir);
  if (found.empty()) return std::nullopt;
  return found.front().second;
}

std::vector<std::string> remove_stale_temporaries(const std::string& dir) {
  std::vector<std::string> removed;
  std::error_code ec;
  const std::string marker = std::string(kSuffix) + ".tmp-";
  for (const auto& e : fs::directory_iterator(dir.empty() ? "." : dir, ec)) {
    const std::string name = e.path().filename().string();
    const size_t at = name.rfind(marker);
    if (!name.starts_with(kPrefix) || at == std::string::npos) continue;
    const std::string pid_text = name.substr(at + marker.size());
    if (pid_text.empty() || pid_text.size() > 9 ||
        !std::all_of(pid_text.begin(), pid_text.end(), [](char c) { return c >= '0' && c <= '9'; }))
      continue;
    const pid_t pid = static_cast<pid_t>(std::stol(pid_text));
    if (pid <= 0) continue;
    const bool gone = ::kill(pid, 0) != 0 && errno == ESRCH;
    if (!gone) continue;
    std::error_code rm;
    if (fs::remove(e.path(), rm)) removed.push_back(e.path().string());
  }
  return removed;
}

}  // namespace towers::io
