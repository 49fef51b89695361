// builtin_models.h — the model files of models/*.json, compiled into the library as text, so
// that `--model cifar10` works wherever the binary is carried. CMakeLists.txt generates the
// definition (builtin_models.cpp in the build tree) from the files; edit the JSON files.
#pragma once

#include <span>
#include <string_view>

namespace towers {

struct BuiltinModel {
  std::string_view name;  // the file's stem: "cifar10"
  std::string_view file;  // "models/cifar10.json", as errors name it
  std::string_view text;  // the file's contents
};

// In file-name order.
std::span<const BuiltinModel> builtin_models();

}  // namespace towers
