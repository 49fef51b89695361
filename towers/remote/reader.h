// reader.h — reading a remote tower group's live parameters from its shards, from any process
// with the run's token or its read-only one, without files: `towers pull` (to a checkpoint
// file) and `towers eval --cluster` (the test pass, in memory).
//
// The parameters are one consistent version where the mode has one: in sync mode every shard
// is read at the same round (the highest any shard has reached; a shard that is a round behind
// is waited for). In async and SSP each shard's range is read at that shard's own version,
// and every version is reported.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "params/layout.h"
#include "towers/remote/cluster.h"
#include "towers/remote/rpc.h"

namespace towers::remote {

struct PulledModel {
  std::string model;     // as the chief named it (a built-in name or a model file)
  nlohmann::json config; // the run's configuration
  std::string mode;
  std::unique_ptr<ParameterLayout> layout;
  std::vector<float> params;    // layout->total() floats
  std::vector<int64_t> versions;  // per shard
};

PulledModel pull_model(const Cluster& cluster, const std::string& token, const TlsFiles& tls,
                       double timeout);

// Writes the parameters as a towers checkpoint (no optimizer slots) at path, atomically;
// `towers eval --checkpoint path` reads it. step: the smallest shard version.
void save_pulled(const PulledModel& m, const std::string& path);

}  // namespace towers::remote
