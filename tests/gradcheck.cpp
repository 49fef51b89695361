#include "gradcheck.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "core/rng.h"

namespace towers::testing {

std::vector<int64_t> sample_indices(int64_t n, int64_t count, uint64_t seed) {
  std::vector<int64_t> idx;
  if (n <= count) {
    for (int64_t i = 0; i < n; ++i) idx.push_back(i);
    return idx;
  }
  Rng rng(seed, 17);
  for (int64_t i = 0; i < count; ++i) idx.push_back(static_cast<int64_t>(rng.below(n)));
  return idx;
}

GradCheckResult check_gradient(const std::function<double()>& loss, float* x,
                               const float* analytic, const std::vector<int64_t>& indices,
                               const std::string& label, float eps, double atol, double rtol) {
  GradCheckResult r;
  const double l0 = loss();
  for (int64_t i : indices) {
    const float orig = x[i];
    x[i] = orig + eps;
    const double lp = loss();
    x[i] = orig - eps;
    const double lm = loss();
    x[i] = orig;
    // The actual step in float may differ from eps; use the representable distances.
    const double hp = static_cast<double>(orig + eps) - orig;
    const double hm = orig - static_cast<double>(orig - eps);
    const double fwd = (lp - l0) / hp, bwd = (l0 - lm) / hm;
    const double num = (lp - lm) / (hp + hm);
    const double scale = std::max({std::fabs(fwd), std::fabs(bwd), 1e-3});
    if (std::fabs(fwd - bwd) > 0.1 * scale + 10 * atol) {
      ++r.skipped_kinks;
      continue;
    }
    ++r.checked;
    const double a = analytic[i];
    const double err = std::fabs(a - num) / (atol + rtol * std::max(std::fabs(a), std::fabs(num)));
    if (!(err <= r.max_error)) {  // a NaN anywhere is the worst error
      r.max_error = std::isnan(err) ? INFINITY : err;
      r.worst = fmt::format("{}[{}]: analytic {:.6g} numeric {:.6g}", label, i, a, num);
    }
  }
  return r;
}

std::vector<GradCheckResult> check_layer(const Layer& layer, int64_t n, uint64_t seed,
                                         int64_t samples) {
  const int64_t in_sz = n * numel(layer.in_shape()), out_sz = n * numel(layer.out_shape());
  Rng rng(seed);
  std::vector<float> x(in_sz), r(out_sz), y(out_sz), saved(n * layer.saved_per_example() + 1);
  for (float& v : x) v = rng.uniform(-1.0f, 1.0f);
  for (float& v : r) v = rng.uniform(-1.0f, 1.0f);
  const auto specs = layer.params();
  std::vector<std::vector<float>> vars, grads;
  for (const ParamSpec& s : specs) {
    std::vector<float> v(numel(s.shape));
    for (float& e : v) e = rng.uniform(-0.5f, 0.5f);
    vars.push_back(v);
    grads.emplace_back(v.size());
  }
  auto run_forward = [&] {
    ForwardArgs a;
    a.n = n;
    a.x = x.data();
    a.y = y.data();
    a.w = vars.size() > 0 ? vars[0].data() : nullptr;
    a.b = vars.size() > 1 ? vars[1].data() : nullptr;
    a.saved = saved.data();
    layer.forward(a);
  };
  auto loss = [&] {
    run_forward();
    double s = 0.0;
    for (int64_t i = 0; i < out_sz; ++i) s += static_cast<double>(y[i]) * r[i];
    return s;
  };
  run_forward();
  // backward must overwrite its outputs: start them as NaN so accumulation would show.
  std::vector<float> dx(in_sz, NAN);
  for (auto& g : grads) std::fill(g.begin(), g.end(), NAN);
  BackwardArgs b;
  b.n = n;
  b.x = x.data();
  b.y = y.data();
  b.dy = r.data();
  b.dx = dx.data();
  b.w = vars.size() > 0 ? vars[0].data() : nullptr;
  b.b = vars.size() > 1 ? vars[1].data() : nullptr;
  b.dw = grads.size() > 0 ? grads[0].data() : nullptr;
  b.db = grads.size() > 1 ? grads[1].data() : nullptr;
  b.saved = saved.data();
  layer.backward(b);

  std::vector<GradCheckResult> out;
  out.push_back(check_gradient(loss, x.data(), dx.data(), sample_indices(in_sz, samples, seed),
                               layer.name() + "/input"));
  for (size_t v = 0; v < vars.size(); ++v)
    out.push_back(check_gradient(loss, vars[v].data(), grads[v].data(),
                                 sample_indices(vars[v].size(), samples, seed + v + 1),
                                 specs[v].name));
  return out;
}

}  // namespace towers::testing
