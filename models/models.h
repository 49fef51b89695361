// models.h — model builders by name. An unknown name throws an error that lists the known ones.
//   cifar10  the TF CIFAR-10 tutorial net on 24x24x3 crops (1,068,298 parameters)
//   fashion  the same net on 28x28x1 (Fashion-MNIST); local3 is 3136 -> 384
//   mlp      784 -> 128 -> 10 on 28x28x1, for fast tests
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "graph/graph.h"

namespace towers {

std::unique_ptr<Graph> build_model(const std::string& name);
std::vector<std::string> model_names();

}  // namespace towers
