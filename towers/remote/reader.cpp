#include "towers/remote/reader.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <thread>

#include <fmt/format.h>
#include <unistd.h>

#include "core/check.h"
#include "core/clock.h"
#include "io/checkpoint.h"
#include "towers/remote/messages.h"
#include "towers/remote/shard_set.h"
#include "towers/remote/towers.grpc.pb.h"

namespace towers::remote {


PulledModel pull_model(const Cluster& cluster, const std::string& token, const TlsFiles& tls,
                       double timeout) {
  const int n = static_cast<int>(cluster.ps.size());
  ShardSet shards(cluster.ps, token, tls);
  PulledModel m;
  // The layout, the model and the run, from shard 0; every shard must serve the same.
  InfoReply info;
  for (int i = 0; i < n; ++i) {
    InfoRequest req;
    req.set_with_layout(i == 0);
    InfoReply rep;
    auto ctx = call_context(token, timeout);
    const grpc::Status s = shards.stub(i).Info(ctx.get(), req, &rep);
    if (!s.ok()) shards.fail(i, "Info", s);
    TOWERS_REQUIRE(rep.initialized(), "ps:{} ({}) has no parameters yet: the chief has not "
                   "initialised it", i, cluster.ps[i]);
    if (i == 0) info = rep;
    TOWERS_REQUIRE(rep.layout_hash() == info.layout_hash() && rep.run_id() == info.run_id(),
                   "ps:{} ({}) serves another run than ps:0 ({} against {})", i, cluster.ps[i],
                   rep.run_id(), info.run_id());
  }
  m.layout = std::make_unique<ParameterLayout>(param_specs(info.variables()));
  TOWERS_REQUIRE(layout_hash(*m.layout) == info.layout_hash(),
                 "ps:0 ({}) described a layout that does not give its own hash", cluster.ps[0]);
  m.model = info.model();
  m.mode = info.mode();
  try {
    m.config = nlohmann::json::parse(info.config().empty() ? "{}" : info.config());
  } catch (const nlohmann::json::exception&) {
    m.config = nlohmann::json::object();
  }
  const std::vector<Range> ranges = shard_ranges(m.layout->total(), n);
  m.params.assign(m.layout->total(), 0.0f);
  m.versions.assign(n, 0);
  PullRequest req;
  req.set_layout_hash(info.layout_hash());
  req.set_worker(-1);
  const std::vector<ShardSet::Pulled> reps = shards.pull_all(req, m.mode == "sync", timeout);
  for (int i = 0; i < n; ++i) {
    const Range& g = ranges[i];
    TOWERS_REQUIRE(reps[i].params.size() == sizeof(float) * static_cast<size_t>(g.size()),
                   "ps:{}: a pull of {} bytes for a range of {} floats", i,
                   reps[i].params.size(), g.size());
    reps[i].params.copy_to(m.params.data() + g.begin);
    m.versions[i] = reps[i].head.version();
  }
  return m;
}

void save_pulled(const PulledModel& m, const std::string& path) {
  namespace fs = std::filesystem;
  const fs::path out(path);
  const fs::path dir = out.parent_path().empty() ? fs::path(".") : out.parent_path();
  std::error_code ec;
  TOWERS_REQUIRE(fs::is_directory(dir, ec), "--out: '{}' is not in an existing folder", path);
  TOWERS_REQUIRE(!fs::is_directory(out, ec), "--out: '{}' is a folder; give a file name", path);
  // Written as a checkpoint into a private folder beside it, then renamed into place: the same
  // atomic write, in the format `towers eval` reads.
  const fs::path tmp = dir / fmt::format(".towers-pull-{}", getpid());
  fs::remove_all(tmp, ec);
  io::CheckpointMeta meta;
  meta.model = m.model;
  meta.step = *std::min_element(m.versions.begin(), m.versions.end());
  meta.config = m.config;
  meta.optimizer_state = nlohmann::json::object();
  try {
    const std::string written = io::save_checkpoint(tmp.string(), meta, *m.layout, m.params.data(), {}, 0);
    fs::rename(written, out, ec);
    TOWERS_REQUIRE(!ec, "--out: cannot write '{}': {}", path, ec.message());
  } catch (...) {
    fs::remove_all(tmp, ec);
    throw;
  }
  fs::remove_all(tmp, ec);
}

}  // namespace towers::remote
