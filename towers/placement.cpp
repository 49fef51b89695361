#include "towers/placement.h"

#include <algorithm>
#include <cctype>
#include <map>
#include <optional>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/check.h"

namespace towers {

namespace {

std::string trim(const std::string& s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return s.substr(b, e - b);
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t b = 0;
  for (size_t i = 0; i <= s.size(); ++i)
    if (i == s.size() || s[i] == sep) {
      out.push_back(trim(s.substr(b, i - b)));
      b = i + 1;
    }
  return out;
}

// A non-negative decimal number, all of s; nullopt otherwise (or above `most`).
std::optional<int> number(const std::string& s, int most) {
  if (s.empty() || s.size() > 6) return std::nullopt;
  int v = 0;
  for (char ch : s) {
    if (!std::isdigit(static_cast<unsigned char>(ch))) return std::nullopt;
    v = v * 10 + (ch - '0');
  }
  if (v > most) return std::nullopt;
  return v;
}

constexpr const char* kDevices = "cpu, cpu:N, cpu:NxT (T threads), cuda:N";

// cpu | cpu:N | cpu:NxT | cuda:N, into part's kind, index and threads.
void parse_device(const std::string& text, int part, PlacedPart& p, const std::string& origin) {
  auto bad = [&]() {
    TOWERS_BAD_INPUT("{}: unknown device '{}' in part {} (known: {})", origin, text, part,
                     kDevices);
  };
  if (text == "cpu") return;  // cpu:0, with the tower's share of threads
  if (text.rfind("cuda:", 0) == 0) {
    const std::optional<int> gpu = number(text.substr(5), 1023);
    if (!gpu) bad();
    p.kind = DeviceKind::Cuda;
    p.index = *gpu;
    return;
  }
  if (text.rfind("cpu:", 0) != 0) bad();
  const std::string rest = text.substr(4);
  const size_t x = rest.find('x');
  const std::optional<int> index = number(rest.substr(0, x), 1023);
  if (!index) bad();
  p.index = *index;
  if (x == std::string::npos) return;
  const std::optional<int> threads = number(rest.substr(x + 1), 256);
  TOWERS_REQUIRE(threads && *threads >= 1,
                 "{}: device '{}' in part {}: the thread count after 'x' must be 1 to 256", origin,
                 text, part);
  p.threads = *threads;
}

}  // namespace

std::string PlacedPart::device_name() const {
  return fmt::format("{}:{}", kind == DeviceKind::Cpu ? "cpu" : "cuda", index);
}

std::string PlacedPart::layer_names(const Graph& g) const {
  const auto& ls = g.layers();
  if (last == first + 1) return ls[first]->name();
  return ls[first]->name() + ".." + ls[last - 1]->name();
}

Placement parse_placement(const std::string& text, const Graph& graph, const std::string& origin) {
  const auto& layers = graph.layers();
  std::map<std::string, size_t> index_of;
  std::vector<std::string> names;
  for (size_t i = 0; i < layers.size(); ++i) {
    index_of[layers[i]->name()] = i;
    names.push_back(layers[i]->name());
  }
  TOWERS_CHECK(!names.empty(), "model {} has no layers", graph.model());
  auto layer_index = [&](const std::string& name, int part) {
    auto it = index_of.find(name);
    TOWERS_REQUIRE(it != index_of.end(), "{}: unknown layer '{}' in part {} (model {} has: {})",
                   origin, name, part, graph.model(), fmt::join(names, ", "));
    return it->second;
  };
  TOWERS_REQUIRE(!trim(text).empty(),
                 "{}: empty placement; expected LAYERS@DEVICE;LAYERS@DEVICE..., e.g. "
                 "{}..{}@cpu:0",
                 origin, names.front(), names.back());

  Placement out;
  out.text = text;
  std::vector<std::pair<size_t, int>> listed;  // (layer, part) in the order given
  std::map<std::string, int> device_part;
  const std::vector<std::string> part_texts = split(text, ';');
  for (size_t k = 0; k < part_texts.size(); ++k) {
    const int part = static_cast<int>(k) + 1;  // 1-based in messages
    const std::string& pt = part_texts[k];
    const size_t at = pt.rfind('@');
    TOWERS_REQUIRE(at != std::string::npos,
                   "{}: part {} '{}' names no device; expected LAYERS@DEVICE (devices: {})", origin,
                   part, pt, kDevices);
    PlacedPart p;
    parse_device(trim(pt.substr(at + 1)), part, p, origin);
    const std::string layer_text = trim(pt.substr(0, at));
    TOWERS_REQUIRE(!layer_text.empty(), "{}: part {} '{}' names no layers", origin, part, pt);
    std::vector<size_t> mine;
    for (const std::string& item : split(layer_text, ',')) {
      TOWERS_REQUIRE(!item.empty(), "{}: part {} '{}' has an empty layer name", origin, part, pt);
      const size_t dots = item.find("..");
      if (dots == std::string::npos) {
        mine.push_back(layer_index(item, part));
        continue;
      }
      const size_t a = layer_index(trim(item.substr(0, dots)), part);
      const size_t b = layer_index(trim(item.substr(dots + 2)), part);
      TOWERS_REQUIRE(a <= b, "{}: range '{}' in part {} runs backwards: model {} runs {} before {}",
                     origin, item, part, graph.model(), names[b], names[a]);
      for (size_t i = a; i <= b; ++i) mine.push_back(i);
    }
    for (size_t i : mine) {
      for (const auto& [j, q] : listed)
        TOWERS_REQUIRE(j != i, "{}: layer '{}' is placed twice (part {} and part {})", origin,
                       names[i], q, part);
      listed.emplace_back(i, part);
    }
    const std::string dev = p.device_name();
    auto [it, fresh] = device_part.emplace(dev, part);
    TOWERS_REQUIRE(fresh,
                   "{}: device {} holds part {} and part {}; give each part a device of "
                   "its own (cpu:0, cpu:1, ...)",
                   origin, dev, it->second, part);
    // A part is a set of layers; they must be one run of the model's layers.
    std::sort(mine.begin(), mine.end());
    std::vector<std::string> gap;
    for (size_t i = mine.front(); i <= mine.back(); ++i)
      if (!std::binary_search(mine.begin(), mine.end(), i)) gap.push_back(names[i]);
    TOWERS_REQUIRE(gap.empty(),
                   "{}: part {} holds {} and {} but not {} between them; a part is a "
                   "run of consecutive layers of model {} ({})",
                   origin, part, names[mine.front()], names[mine.back()], fmt::join(gap, ", "),
                   graph.model(), fmt::join(names, ", "));
    p.first = mine.front();
    p.last = mine.back() + 1;
    out.parts.push_back(p);
  }

  std::vector<std::string> missing;
  for (size_t i = 0; i < layers.size(); ++i)
    if (std::none_of(listed.begin(), listed.end(), [&](const auto& l) { return l.first == i; }))
      missing.push_back(names[i]);
  TOWERS_REQUIRE(missing.empty(),
                 "{}: layer{} {} {} in no part; every layer of model {} must be "
                 "placed ({})",
                 origin, missing.size() > 1 ? "s" : "", fmt::join(missing, ", "),
                 missing.size() > 1 ? "are" : "is", graph.model(), fmt::join(names, ", "));
  // Every layer once, each part a run: the parts are in order when each starts where the one
  // before it ends.
  for (size_t k = 1; k < out.parts.size(); ++k) {
    const PlacedPart& a = out.parts[k - 1];
    const PlacedPart& b = out.parts[k];
    if (b.first == a.last) continue;
    const std::string next = a.last < layers.size()
                                 ? fmt::format("is followed by {}", names[a.last])
                                 : fmt::format("ends model {}", graph.model());
    TOWERS_BAD_INPUT(
        "{}: parts out of order: part {} ({}) follows part {} ({}), but {} {}; list "
        "the parts in the model's order, each feeding the next ({})",
        origin, k + 1, b.layer_names(graph), k, a.layer_names(graph), names[a.last - 1], next,
        fmt::join(names, ", "));
  }
  return out;
}

void check_micro_batches(const Graph& graph, int64_t batch, int micro_batches,
                         const std::string& origin) {
  TOWERS_REQUIRE(micro_batches >= 1, "{} must be at least 1, got {}", origin, micro_batches);
  if (micro_batches == 1) return;
  TOWERS_REQUIRE(batch % micro_batches == 0,
                 "{} {}: the batch of {} examples per tower does not split into {} equal "
                 "micro-batches",
                 origin, micro_batches, batch, micro_batches);
  const int64_t mb = batch / micro_batches;
  for (const auto& l : graph.layers()) {
    for (const ParamSpec& s : l->params())
      TOWERS_REQUIRE(s.trainable,
                     "{} {}: layer {} keeps state ({}) that each training pass over a batch "
                     "updates from that batch's statistics, so micro-batches would update it {} "
                     "times a step; use {} 1 for this model",
                     origin, micro_batches, l->name(), s.name, micro_batches, origin);
    const int64_t c = l->batch_chunk();
    if (c <= 0) continue;
    const int64_t blocks = mb % c == 0 ? mb / c : 0;
    TOWERS_REQUIRE(blocks > 0 && (blocks & (blocks - 1)) == 0,
                   "{} {}: micro-batches of {} examples (batch {} / {}); layer {} sums its "
                   "gradient over blocks of {} examples, and a micro-batch must be a power-of-two "
                   "number of such blocks ({}, {}, {}, ... examples) for the update to equal one "
                   "of the whole batch bit for bit: change --batch or {}",
                   origin, micro_batches, mb, batch, micro_batches, l->name(), c, c, 2 * c, 4 * c,
                   origin);
  }
}

}  // namespace towers
