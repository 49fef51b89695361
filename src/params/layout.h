// layout.h — the one layout shared by parameters, gradients and optimizer slots:
// a flat float array with a name -> (offset, shape) table (DESIGN.md, "One step, as data").
// A broadcast is one copy, a reduction one call, a checkpoint one write.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace towers {

struct Init {
  enum class Kind { Constant, TruncatedNormal } kind = Kind::Constant;
  float value = 0.0f;  // the constant, or the stddev
  static Init constant(float v) { return {Kind::Constant, v}; }
  static Init truncated_normal(float stddev) { return {Kind::TruncatedNormal, stddev}; }
};

struct ParamSpec {
  std::string name;  // "<layer>/<variable>", e.g. "conv1/weight"
  Shape shape;       // conv weight [out, in, kh, kw]; linear weight [out, in]; bias [out]
  Init init;
  float weight_decay = 0.0f;
  // false: state a layer keeps (running statistics), not learned by the optimizer, but
  // checkpointed and pulled like a parameter. Its "gradient" is a delta the layer's backward
  // writes (weighted by the call's share of the update, BackwardArgs::state_weight), and an
  // update adds state_rate x the update's delta to it: a running average with rate state_rate
  // (0: the state is never updated).
  bool trainable = true;
  float state_rate = 0.0f;
};

struct Variable {
  ParamSpec spec;
  int64_t offset = 0;  // floats from the start of the flat array, 16-float (64-byte) aligned
  int64_t size = 0;    // numel(spec.shape)
};

class ParameterLayout {
 public:
  ParameterLayout() = default;
  explicit ParameterLayout(const std::vector<ParamSpec>& specs);

  const std::vector<Variable>& variables() const { return vars_; }
  int64_t total() const { return total_; }  // floats, padding included
  int64_t count() const;                    // parameters, padding excluded
  const Variable& find(const std::string& name) const;  // throws naming the variable
  // The trainable variables' elements as [begin, end) pairs in offset order, flattened (begin
  // of the first, end of the first, begin of the second, ...): what a gradient's norm covers
  // (kernels/norm_rules.h), without state variables and padding.
  std::vector<int64_t> trainable_ranges() const;

  // Fills params (total() floats) from each variable's initialiser; padding stays 0.
  // Draws for a variable depend only on (seed, its name), not on the other variables.
  void initialize(float* params, uint64_t seed) const;

 private:
  std::vector<Variable> vars_;
  int64_t total_ = 0;
};

}  // namespace towers
