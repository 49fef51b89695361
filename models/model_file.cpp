#include "models/model_file.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <optional>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "core/check.h"
#include "io/json_source.h"
#include "layers/batchnorm.h"
#include "layers/dropout.h"
#include "layers/gelu.h"
#include "layers/global_avg_pool.h"
#include "layers/lrn.h"
#include "layers/maxpool.h"
#include "layers/relu.h"
#include "layers/residual.h"
#include "towers/placement.h"

namespace towers {

namespace {

using io::JsonSource;
using io::TextPos;
using nlohmann::json;

constexpr int64_t kMaxExtent = 4096;  // channels or a side of the input, a kernel, a stride
constexpr int64_t kMaxWidth = int64_t{1} << 20;  // filters, units
constexpr int64_t kMaxClasses = 65536;
constexpr size_t kMaxName = 64;

// A field of an object of the file, and what it holds (for "missing field" errors).
struct Field {
  std::string_view name, what;
};
using Fields = std::vector<Field>;

const Fields kModelFields = {
    {"name", "the model's name: letters, digits, '_', '-' and '.'"},
    {"description", "free text"},
    {"input", "the input shape, [C, H, W]"},
    {"classes", "the number of classes, as many as the last layer's outputs"},
    {"layers", "the layers, in order"},
    {"placement", "the layers' devices, parts LAYERS@DEVICE joined by ';' (as --placement)"},
};
const Fields kLayerFields = {
    {"name", "the layer's name, unique in the model"},
    {"type", "the layer type"},
    {"inputs", "the layer whose output this one takes"},
};
const Fields kWeightInitFields = {
    {"type", "\"truncated_normal\""},
    {"stddev", "the standard deviation of the normal, truncated at 2 of them"},
};

// The chain so far, as the next layer sees it.
struct Chain {
  Shape shape;                           // the next layer's input, per example
  std::string from = "the model input";  // what gives it, for messages
  std::string previous = "input";        // its name, as "inputs" names it
  std::map<std::string, std::string> names;  // layer name -> its label ("layers[3]") and pointer
  std::map<std::string, std::string> name_pointers;
  double parameters = 0;
};

// An object of the file being read, and how errors name it.
struct Node {
  const json* value = nullptr;
  std::string pointer;  // JSON pointer ("/layers/3")
  std::string label;    // "layers[3] 'conv2' (conv2d): ", "" at the top level
  std::string prefix;   // "weight_init." inside a layer's weight_init
  Fields fields;        // the fields it may have
};

std::string describe(const json& v) {
  std::string text = v.dump();
  if (text.size() > 40) text = text.substr(0, 37) + "...";
  const char* kind = v.is_string()    ? "a string"
                     : v.is_number()  ? "a number"
                     : v.is_boolean() ? "a boolean"
                     : v.is_object()  ? "an object"
                     : v.is_array()   ? "an array"
                                      : nullptr;
  return kind == nullptr ? text : fmt::format("{} ({})", text, kind);
}

bool valid_name(const std::string& s) {
  return !s.empty() && s.size() <= kMaxName && std::all_of(s.begin(), s.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '.';
  });
}

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = up;
    }
  }
  return row[b.size()];
}

// "did you mean 'stride'? " when a known word is a likely typo of `word` (a small edit
// distance, or one is a prefix of the other), else "".
std::string suggestion(std::string_view word, const std::vector<std::string_view>& known) {
  std::string lower(word);
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  std::string_view best;
  size_t best_distance = std::numeric_limits<size_t>::max();
  for (std::string_view k : known) {
    const size_t d = edit_distance(lower, k);
    if (d < best_distance) best = k, best_distance = d;
  }
  if (best_distance <= std::max<size_t>(1, best.size() / 3))
    return fmt::format("did you mean '{}'? ", best);
  for (std::string_view k : known)
    if (lower.size() >= 3 && (k.starts_with(lower) || std::string_view(lower).starts_with(k)))
      return fmt::format("did you mean '{}'? ", k);
  return "";
}

std::vector<std::string_view> names_of(const Fields& fields) {
  std::vector<std::string_view> out;
  for (const Field& f : fields) out.push_back(f.name);
  return out;
}

class Reader {
 public:
  explicit Reader(const JsonSource& doc) : doc_(doc) {}
  ModelSpec read() const;

  // A layer type: its fields besides name, type and inputs, and the reader of the rest.
  struct LayerType {
    std::string_view type;
    Fields fields;
    void (Reader::*read)(const Node& n, Chain& c, LayerSpec& out) const;
    std::string_view size_field;  // the field that sets its number of outputs, if any
  };
  static const std::vector<LayerType>& layer_types();

 private:
  // The one way out: "<file>:<line>:<column>: <label><message>".
  [[noreturn]] void fail(TextPos at, const Node& n, const std::string& message) const {
    TOWERS_BAD_INPUT("{}: {}{}", doc_.where(at), n.label, message);
  }
  // An error about the value of a field, at that value.
  [[noreturn]] void fail_field(const Node& n, std::string_view field,
                               const std::string& message) const {
    fail(doc_.value_pos(JsonSource::child(n.pointer, field)), n,
         fmt::format("field '{}{}': {}", n.prefix, field, message));
  }

  void check_fields(const Node& n) const;
  const json* find(const Node& n, std::string_view field) const;
  const json& require(const Node& n, std::string_view field) const;
  int64_t integer(const Node& n, std::string_view field, int64_t lo, int64_t hi,
                  std::optional<int64_t> fallback = std::nullopt) const;
  float number(const Node& n, std::string_view field, std::optional<float> fallback,
               double lo = -std::numeric_limits<double>::infinity(), bool above = false) const;
  bool boolean(const Node& n, std::string_view field, bool fallback) const;
  std::string text(const Node& n, std::string_view field) const;
  std::string name(const Node& n) const;
  kernels::Padding padding(const Node& n) const;
  float weight_init(const Node& layer) const;
  Shape input(const Node& top) const;
  void inputs(const Node& n, const Chain& c) const;
  void placement(const Node& top, ModelSpec& spec) const;

  // Layer i of the array `list` at list_pointer; `where` prefixes its label ("" at the top,
  // "layers[2].", inside a residual block).
  LayerSpec layer(const json& list, const std::string& list_pointer, const std::string& where,
                  size_t i, Chain& c, Node* node) const;
  // The layer's input, which must be an image (C, H, W).
  const Shape& image_input(const Node& n, const Chain& c) const;
  kernels::Window window(const Node& n, const Chain& c, int64_t side, int64_t kernel,
                         int64_t stride, kernels::Padding padding) const;
  void add_parameters(const Node& n, std::string_view field, double count, Chain& c) const;

  void conv2d(const Node& n, Chain& c, LayerSpec& out) const;
  void maxpool(const Node& n, Chain& c, LayerSpec& out) const;
  void lrn(const Node& n, Chain& c, LayerSpec& out) const;
  void dense(const Node& n, Chain& c, LayerSpec& out) const;
  void gelu(const Node& n, Chain& c, LayerSpec& out) const;
  void relu(const Node& n, Chain& c, LayerSpec& out) const;
  void global_avg_pool(const Node& n, Chain& c, LayerSpec& out) const;
  void batchnorm(const Node& n, Chain& c, LayerSpec& out) const;
  void residual(const Node& n, Chain& c, LayerSpec& out) const;
  void dropout(const Node& n, Chain& c, LayerSpec& out) const;

  const JsonSource& doc_;
};

const std::vector<Reader::LayerType>& Reader::layer_types() {
  static const std::vector<LayerType> types = {
      {"conv2d",
       {{"filters", "the number of output channels"},
        {"kernel", "the kernel's height and width"},
        {"stride", "the step between windows"},
        {"padding", "\"same\" or \"valid\""},
        {"relu", "whether a ReLU follows"},
        {"weight_init", "the weights' initialiser, like {\"stddev\": 0.05}"},
        {"bias_init", "the biases' initial value"},
        {"weight_decay", "the L2 factor on the weights"},
        {"algorithm", "how the CPU computes it: \"auto\", \"im2col\" or \"winograd\""}},
       &Reader::conv2d,
       "filters"},
      {"maxpool",
       {{"kernel", "the window's height and width"},
        {"stride", "the step between windows"},
        {"padding", "\"same\" or \"valid\""}},
       &Reader::maxpool,
       ""},
      {"lrn",
       {{"depth_radius", "channels on each side in the sum"},
        {"bias", "the offset inside the power"},
        {"alpha", "the scale of the sum of squares"},
        {"beta", "the exponent"}},
       &Reader::lrn,
       ""},
      {"dense",
       {{"units", "the number of outputs"},
        {"relu", "whether a ReLU follows"},
        {"weight_init", "the weights' initialiser, like {\"stddev\": 0.04}"},
        {"bias_init", "the biases' initial value"},
        {"weight_decay", "the L2 factor on the weights"}},
       &Reader::dense,
       "units"},
      {"gelu", {}, &Reader::gelu, ""},
      {"relu", {}, &Reader::relu, ""},
      {"global_avg_pool", {}, &Reader::global_avg_pool, ""},
      {"residual",
       {{"layers", "the inner layers, whose output has the block's input shape"}},
       &Reader::residual,
       ""},
      {"batchnorm",
       {{"momentum", "the running statistics' decay, in [0, 1) (default 0.9)"},
        {"epsilon", "added to the variance, > 0 (default 1e-5)"},
        {"weight_decay", "the L2 factor on gamma and beta (default 0)"}},
       &Reader::batchnorm,
       ""},
      {"dropout",
       {{"rate", "the probability of dropping an element in training, in [0, 1) (default 0.5)"}},
       &Reader::dropout,
       ""},
  };
  return types;
}

std::vector<std::string_view> type_names() {
  std::vector<std::string_view> out;
  for (const auto& t : Reader::layer_types()) out.push_back(t.type);
  return out;
}

// Duplicate keys first, then unknown ones: each at the first place in the file.
void Reader::check_fields(const Node& n) const {
  for (const auto& d : doc_.duplicate_keys())
    if (d.object == n.pointer)
      fail(d.second, n,
           fmt::format("field '{}{}' is given twice (first at line {}, column {})", n.prefix, d.key,
                       d.first.line, d.first.column));
  const std::vector<std::string_view> known = names_of(n.fields);
  std::optional<std::string> first;
  TextPos first_at;
  for (const auto& [key, value] : n.value->items()) {
    if (std::find(known.begin(), known.end(), key) != known.end()) continue;
    const TextPos at = doc_.key_pos(JsonSource::child(n.pointer, key));
    if (!first || std::pair(at.line, at.column) < std::pair(first_at.line, first_at.column))
      first = key, first_at = at;
  }
  if (first)
    fail(first_at, n,
         fmt::format("unknown field '{}{}' ({}known: {})", n.prefix, *first,
                     suggestion(*first, known), fmt::join(known, ", ")));
}

const json* Reader::find(const Node& n, std::string_view field) const {
  auto it = n.value->find(std::string(field));
  return it == n.value->end() ? nullptr : &*it;
}

const json& Reader::require(const Node& n, std::string_view field) const {
  if (const json* v = find(n, field)) return *v;
  std::string_view what;
  for (const Field& f : n.fields)
    if (f.name == field) what = f.what;
  fail(doc_.value_pos(n.pointer), n,
       fmt::format("missing field '{}{}' ({})", n.prefix, field, what));
}

int64_t Reader::integer(const Node& n, std::string_view field, int64_t lo, int64_t hi,
                        std::optional<int64_t> fallback) const {
  const json* v = fallback ? find(n, field) : &require(n, field);
  if (v == nullptr) return *fallback;
  if (!v->is_number_integer())
    fail_field(n, field, fmt::format("expected an integer, got {}", describe(*v)));
  const bool huge = v->is_number_unsigned() &&
                    v->get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  const int64_t x = huge ? std::numeric_limits<int64_t>::max() : v->get<int64_t>();
  if (x < lo || x > hi)
    fail_field(n, field, fmt::format("must be from {} to {}, got {}", lo, hi, v->dump()));
  return x;
}

float Reader::number(const Node& n, std::string_view field, std::optional<float> fallback,
                     double lo, bool above) const {
  const json* v = fallback ? find(n, field) : &require(n, field);
  if (v == nullptr) return *fallback;
  if (!v->is_number()) fail_field(n, field, fmt::format("expected a number, got {}", describe(*v)));
  const double x = v->get<double>();
  if (!std::isfinite(x) || std::fabs(x) > std::numeric_limits<float>::max())
    fail_field(n, field, fmt::format("{} is not a finite 32-bit float", v->dump()));
  if (x < lo || (above && x == lo))
    fail_field(n, field, fmt::format("must be {} {}, got {}", above ? ">" : ">=", lo, v->dump()));
  return static_cast<float>(x);
}

bool Reader::boolean(const Node& n, std::string_view field, bool fallback) const {
  const json* v = find(n, field);
  if (v == nullptr) return fallback;
  if (!v->is_boolean())
    fail_field(n, field, fmt::format("expected true or false, got {}", describe(*v)));
  return v->get<bool>();
}

std::string Reader::text(const Node& n, std::string_view field) const {
  const json& v = require(n, field);
  if (!v.is_string()) fail_field(n, field, fmt::format("expected a string, got {}", describe(v)));
  return v.get<std::string>();
}

std::string Reader::name(const Node& n) const {
  std::string s = text(n, "name");
  if (!valid_name(s))
    fail_field(n, "name",
               fmt::format("'{}' is not a name: use 1 to {} letters, digits, '_', '-' or '.'",
                           s.substr(0, kMaxName + 1), kMaxName));
  return s;
}

kernels::Padding Reader::padding(const Node& n) const {
  if (find(n, "padding") == nullptr) return kernels::Padding::Same;
  std::string s = text(n, "padding");
  for (char& ch : s) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  if (s == "same") return kernels::Padding::Same;
  if (s == "valid") return kernels::Padding::Valid;
  fail_field(
      n, "padding",
      fmt::format("unknown padding {} (known: \"same\", \"valid\")", find(n, "padding")->dump()));
}

float Reader::weight_init(const Node& layer) const {
  const json& v = require(layer, "weight_init");
  if (!v.is_object())
    fail_field(layer, "weight_init",
               fmt::format("expected an object like {{\"type\": \"truncated_normal\", \"stddev\": "
                           "0.05}}, got {}",
                           describe(v)));
  const Node init{&v, JsonSource::child(layer.pointer, "weight_init"), layer.label, "weight_init.",
                  kWeightInitFields};
  check_fields(init);
  if (find(init, "type") != nullptr && text(init, "type") != "truncated_normal")
    fail_field(init, "type",
               fmt::format("unknown initialiser {} (known: \"truncated_normal\")",
                           find(init, "type")->dump()));
  return number(init, "stddev", std::nullopt, 0.0);
}

Shape Reader::input(const Node& top) const {
  const json& v = require(top, "input");
  if (!v.is_array() || v.size() != 3)
    fail_field(top, "input",
               fmt::format("expected the input shape [C, H, W], got {}", describe(v)));
  const std::string pointer = JsonSource::child(top.pointer, "input");
  const char* axis[] = {"C", "H", "W"};
  Shape shape;
  for (size_t k = 0; k < 3; ++k) {
    const json& d = v[k];
    if (!d.is_number_integer() || d.get<int64_t>() < 1 || d.get<int64_t>() > kMaxExtent ||
        (d.is_number_unsigned() && d.get<uint64_t>() > static_cast<uint64_t>(kMaxExtent)))
      fail(doc_.value_pos(JsonSource::child(pointer, k)), top,
           fmt::format("field 'input': {} ({}) must be an integer from 1 to {}, got {}", axis[k], k,
                       kMaxExtent, d.dump()));
    shape.push_back(d.get<int64_t>());
  }
  if (static_cast<double>(numel(shape)) > static_cast<double>(kMaxLayerFloats))
    fail_field(top, "input",
               fmt::format("{} floats per example, more than the {} a model file may have",
                           numel(shape), kMaxLayerFloats));
  return shape;
}

void Reader::inputs(const Node& n, const Chain& c) const {
  const json& v = *find(n, "inputs");
  const bool names =
      v.is_array() && std::all_of(v.begin(), v.end(), [](const json& e) { return e.is_string(); });
  if (!names)
    fail_field(n, "inputs",
               fmt::format("expected an array of layer names, like [\"{}\"], got {}", c.previous,
                           describe(v)));
  if (v.size() != 1)
    fail_field(n, "inputs",
               v.empty()
                   ? std::string("a layer takes one input")
                   : std::string("a layer with several inputs is not supported yet: models are "
                                 "chains, each layer takes the output of the one before it"));
  const std::string got = v[0].get<std::string>();
  if (got == c.previous) return;
  if (got == "input" || c.names.count(got) != 0)
    fail_field(n, "inputs",
               fmt::format("models are chains for now: this layer takes the output of the one "
                           "before it, '{}', not '{}'",
                           c.previous, got));
  fail_field(n, "inputs",
             fmt::format("'{}' is not the name of an earlier layer (this layer takes '{}', the one "
                         "before it)",
                         got.substr(0, kMaxName + 1), c.previous));
}

const Shape& Reader::image_input(const Node& n, const Chain& c) const {
  if (c.shape.size() != 3)
    fail_field(n, "type",
               fmt::format("a {} layer needs an image input (C, H, W), but {} gives {}",
                           find(n, "type")->get<std::string>(), c.from, to_string(c.shape)));
  return c.shape;
}

kernels::Window Reader::window(const Node& n, const Chain& c, int64_t side, int64_t kernel,
                               int64_t stride, kernels::Padding padding) const {
  if (padding == kernels::Padding::Valid && kernel > side)
    fail_field(n, "kernel",
               fmt::format("a {}x{} window does not fit its {}x{} input (from {}) with padding "
                           "\"valid\"",
                           kernel, kernel, c.shape[1], c.shape[2], c.from));
  return kernels::make_window(side, kernel, stride, padding);
}

void Reader::add_parameters(const Node& n, std::string_view field, double count, Chain& c) const {
  c.parameters += count;
  if (c.parameters > static_cast<double>(kMaxModelParameters))
    fail_field(n, field,
               fmt::format("the model would have {:.0f} parameters, more than the {} a model file "
                           "may have",
                           c.parameters, kMaxModelParameters));
}

void Reader::conv2d(const Node& n, Chain& c, LayerSpec& out) const {
  Conv2DConfig cfg;
  cfg.out_channels = integer(n, "filters", 1, kMaxWidth);
  cfg.kernel = integer(n, "kernel", 1, kMaxExtent);
  cfg.stride = integer(n, "stride", 1, kMaxExtent, 1);
  cfg.padding = padding(n);
  cfg.relu = boolean(n, "relu", true);
  cfg.weight_stddev = weight_init(n);
  cfg.bias_init = number(n, "bias_init", 0.0f);
  cfg.weight_decay = number(n, "weight_decay", 0.0f, 0.0);
  const Shape& in = image_input(n, c);
  const kernels::Window rows = window(n, c, in[1], cfg.kernel, cfg.stride, cfg.padding);
  const kernels::Window cols = window(n, c, in[2], cfg.kernel, cfg.stride, cfg.padding);
  if (find(n, "algorithm") != nullptr) {
    const std::string a = text(n, "algorithm");
    const std::optional<ConvAlgorithm> algo = conv_algorithm_named(a);
    if (!algo)
      fail_field(n, "algorithm",
                 fmt::format("unknown algorithm \"{}\" (known: \"auto\", \"im2col\", \"winograd\")", a));
    cfg.algorithm = *algo;
    if (cfg.algorithm == ConvAlgorithm::Winograd &&
        !kernels::cpu::winograd_fits(cfg.kernel, cfg.stride, cfg.padding))
      fail_field(n, "algorithm",
                 fmt::format("\"winograd\" needs a 3x3 or 5x5 kernel with stride 1 and padding "
                             "\"same\" (this is {}x{}, stride {})",
                             cfg.kernel, cfg.kernel, cfg.stride));
  }
  const double patch = static_cast<double>(in[0]) * static_cast<double>(cfg.kernel * cfg.kernel);
  const double pixels = static_cast<double>(rows.out * cols.out);
  if (patch * pixels > static_cast<double>(kMaxLayerFloats))
    fail_field(n, "kernel",
               fmt::format("a {}x{} kernel over its {} input (from {}) makes {:.0f} floats of "
                           "im2col per example, more than the {} a model file may ask for",
                           cfg.kernel, cfg.kernel, to_string(in), c.from, patch * pixels,
                           kMaxLayerFloats));
  if (static_cast<double>(cfg.out_channels) * pixels > static_cast<double>(kMaxLayerFloats))
    fail_field(n, "filters",
               fmt::format("{} filters of {}x{} make {:.0f} floats of output per example, more "
                           "than the {} a model file may ask for",
                           cfg.out_channels, rows.out, cols.out,
                           static_cast<double>(cfg.out_channels) * pixels, kMaxLayerFloats));
  add_parameters(n, "filters", static_cast<double>(cfg.out_channels) * (patch + 1), c);
  out.out = {cfg.out_channels, rows.out, cols.out};
  out.config = cfg;
}

void Reader::maxpool(const Node& n, Chain& c, LayerSpec& out) const {
  MaxPoolConfig cfg;
  cfg.kernel = integer(n, "kernel", 1, kMaxExtent);
  cfg.stride = integer(n, "stride", 1, kMaxExtent);
  cfg.padding = padding(n);
  const Shape& in = image_input(n, c);
  const kernels::Window rows = window(n, c, in[1], cfg.kernel, cfg.stride, cfg.padding);
  const kernels::Window cols = window(n, c, in[2], cfg.kernel, cfg.stride, cfg.padding);
  out.out = {in[0], rows.out, cols.out};
  out.config = cfg;
}

// tf.nn.lrn's defaults.
void Reader::lrn(const Node& n, Chain& c, LayerSpec& out) const {
  kernels::LrnParams p;
  p.depth_radius = integer(n, "depth_radius", 0, kMaxExtent, 5);
  p.bias = number(n, "bias", 1.0f, 0.0, /*above=*/true);
  p.alpha = number(n, "alpha", 1.0f, 0.0);
  p.beta = number(n, "beta", 0.5f, 0.0);
  out.out = image_input(n, c);
  out.config = p;
}

void Reader::dense(const Node& n, Chain& c, LayerSpec& out) const {
  DenseConfig cfg;
  cfg.out = integer(n, "units", 1, kMaxWidth);
  cfg.relu = boolean(n, "relu", true);
  cfg.weight_stddev = weight_init(n);
  cfg.bias_init = number(n, "bias_init", 0.0f);
  cfg.weight_decay = number(n, "weight_decay", 0.0f, 0.0);
  add_parameters(n, "units", static_cast<double>(cfg.out) * static_cast<double>(numel(c.shape) + 1),
                 c);
  out.out = {cfg.out};
  out.config = cfg;
}

// Any input shape, kept.
void Reader::gelu(const Node&, Chain& c, LayerSpec& out) const {
  out.out = c.shape;
  out.config = GeluConfig{};
}

void Reader::relu(const Node&, Chain& c, LayerSpec& out) const {
  out.out = c.shape;
  out.config = ReluConfig{};
}

void Reader::global_avg_pool(const Node& n, Chain& c, LayerSpec& out) const {
  const Shape& in = image_input(n, c);
  out.out = {in[0], 1, 1};
  out.config = GlobalAvgPoolConfig{};
}

// Per channel of a (C) or (C, H, W) input; the shape is kept.
void Reader::batchnorm(const Node& n, Chain& c, LayerSpec& out) const {
  BatchNormConfig cfg;
  cfg.momentum = number(n, "momentum", 0.9f, 0.0);
  if (cfg.momentum >= 1.0) fail_field(n, "momentum", fmt::format("must be below 1, got {}", cfg.momentum));
  cfg.eps = number(n, "epsilon", 1e-5f, 0.0, /*above=*/true);
  cfg.weight_decay = number(n, "weight_decay", 0.0f, 0.0);
  add_parameters(n, "type", 4.0 * static_cast<double>(c.shape[0]), c);
  out.out = c.shape;
  out.config = cfg;
}

// Any input shape, kept.
void Reader::dropout(const Node& n, Chain& c, LayerSpec& out) const {
  DropoutConfig cfg;
  cfg.rate = number(n, "rate", 0.5f, 0.0);
  if (cfg.rate >= 1.0)
    fail_field(n, "rate", fmt::format("must be below 1 (the probability of dropping), got {}",
                                      cfg.rate));
  out.out = c.shape;
  out.config = cfg;
}

// y = x + f(x): the inner layers, read like the model's (names unique in the whole model),
// must give the block's input shape back.
void Reader::residual(const Node& n, Chain& c, LayerSpec& out) const {
  const json& list = require(n, "layers");
  if (!list.is_array() || list.empty())
    fail_field(n, "layers",
               fmt::format("expected a non-empty array of layers, got {}", describe(list)));
  const Shape in = c.shape;
  const std::string from = c.from, previous = c.previous;
  const std::string where = n.label.substr(0, n.label.find(' ')) + ".";
  const std::string pointer = JsonSource::child(n.pointer, "layers");
  ResidualConfig cfg;
  int vars = 0;
  for (size_t i = 0; i < list.size(); ++i) {
    Node inner;
    cfg.layers.push_back(layer(list, pointer, where, i, c, &inner));
    const LayerSpec& l = cfg.layers.back();
    if (std::holds_alternative<ResidualConfig>(l.config))
      fail_field(inner, "type", "a residual block inside a residual block is not supported");
    vars += std::holds_alternative<BatchNormConfig>(l.config)                              ? 4
            : std::holds_alternative<Conv2DConfig>(l.config) || std::holds_alternative<DenseConfig>(l.config) ? 2
                                                                                             : 0;
    if (vars > kMaxLayerVars)
      fail_field(inner, "type",
                 fmt::format("a residual block holds at most {} variables (a conv2d or dense has "
                             "2, a batchnorm 4)",
                             kMaxLayerVars));
  }
  if (c.shape != in)
    fail_field(n, "layers",
               fmt::format("the inner layers give {}, but the block's shortcut carries its input "
                           "{}: they must match",
                           to_string(c.shape), to_string(in)));
  c.from = from, c.previous = previous;
  out.out = in;
  out.config = std::move(cfg);
}

LayerSpec Reader::layer(const json& list, const std::string& list_pointer,
                        const std::string& where, size_t i, Chain& c, Node* node) const {
  const std::string pointer = JsonSource::child(list_pointer, i);
  const json& v = list[i];
  const std::string at = fmt::format("{}layers[{}]", where, i);
  Node& n = *node;
  n = Node{&v, pointer, fmt::format("{}: ", at), "", kLayerFields};
  if (!v.is_object())
    fail(doc_.value_pos(pointer), n,
         fmt::format("expected a layer (an object), got {}", describe(v)));
  // Errors name the layer as soon as its name is known.
  const json* name_value = find(n, "name");
  std::string label_name;
  if (name_value != nullptr && name_value->is_string() &&
      valid_name(name_value->get<std::string>()))
    label_name = fmt::format(" '{}'", name_value->get<std::string>());
  n.label = fmt::format("{}{}: ", at, label_name);

  const std::vector<std::string_view> types = type_names();
  if (find(n, "type") == nullptr)
    fail(doc_.value_pos(pointer), n,
         fmt::format("missing field 'type' (the layer type: {})", fmt::join(types, ", ")));
  const std::string type_name = text(n, "type");
  const auto& all = layer_types();
  auto type =
      std::find_if(all.begin(), all.end(), [&](const LayerType& t) { return t.type == type_name; });
  if (type == all.end())
    fail_field(n, "type",
               fmt::format("unknown layer type '{}' ({}known: {})", type_name.substr(0, 40),
                           suggestion(type_name, types), fmt::join(types, ", ")));
  n.label = fmt::format("{}{} ({}): ", at, label_name, type->type);
  n.fields.insert(n.fields.end(), type->fields.begin(), type->fields.end());
  check_fields(n);

  LayerSpec out;
  out.name = name(n);
  if (out.name == "input")
    fail_field(n, "name", "'input' names the model's input; a layer needs another name");
  if (auto it = c.names.find(out.name); it != c.names.end())
    fail_field(n, "name",
               fmt::format("'{}' is already the name of {} (line {})", out.name, it->second,
                           doc_.value_pos(JsonSource::child(c.name_pointers.at(out.name), "name"))
                               .line));
  if (find(n, "inputs") != nullptr) inputs(n, c);
  (this->*(type->read))(n, c, out);
  TOWERS_CHECK(numel(out.out) <= kMaxLayerFloats, "{}: output {} passed the checks", out.name,
               to_string(out.out));

  c.shape = out.out;
  c.from = fmt::format("{} '{}'", at, out.name);
  c.previous = out.name;
  c.names[out.name] = at;
  c.name_pointers[out.name] = pointer;
  return out;
}

ModelSpec Reader::read() const {
  const json& root = doc_.root();
  Node top{&root, "", "", "", kModelFields};
  if (!root.is_object())
    fail(doc_.value_pos(""), top,
         fmt::format("a model file holds one object, {{\"name\": ..., \"input\": [C, H, W], "
                     "\"classes\": ..., \"layers\": [...]}}, got {}",
                     describe(root)));
  check_fields(top);
  ModelSpec spec;
  spec.name = name(top);
  if (find(top, "description") != nullptr) spec.description = text(top, "description");
  spec.input = input(top);
  spec.classes = static_cast<int>(integer(top, "classes", 2, kMaxClasses));
  const json& layers = require(top, "layers");
  if (!layers.is_array())
    fail_field(top, "layers", fmt::format("expected an array of layers, got {}", describe(layers)));
  if (layers.empty()) fail_field(top, "layers", "a model needs at least one layer");

  Chain c;
  c.shape = spec.input;
  Node last;
  for (size_t i = 0; i < layers.size(); ++i)
    spec.layers.push_back(layer(layers, "/layers", "", i, c, &last));

  // The last layer's outputs are the logits.
  if (numel(c.shape) != spec.classes) {
    const std::string type = find(last, "type")->get<std::string>();
    std::string_view field = "type";
    for (const auto& t : layer_types())
      if (t.type == type && !t.size_field.empty()) field = t.size_field;
    fail_field(last, field,
               fmt::format("the last layer gives the logits, {} per example, but \"classes\" is {}",
                           numel(c.shape), spec.classes));
  }
  if (c.parameters == 0)
    fail_field(top, "layers", "no layer has parameters (conv2d, dense): there is nothing to train");
  spec.parameters = static_cast<int64_t>(c.parameters);
  if (find(top, "placement") != nullptr) placement(top, spec);
  return spec;
}

// Checked as --placement is, once the layers are known; its errors start at its value.
void Reader::placement(const Node& top, ModelSpec& spec) const {
  const std::string s = text(top, "placement");
  const auto control = [](char ch) { return std::iscntrl(static_cast<unsigned char>(ch)) != 0; };
  if (std::any_of(s.begin(), s.end(), control))
    fail_field(top, "placement", "a placement is one line of text: no control characters");
  spec.placement_origin =
      fmt::format("{}: field 'placement'",
                  doc_.where(doc_.value_pos(JsonSource::child(top.pointer, "placement"))));
  parse_placement(s, *build_graph(spec), spec.placement_origin);
  spec.placement = s;
}

}  // namespace

std::vector<std::string> layer_types() {
  std::vector<std::string> out;
  for (std::string_view t : type_names()) out.emplace_back(t);
  return out;
}

ModelSpec parse_model(std::string_view text, const std::string& file) {
  return Reader(JsonSource::parse(text, file)).read();
}

ModelSpec read_model_file(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  TOWERS_REQUIRE(fs::exists(status), "model file '{}': no such file", path);
  TOWERS_REQUIRE(!fs::is_directory(status), "model file '{}': is a directory, not a file", path);
  std::ifstream in(path, std::ios::binary);
  TOWERS_REQUIRE(in.is_open(), "model file '{}': cannot be opened: {}", path, std::strerror(errno));
  // One byte more than the limit tells a file at the limit from a larger one.
  std::string text(static_cast<size_t>(kMaxModelFileBytes) + 1, '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  TOWERS_REQUIRE(!in.bad(), "model file '{}': read failed: {}", path, std::strerror(errno));
  TOWERS_REQUIRE(in.gcount() <= kMaxModelFileBytes,
                 "model file '{}': larger than {} bytes; a model file is a small JSON file", path,
                 kMaxModelFileBytes);
  text.resize(static_cast<size_t>(in.gcount()));
  return parse_model(text, path);
}

namespace {
std::unique_ptr<Layer> make_layer(const LayerSpec& l) {
  if (const auto* conv = std::get_if<Conv2DConfig>(&l.config))
    return std::make_unique<Conv2D>(l.name, *conv);
  if (const auto* pool = std::get_if<MaxPoolConfig>(&l.config))
    return std::make_unique<MaxPool>(l.name, pool->kernel, pool->stride, pool->padding);
  if (const auto* lrn = std::get_if<kernels::LrnParams>(&l.config))
    return std::make_unique<Lrn>(l.name, *lrn);
  if (std::holds_alternative<GeluConfig>(l.config)) return std::make_unique<Gelu>(l.name);
  if (std::holds_alternative<ReluConfig>(l.config)) return std::make_unique<Relu>(l.name);
  if (std::holds_alternative<GlobalAvgPoolConfig>(l.config))
    return std::make_unique<GlobalAvgPool>(l.name);
  if (const auto* bn = std::get_if<BatchNormConfig>(&l.config))
    return std::make_unique<BatchNorm>(l.name, *bn);
  if (const auto* d = std::get_if<DropoutConfig>(&l.config))
    return std::make_unique<Dropout>(l.name, *d);
  if (const auto* res = std::get_if<ResidualConfig>(&l.config)) {
    std::vector<std::unique_ptr<Layer>> inner;
    for (const LayerSpec& i : res->layers) inner.push_back(make_layer(i));
    return std::make_unique<Residual>(l.name, std::move(inner));
  }
  return std::make_unique<Dense>(l.name, std::get<DenseConfig>(l.config));
}
}  // namespace

namespace {
void set_conv_algorithm(std::vector<LayerSpec>& layers, ConvAlgorithm a) {
  for (LayerSpec& l : layers) {
    if (auto* conv = std::get_if<Conv2DConfig>(&l.config)) {
      const bool fits = kernels::cpu::winograd_fits(conv->kernel, conv->stride, conv->padding);
      conv->algorithm = a == ConvAlgorithm::Winograd && !fits ? ConvAlgorithm::Im2col : a;
    }
    if (auto* res = std::get_if<ResidualConfig>(&l.config)) set_conv_algorithm(res->layers, a);
  }
}
}  // namespace

void set_conv_algorithm(ModelSpec& spec, ConvAlgorithm a) { set_conv_algorithm(spec.layers, a); }

std::unique_ptr<Graph> build_graph(const ModelSpec& spec) {
  auto g = std::make_unique<Graph>(spec.name, spec.input, spec.classes);
  for (const LayerSpec& l : spec.layers) {
    g->add_layer(make_layer(l));
    TOWERS_CHECK(g->layers().back()->out_shape() == l.out,
                 "{}: the layer gives {}, the model file {}", l.name,
                 to_string(g->layers().back()->out_shape()), to_string(l.out));
  }
  TOWERS_CHECK(g->layout().count() == spec.parameters, "{}: {} parameters, the model file {}",
               spec.name, g->layout().count(), spec.parameters);
  return g;
}

}  // namespace towers
