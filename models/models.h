// models.h — models by name or by file. A built-in name is one of the model files of models/
// (compiled into the library: models/builtin_models.h); a value that ends in ".json" or
// contains a '/' is the path of a user's model file (models/model_file.h has the format).
//   cifar10  the TF CIFAR-10 tutorial net on 24x24x3 crops (1,068,298 parameters)
//   fashion  the same net on 28x28x1 (Fashion-MNIST); local3 is 3136 -> 384
//   mlp      784 -> 128 -> 10 on 28x28x1, for fast tests
// An unknown name throws an error that lists the known ones.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "graph/graph.h"
#include "models/model_file.h"

namespace towers {

std::unique_ptr<Graph> build_model(const std::string& name_or_path);
// The checked model file behind a name or path, with what a graph does not hold (its
// "placement"); build_graph(read_model(m)) is build_model(m).
ModelSpec read_model(const std::string& name_or_path);
// The built-in names, from the compiled-in model files.
std::vector<std::string> model_names();
// Whether --model's value names a file rather than a built-in model.
bool is_model_path(const std::string& name_or_path);

}  // namespace towers
