// checkpoint.h — training checkpoints as safetensors files (DESIGN.md, decision 8).
//
// A checkpoint is `<dir>/ckpt-<step, 9 digits>.safetensors` holding each variable of the
// ParameterLayout under its own name (padding excluded), each optimizer slot variable as
// `optimizer/<slot>/<var name>`, and string metadata: format ("towers-checkpoint-v1"), model,
// step (= the parameter version: one step is one applied update), examples_seen, epoch, config
// and optimizer_state (JSON text), and checksum (CRC-32 of the whole data section, 8 hex digits).
// Any safetensors reader opens it; towers verifies the checksum and every shape on load.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"
#include "params/layout.h"

namespace towers::io {

inline constexpr const char* kCheckpointFormat = "towers-checkpoint-v1";

struct CheckpointMeta {
  std::string model;
  int64_t step = 0;
  int64_t examples_seen = 0;
  double epoch = 0;
  nlohmann::json config;           // the run's configuration, as the CLI resolved it
  nlohmann::json optimizer_state;  // the optimizer's scalars (e.g. Adam's t)
  std::vector<std::string> slots;  // read_checkpoint_meta: the optimizer slots the file holds
};

struct Checkpoint {
  CheckpointMeta meta;
  HostBuffer params;                                      // layout.total() floats, padding 0
  std::vector<std::pair<std::string, HostBuffer>> slots;  // in the order asked for, same layout
};

// Writes `params` and `slots` (each layout.total() floats) as the checkpoint of meta.step in
// `dir` (created if missing), atomically, then deletes the oldest `ckpt-*.safetensors` files of
// `dir` (by step in the name) so that `keep_last` remain; the file just written is always kept,
// other files are never touched. keep_last < 1 keeps every checkpoint. Returns the path written.
std::string save_checkpoint(const std::string& dir, const CheckpointMeta& meta,
                            const ParameterLayout& layout, const float* params,
                            const std::vector<std::pair<std::string, const float*>>& slots,
                            int keep_last);

// Reads only the header (no data, no checksum pass): enough for `towers eval` to learn the
// model. Throws towers::Error naming the file if it is not a towers checkpoint.
CheckpointMeta read_checkpoint_meta(const std::string& path);

// Reads and verifies a checkpoint: format tag, checksum, every variable of `layout` present with
// its exact shape and no variable the layout lacks, every slot of `expected_slots` present for
// every variable (other slots in the file are ignored). The caller compares meta.model with the
// model it built. Each failure throws towers::Error naming the file and what is wrong.
Checkpoint load_checkpoint(const std::string& path, const ParameterLayout& layout,
                           const std::vector<std::string>& expected_slots);

// Where save_checkpoint writes the checkpoint of `step` in `dir`.
std::string checkpoint_path(const std::string& dir, int64_t step);
// The checkpoint of `step` in `dir`, or nullopt when there is none (saves are atomic: a file of
// that name is whole).
std::optional<std::string> checkpoint_of(const std::string& dir, int64_t step);

// The checkpoint of the highest step in `dir`, or nullopt when `dir` is missing or has none.
std::optional<std::string> latest_checkpoint(const std::string& dir);

// Deletes the temporary files of checkpoint writes whose process no longer exists
// (`ckpt-<step>.safetensors.tmp-<pid>`: a save killed before its rename) and returns their
// paths. A temporary file of a live process is left alone.
std::vector<std::string> remove_stale_temporaries(const std::string& dir);

}  // namespace towers::io
