#include "layers/batchnorm.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "core/check.h"
#include "core/gpu.h"
#include "core/parallel.h"
#include "kernels/batchnorm.h"

#if TOWERS_HAVE_CUDA
#include <cuda_runtime.h>

#include "core/cuda_check.h"
#endif

namespace towers {

namespace {
// Channels per CPU task: each channel is one thread's in-order sums, so any split is exact.
constexpr int64_t kChannelsPerTask = 4;

// The host's part of --sync-bn's global statistics, for the CPU and GPU paths alike (so
// theirs agree bitwise): sums(center, out) writes this tower's s.c channel sums of x (center
// null) or of (x - center)^2 to host memory out; the exchange adds the towers' in tower order,
// the examples' count with the first. Fills mean and (biased) var, s.c each, in host memory.
template <class Sums>
void exchange_moments(const kernels::BnShape& s, TowerExchange& ex, double* mean, double* var,
                      Sums sums) {
  const int64_t c = s.c;
  std::vector<double> t(c + 1, 0.0);
  sums(nullptr, t.data());
  t[c] = static_cast<double>(s.n);  // the global batch's examples, summed with the rest
  ex.sum(t.data(), c + 1);
  const double m = t[c] * static_cast<double>(s.hw);
  for (int64_t ch = 0; ch < c; ++ch) mean[ch] = t[ch] / m;
  for (int64_t ch = 0; ch < c; ++ch) var[ch] = 0.0;
  sums(mean, var);
  ex.sum(var, c);
  for (int64_t ch = 0; ch < c; ++ch) var[ch] /= m;
}

// --sync-bn's backward sums: this tower's sums of dy and dy x xhat (own, 2c: its share of
// dgamma and dbeta) added over the towers into sums (2c), with the examples' count; returns
// the global batch's elements per channel.
double exchange_backward_sums(const kernels::BnShape& s, TowerExchange& ex, const double* own,
                              std::vector<double>& sums) {
  sums.assign(own, own + 2 * s.c);
  sums.push_back(static_cast<double>(s.n));
  ex.sum(sums.data(), 2 * s.c + 1);
  const double m = sums.back() * static_cast<double>(s.hw);
  sums.pop_back();
  return m;
}

kernels::BnGrads bn_grads(const BackwardArgs& a) {
  kernels::BnGrads g;
  g.dx = a.dx;
  g.dgamma = a.grads[BatchNorm::kGamma];
  g.dbeta = a.grads[BatchNorm::kBeta];
  g.dmean = a.grads[BatchNorm::kMean];
  g.dvar = a.grads[BatchNorm::kVar];
  g.state_weight = a.state_weight;
  return g;
}
}  // namespace

Shape BatchNorm::infer(const Shape& in) {
  TOWERS_CHECK((in.size() == 1 || in.size() == 3) && numel(in) > 0,
               "{}: batchnorm needs (C) or (C, H, W), got {}", name(), to_string(in));
  TOWERS_CHECK(cfg_.momentum >= 0.0 && cfg_.momentum < 1.0,
               "{}: batchnorm momentum must be in [0, 1), got {}", name(), cfg_.momentum);
  TOWERS_CHECK(cfg_.eps > 0.0 && std::isfinite(cfg_.eps), "{}: batchnorm epsilon must be > 0, got {}",
               name(), cfg_.eps);
  c_ = in[0];
  hw_ = in.size() == 3 ? in[1] * in[2] : 1;
  return in;
}

std::vector<ParamSpec> BatchNorm::params() const {
  const float rate = static_cast<float>(1.0 - cfg_.momentum);
  ParamSpec gamma{name() + "/gamma", {c_}, Init::constant(1.0f), cfg_.weight_decay};
  ParamSpec beta{name() + "/beta", {c_}, Init::constant(0.0f), cfg_.weight_decay};
  ParamSpec mean{name() + "/moving_mean", {c_}, Init::constant(0.0f), 0.0f};
  ParamSpec var{name() + "/moving_variance", {c_}, Init::constant(1.0f), 0.0f};
  mean.trainable = var.trainable = false;
  mean.state_rate = var.state_rate = rate;
  return {gamma, beta, mean, var};
}

// --sync-bn: the statistics of the global batch, from every tower's channel sums (two passes,
// as one tower takes them: the mean, then the squares about it) into mean and (biased) var
// per channel.
void BatchNorm::global_moments(const kernels::BnShape& s, const float* x, TowerExchange& ex,
                               double* mean, double* var) const {
  exchange_moments(s, ex, mean, var, [&](const double* center, double* out) {
    for_chunks(c_, kChannelsPerTask, [&](int64_t, int64_t c0, int64_t c1) {
      kernels::cpu::batchnorm_channel_sums(s, c0, c1, x, center, out);
    });
  });
}

double* BatchNorm::stats(float* saved, int64_t n) const {
  TOWERS_CHECK(saved != nullptr, "{}: a training call needs its saved buffer", name());
  return reinterpret_cast<double*>(call_saved(saved, n));
}

const double* BatchNorm::stats(const float* saved, int64_t n) const {
  TOWERS_CHECK(saved != nullptr, "{}: a training call needs its saved buffer", name());
  return reinterpret_cast<const double*>(call_saved(saved, n));
}

void BatchNorm::forward(const ForwardArgs& a) const {
  const kernels::BnShape s{a.n, c_, hw_, cfg_.eps};
  if (!a.training) {
    for_chunks(c_, kChannelsPerTask, [&](int64_t, int64_t c0, int64_t c1) {
      kernels::cpu::batchnorm_forward_eval(s, c0, c1, a.x, a.params[kGamma], a.params[kBeta],
                                           a.params[kMean], a.params[kVar], a.y);
    });
    return;
  }
  double* mean = stats(a.saved, a.n);
  double* var = mean + c_;
  if (a.exchange != nullptr) {
    global_moments(s, a.x, *a.exchange, mean, var);
    for_chunks(c_, kChannelsPerTask, [&](int64_t, int64_t c0, int64_t c1) {
      kernels::cpu::batchnorm_forward_with(s, c0, c1, a.x, a.params[kGamma], a.params[kBeta], mean,
                                           var, a.y);
    });
    return;
  }
  for_chunks(c_, kChannelsPerTask, [&](int64_t, int64_t c0, int64_t c1) {
    kernels::cpu::batchnorm_forward_train(s, c0, c1, a.x, a.params[kGamma], a.params[kBeta], a.y,
                                          mean, var);
  });
}

void BatchNorm::backward(const BackwardArgs& a) const {
  const kernels::BnShape s{a.n, c_, hw_, cfg_.eps};
  const kernels::BnGrads g = bn_grads(a);
  const double* mean = stats(a.saved, a.n);
  const double* var = mean + c_;
  if (a.exchange != nullptr) {
    // The forward's global statistics, then the global sums of dy and dy x xhat; this tower's
    // own sums are its share of dgamma and dbeta.
    std::vector<double> own(2 * c_), sums;
    for_chunks(c_, kChannelsPerTask, [&](int64_t, int64_t c0, int64_t c1) {
      kernels::cpu::batchnorm_backward_sums(s, c0, c1, a.x, a.dy, mean, var, own.data(),
                                            own.data() + c_);
    });
    const double m = exchange_backward_sums(s, *a.exchange, own.data(), sums);
    for_chunks(c_, kChannelsPerTask, [&](int64_t, int64_t c0, int64_t c1) {
      kernels::cpu::batchnorm_backward_with(s, c0, c1, m, a.x, a.dy, a.params[kGamma], mean, var,
                                            sums.data(), sums.data() + c_, own.data(),
                                            own.data() + c_, a.params[kMean], a.params[kVar], g);
    });
    return;
  }
  for_chunks(c_, kChannelsPerTask, [&](int64_t, int64_t c0, int64_t c1) {
    kernels::cpu::batchnorm_backward(s, c0, c1, a.x, a.dy, a.params[kGamma], mean, var,
                                     a.params[kMean], a.params[kVar], g);
  });
}

#if TOWERS_HAVE_CUDA
// ---- the GPU twin ----------------------------------------------------------------------------
namespace kc = kernels::cuda;

namespace {
// The call's device doubles in its scratch (8-byte aligned): for --sync-bn the tower's own
// sums of dy and dy x xhat, and the global ones (c each); then the kernels' work
// (kernels::cuda::batchnorm_work_doubles).
struct BnDevice {
  double *own_sdy, *own_sdyx, *sdy, *sdyx, *work;
};
BnDevice bn_device(const GpuExec& e, int64_t c, const std::string& who) {
  float* f = gpu_scratch_at(e, 0, BatchNorm::gpu_scratch_floats(c), who);
  auto* d = reinterpret_cast<double*>((reinterpret_cast<uintptr_t>(f) + 7) & ~uintptr_t{7});
  return {d, d + c, d + 2 * c, d + 3 * c, d + 4 * c};
}

// Device doubles to the host, on the call's stream, and waited for: the host adds them with
// the other towers' next.
void to_host(const GpuExec& e, double* host, const double* dev, int64_t count) {
  CUDA_CHECK(cudaMemcpyAsync(host, dev, sizeof(double) * count, cudaMemcpyDeviceToHost, e.stream));
  CUDA_CHECK(cudaStreamSynchronize(e.stream));
}
// Host doubles to the device, on the call's stream (taken from pageable memory before the
// call returns, so the vector may go).
void to_device(const GpuExec& e, double* dev, const double* host, int64_t count) {
  CUDA_CHECK(cudaMemcpyAsync(dev, host, sizeof(double) * count, cudaMemcpyHostToDevice, e.stream));
}
// --sync-bn on a GPU tower: BatchNorm::global_moments with the channel sums taken on the
// device (into mean and var, c device doubles each, where the statistics end) and copied out
// for the exchange.
void global_moments_gpu(const GpuExec& e, const kernels::BnShape& s, const float* x,
                        TowerExchange& ex, double* mean, double* var, double* work) {
  std::vector<double> host(2 * s.c);
  exchange_moments(s, ex, host.data(), host.data() + s.c, [&](const double* center, double* out) {
    if (center != nullptr) to_device(e, mean, center, s.c);
    double* sums = center != nullptr ? var : mean;
    kc::batchnorm_channel_sums(e.stream, s, x, center != nullptr ? mean : nullptr, sums, work);
    to_host(e, out, sums, s.c);
  });
  to_device(e, var, host.data() + s.c, s.c);
}

}  // namespace

int64_t BatchNorm::gpu_scratch(int64_t) const { return gpu_scratch_floats(c_); }

void BatchNorm::forward_gpu(const GpuExec& e, const ForwardArgs& a) const {
  const kernels::BnShape s{a.n, c_, hw_, cfg_.eps};
  const BnDevice d = bn_device(e, c_, name());
  if (!a.training) {
    kc::batchnorm_forward_eval(e.stream, s, a.x, a.params[kGamma], a.params[kBeta], a.params[kMean],
                               a.params[kVar], a.y, d.work);
    return;
  }
  double* mean = stats(a.saved, a.n);
  double* var = mean + c_;
  if (a.exchange != nullptr) {
    global_moments_gpu(e, s, a.x, *a.exchange, mean, var, d.work);
    kc::batchnorm_forward_with(e.stream, s, a.x, a.params[kGamma], a.params[kBeta], mean, var, a.y,
                               d.work);
    return;
  }
  kc::batchnorm_forward_train(e.stream, s, a.x, a.params[kGamma], a.params[kBeta], a.y, mean, var,
                              d.work);
}

void BatchNorm::backward_gpu(const GpuExec& e, const BackwardArgs& a) const {
  const kernels::BnShape s{a.n, c_, hw_, cfg_.eps};
  const BnDevice d = bn_device(e, c_, name());
  const double* mean = stats(a.saved, a.n);
  const double* var = mean + c_;
  if (a.exchange != nullptr) {
    // As the CPU path: the forward's global statistics, the tower's own sums of dy and
    // dy x xhat (its share of dgamma and dbeta), and their global totals.
    kc::batchnorm_backward_sums(e.stream, s, a.x, a.dy, mean, var, d.own_sdy, d.own_sdyx, d.work);
    std::vector<double> own(2 * c_), sums;
    to_host(e, own.data(), d.own_sdy, 2 * c_);  // own_sdy and own_sdyx are adjacent
    const double m = exchange_backward_sums(s, *a.exchange, own.data(), sums);
    to_device(e, d.sdy, sums.data(), 2 * c_);  // sdy and sdyx are adjacent
    kc::batchnorm_backward_with(e.stream, s, m, a.x, a.dy, a.params[kGamma], mean, var, d.sdy,
                                d.sdyx, d.own_sdy, d.own_sdyx, a.params[kMean], a.params[kVar],
                                bn_grads(a), d.work);
    return;
  }
  kc::batchnorm_backward(e.stream, s, a.x, a.dy, a.params[kGamma], mean, var, a.params[kMean],
                         a.params[kVar], bn_grads(a), d.work);
}
#endif  // TOWERS_HAVE_CUDA

}  // namespace towers
