// model_file.h — a model as a small JSON file: its input shape, classes, and layers with their
// shapes, initialisers and weight decay (README, "Model files", has the format).
//   ModelSpec spec = read_model_file("nets/small.json");   every field checked, shapes inferred
//   std::unique_ptr<Graph> g = build_graph(spec);
// A file with an error gives one towers::Error that names the file, the line and column, the
// layer (index and name) and the field:
//   nets/small.json:12:17: layers[3] 'conv2' (conv2d): field 'kernel': a 9x9 kernel does not
//   fit the 6x6 input with padding "valid"
// Models are chains: each layer takes the previous layer's output (a residual block is one
// layer holding an inner chain, layers/residual.h). The optional per-layer field "inputs"
// names the previous layer. The optional
// top-level field "placement" puts each tower's layers on devices, in --placement's syntax
// (towers/placement.h); it is checked against the layers as --placement is, and a run uses it
// unless --placement says otherwise.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "graph/graph.h"
#include "kernels/conv.h"
#include "kernels/lrn.h"
#include "layers/batchnorm.h"
#include "layers/conv2d.h"
#include "layers/dense.h"
#include "layers/dropout.h"

namespace towers {

struct MaxPoolConfig {
  int64_t kernel = 0, stride = 0;
  kernels::Padding padding = kernels::Padding::Same;
};

// The layers without fields besides name, type and inputs.
struct GeluConfig {};
struct ReluConfig {};
struct GlobalAvgPoolConfig {};

struct LayerSpec;
// A residual block's inner layers (y = x + f(x)).
struct ResidualConfig {
  std::vector<LayerSpec> layers;
};

// One layer of a model file, checked, with its output shape (per example).
struct LayerSpec {
  std::string name;
  std::variant<Conv2DConfig, MaxPoolConfig, kernels::LrnParams, DenseConfig, GeluConfig,
               GlobalAvgPoolConfig, BatchNormConfig, ReluConfig, ResidualConfig, DropoutConfig>
      config;
  Shape out;
};

struct ModelSpec {
  std::string name, description;
  Shape input;  // (C, H, W)
  int classes = 0;
  std::vector<LayerSpec> layers;
  int64_t parameters = 0;
  // "placement", checked (none in the built-in models), and how an error about it begins:
  // "<file>:<line>:<column>: field 'placement'", the place of its value.
  std::optional<std::string> placement;
  std::string placement_origin;
};

// Limits a model file is held to, so that a file cannot ask for more memory than a small CNN
// trainer has: its size, its parameters, and the floats per example of one layer's output or
// of a convolution's im2col matrix.
inline constexpr int64_t kMaxModelFileBytes = int64_t{1} << 20;
inline constexpr int64_t kMaxModelParameters = int64_t{1} << 28;
inline constexpr int64_t kMaxLayerFloats = int64_t{1} << 28;

// Checks a model file's text; `file` is the name errors give it.
ModelSpec parse_model(std::string_view text, const std::string& file);
// Reads the file at path (at most kMaxModelFileBytes) and parses it.
ModelSpec read_model_file(const std::string& path);
// The graph of a checked model.
std::unique_ptr<Graph> build_graph(const ModelSpec& spec);
// Sets every convolution's CPU algorithm (--conv), residual blocks' included; Winograd goes to
// the layers it can compute (3x3 or 5x5, stride 1, SAME), the others get im2col.
void set_conv_algorithm(ModelSpec& spec, ConvAlgorithm a);
// The layer types a model file may use ("conv2d", ...).
std::vector<std::string> layer_types();

}  // namespace towers
