#include "params/layout.h"

#include <algorithm>

#include "core/check.h"
#include "core/rng.h"

namespace towers {

ParameterLayout::ParameterLayout(const std::vector<ParamSpec>& specs) {
  int64_t offset = 0;
  for (const ParamSpec& s : specs) {
    for (const Variable& v : vars_)
      TOWERS_CHECK(v.spec.name != s.name, "duplicate variable name '{}'", s.name);
    Variable v{s, offset, numel(s.shape)};
    vars_.push_back(v);
    offset += (v.size + 15) / 16 * 16;
  }
  total_ = offset;
}

int64_t ParameterLayout::count() const {
  int64_t n = 0;
  for (const Variable& v : vars_) n += v.size;
  return n;
}

const Variable& ParameterLayout::find(const std::string& name) const {
  for (const Variable& v : vars_)
    if (v.spec.name == name) return v;
  TOWERS_FAIL("no variable named '{}'", name);
}

std::vector<int64_t> ParameterLayout::trainable_ranges() const {
  std::vector<int64_t> r;
  for (const Variable& v : vars_) {  // in offset order, as the constructor lays them out
    if (!v.spec.trainable || v.size == 0) continue;
    r.push_back(v.offset);
    r.push_back(v.offset + v.size);
  }
  return r;
}

void ParameterLayout::initialize(float* params, uint64_t seed) const {
  std::fill(params, params + total_, 0.0f);
  for (const Variable& v : vars_) {
    float* p = params + v.offset;
    if (v.spec.init.kind == Init::Kind::Constant) {
      std::fill(p, p + v.size, v.spec.init.value);
    } else {
      Rng rng(seed, hash_string(v.spec.name));
      for (int64_t i = 0; i < v.size; ++i)
        p[i] = static_cast<float>(rng.truncated_normal(v.spec.init.value));
    }
  }
}

}  // namespace towers
