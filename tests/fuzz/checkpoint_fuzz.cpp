// checkpoint_fuzz.cpp — a checkpoint file as `towers eval` and `--resume` read it: its metadata
// alone (read_checkpoint_meta), then the whole file (load_checkpoint) against a small layout
// with one optimizer slot, and the config and optimizer state it carries written out as JSON
// text again, as a new checkpoint of the resumed run would.
// Bad input must end in towers::Error; any other exception, a crash or a sanitizer report is a
// bug, and so is an allocation beyond the run's -malloc_limit_mb, whatever the header claims.
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "core/check.h"
#include "fuzz_input.h"
#include "io/checkpoint.h"

namespace {

// The layout the seeds in corpus/checkpoint were saved with (make_seeds.cpp): 9 and 2 floats,
// so padding separates the variables.
const towers::ParameterLayout& layout() {
  static const towers::ParameterLayout l(
      {{"conv1/weight", {1, 1, 3, 3}, {}}, {"conv1/bias", {2}, {}}});
  return l;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static towers::fuzz::ScratchFile file("ckpt-000000001.safetensors");
  const std::string& path = file.write(towers::fuzz::as_bytes(data, size));
  try {
    const towers::io::CheckpointMeta head = towers::io::read_checkpoint_meta(path);
    const towers::io::Checkpoint ck = towers::io::load_checkpoint(path, layout(), {"momentum"});
    // Both reads parse the same metadata; NaN epochs compare by their bits.
    if (ck.meta.model != head.model || ck.meta.step != head.step ||
        ck.meta.examples_seen != head.examples_seen ||
        std::memcmp(&ck.meta.epoch, &head.epoch, sizeof head.epoch) != 0 ||
        ck.params.size() != layout().total() || ck.slots.size() != 1 ||
        ck.slots[0].second.size() != layout().total())
      __builtin_trap();
    const auto text = [](const nlohmann::json& j) {
      return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    };
    if (text(ck.meta.config) != text(head.config) ||
        text(ck.meta.optimizer_state) != text(head.optimizer_state))
      __builtin_trap();
  } catch (const towers::Error&) {
  }
  return 0;
}
