// messages.h — the layout as the protocol carries it (towers.proto's VariableSpec), both ways.
#pragma once

#include <string>
#include <vector>

#include "params/layout.h"
#include "towers/remote/towers.pb.h"

namespace towers::remote {

inline std::vector<ParamSpec> param_specs(
    const google::protobuf::RepeatedPtrField<VariableSpec>& variables) {
  std::vector<ParamSpec> specs;
  for (const VariableSpec& v : variables) {
    ParamSpec p;
    p.name = v.name();
    p.shape.assign(v.shape().begin(), v.shape().end());
    p.weight_decay = v.weight_decay();
    p.trainable = v.trainable();
    p.state_rate = v.state_rate();
    specs.push_back(std::move(p));
  }
  return specs;
}

inline void add_variables(const ParameterLayout& layout,
                          google::protobuf::RepeatedPtrField<VariableSpec>* out) {
  for (const Variable& v : layout.variables()) {
    VariableSpec* s = out->Add();
    s->set_name(v.spec.name);
    for (int64_t d : v.spec.shape) s->add_shape(d);
    s->set_weight_decay(v.spec.weight_decay);
    s->set_trainable(v.spec.trainable);
    s->set_state_rate(v.spec.state_rate);
  }
}

}  // namespace towers::remote
