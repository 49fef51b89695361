#include "graph/graph.h"

#include <fmt/format.h>

#include "core/check.h"

namespace towers {

void Graph::append(std::unique_ptr<Layer> layer) {
  for (const auto& l : layers_)
    TOWERS_CHECK(l->name() != layer->name(), "duplicate layer name '{}'", layer->name());
  layer->bind(layers_.empty() ? input_ : layers_.back()->out_shape());
  layers_.push_back(std::move(layer));
  std::vector<ParamSpec> specs;
  for (const auto& l : layers_)
    for (ParamSpec& s : l->params()) specs.push_back(std::move(s));
  layout_ = ParameterLayout(specs);
}

int64_t Graph::flops_per_example() const {
  int64_t f = 0;
  for (const auto& l : layers_) f += l->flops_per_example();
  return f;
}

std::string Graph::summary() const {
  std::string s = fmt::format("{:<16}{:<10}{:<18}{:>12}\n", "layer", "kind", "output", "params");
  for (const auto& l : layers_) {
    int64_t p = 0;
    for (const ParamSpec& spec : l->params()) p += numel(spec.shape);
    s += fmt::format("{:<16}{:<10}{:<18}{:>12}\n", l->name(), l->kind(), to_string(l->out_shape()), p);
  }
  s += fmt::format("total parameters: {}\n", layout_.count());
  return s;
}

}  // namespace towers
