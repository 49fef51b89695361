#include "models/models.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/check.h"
#include "models/builtin_models.h"
#include "models/model_file.h"

namespace towers {

std::vector<std::string> model_names() {
  std::vector<std::string> names;
  for (const BuiltinModel& m : builtin_models()) names.emplace_back(m.name);
  return names;
}

bool is_model_path(const std::string& name_or_path) {
  return name_or_path.ends_with(".json") || name_or_path.find('/') != std::string::npos;
}

std::unique_ptr<Graph> build_model(const std::string& name_or_path) {
  return build_graph(read_model(name_or_path));
}

ModelSpec read_model(const std::string& name_or_path) {
  if (is_model_path(name_or_path)) return read_model_file(name_or_path);
  for (const BuiltinModel& m : builtin_models())
    if (m.name == name_or_path) return parse_model(m.text, std::string(m.file));
  TOWERS_BAD_INPUT("unknown model '{}' (known: {}; or a model file: a path ending in .json)",
                   name_or_path, fmt::join(model_names(), ", "));
}

}  // namespace towers
