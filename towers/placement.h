// placement.h — model parallelism: which device runs which layers of a tower.
//
//   conv1,norm1,pool1,conv2,norm2,pool2@cpu:0;local3,local4,softmax_linear@cpu:1
//   conv1..pool2@cpu:0;local3..softmax_linear@cpu:1x2
//
// A placement is parts separated by ';', each LAYERS@DEVICE. LAYERS is a comma-separated list
// of layer names or inclusive ranges FIRST..LAST. Each part holds a run of consecutive layers
// of the model, the parts follow the model's order (part p feeds part p + 1), and together
// they hold every layer once. DEVICE is cpu:N (cpu alone is cpu:0), a oneTBB arena of its own, or
// cpu:NxT for one with T threads (otherwise the tower's threads are shared out between its parts);
// each part has a device of its own. cuda:N names a GPU: the part's parameters, activations and
// kernels live there, and activations and errors cross to and from its neighbours by copies on
// its stream. CPU device numbers name a tower's own arenas: with N towers each tower has its
// cpu:0, cpu:1, ...; cuda:N is the machine's GPU N, shared by the towers placed on it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/device.h"
#include "graph/graph.h"

namespace towers {

struct PlacedPart {
  size_t first = 0, last = 0;  // the graph's layers [first, last)
  DeviceKind kind = DeviceKind::Cpu;
  int index = 0;                    // the N of cpu:N
  int threads = 0;                  // the T of cpu:NxT; 0: a share of the tower's threads
  std::string device_name() const;  // "cpu:1"
  std::string layer_names(const Graph& g) const;  // "conv1..pool2" (or the one layer)
};

struct Placement {
  std::vector<PlacedPart> parts;
  std::string text;  // as given
};

// Parses and checks a placement against the model. Every mistake is a towers::Error that
// starts with `origin` (the flag, or the file it came from) and says what is wrong: an unknown
// layer or device, a layer placed twice or in no part, layers out of the model's order, a
// device holding two parts. Whether a cuda:N exists is checked where the tower is made.
Placement parse_placement(const std::string& text, const Graph& graph,
                          const std::string& origin = "--placement");

// Checks that `micro_batches` micro-batches of a batch of `batch` examples give the gradient of
// the whole batch bit for bit: the batch divides into them evenly, and each micro-batch is a
// power-of-two number of every layer's batch_chunk() (layers/layer.h), so that the tree sum
// over micro-batches continues the tree each layer sums over its chunks (kernels/reduce.h).
// Throws a towers::Error starting with `origin` otherwise.
void check_micro_batches(const Graph& graph, int64_t batch, int micro_batches,
                         const std::string& origin = "--micro-batches");

}  // namespace towers
