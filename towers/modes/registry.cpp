// registry.cpp — the modes a run can have: one line each.
#include <fmt/format.h>

#include "core/check.h"
#include "towers/modes/mode.h"

namespace towers {

// The policies, one per file of this folder.
std::unique_ptr<ModePolicy> make_sync_tree(const EngineConfig& cfg);      // sync.cpp
std::unique_ptr<ModePolicy> make_backup_towers(const EngineConfig& cfg);  // backup.cpp
std::unique_ptr<ModePolicy> make_hogwild(const EngineConfig& cfg);        // hogwild.cpp
std::unique_ptr<ModePolicy> make_ssp_gate(const EngineConfig& cfg);       // ssp.cpp

namespace {
using Factory = std::unique_ptr<ModePolicy> (*)(const EngineConfig&);
struct Entry {
  ModeInfo info;
  Factory make;
};

std::unique_ptr<ModePolicy> make_sync(const EngineConfig& cfg) {
  const int k = cfg.replicas_to_aggregate == 0 ? cfg.towers : cfg.replicas_to_aggregate;
  return k == cfg.towers ? make_sync_tree(cfg) : make_backup_towers(cfg);
}

const std::vector<Entry>& entries() {
  static const std::vector<Entry> e = {
      {{Mode::Sync, "sync", "average every tower's gradient in tower order, apply once"}, make_sync},
      {{Mode::Async, "async", "every tower applies its own gradient at once (Hogwild)"}, make_hogwild},
      {{Mode::Ssp, "ssp", "async, no tower more than --staleness steps ahead of the slowest"},
       make_ssp_gate},
  };
  return e;
}
}  // namespace

const std::vector<ModeInfo>& modes() {
  static const std::vector<ModeInfo> m = [] {
    std::vector<ModeInfo> out;
    for (const Entry& e : entries()) out.push_back(e.info);
    return out;
  }();
  return m;
}

std::optional<Mode> mode_named(const std::string& name) {
  for (const Entry& e : entries())
    if (name == e.info.name) return e.info.mode;
  return std::nullopt;
}

std::string mode_name(Mode m) {
  for (const Entry& e : entries())
    if (e.info.mode == m) return e.info.name;
  TOWERS_FAIL("mode {} is not registered", static_cast<int>(m));
}

std::string mode_names() {
  std::string s;
  for (const Entry& e : entries()) s += (s.empty() ? "" : ", ") + std::string(e.info.name);
  return s;
}

std::unique_ptr<ModePolicy> make_policy(const EngineConfig& cfg) {
  for (const Entry& e : entries())
    if (e.info.mode == cfg.mode) return e.make(cfg);
  TOWERS_FAIL("mode {} is not registered", static_cast<int>(cfg.mode));
}

}  // namespace towers
