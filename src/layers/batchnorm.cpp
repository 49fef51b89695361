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
// the examples' count with the first. Fills mean and (biased) var; returns the global batch's
// elements per channel.
template <class Sums>
double exchange_moments(const kernels::BnShape& s, TowerExchange& ex, std::vector<double>& mean,
                        std::vector<double>& var, Sums sums) {
  const int64_t c = s.c;
  mean.assign(c + 1, 0.0);
  sums(nullptr, mean.data());
  mean[c] = static_cast<double>(s.n);  // the global batch's examples, summed with the rest
  ex.sum(mean.data(), c + 1);
  const double m = mean[c] * static_cast<double>(s.hw);
  mean.resize(c);
  for (double& v : mean) v /= m;
  var.assign(c, 0.0);
  sums(mean.data(), var.data());
  ex.sum(var.data(), c);
  for (double& v : var) v /= m;
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
// per channel; returns the global batch's elements per channel.
double BatchNorm::global_moments(const kernels::BnShape& s, const float* x, TowerExchange& ex,
                                 std::vector<double>& mean, std::vector<double>& var) const {
  return exchange_moments(s, ex, mean, var, [&](const double* center, double* out) {
    for_chunks(c_, kChannelsPerTask, [&](int64_t, int64_t c0, int64_t c1) {
      kernels::cpu::batchnorm_channel_sums(s, c0, c1, x, center, out);
    });
  });
}

void BatchNorm::forward(const ForwardArgs& a) const {
  const kernels::BnShape s{a.n, c_, hw_, cfg_.eps};
  if (a.training && a.exchange != nullptr) {
    std::vector<double> mean, var;
    global_moments(s, a.x, *a.exchange, mean, var);
    for_chunks(c_, kChannelsPerTask, [&](int64_t, int64_t c0, int64_t c1) {
      kernels::cpu::batchnorm_forward_with(s, c0, c1, a.x, a.params[kGamma], a.params[kBeta],
                                           mean.data(), var.data(), a.y);
    });
    return;
  }
  for_chunks(c_, kChannelsPerTask, [&](int64_t, int64_t c0, int64_t c1) {
    if (a.training)
      kernels::cpu::batchnorm_forward_train(s, c0, c1, a.x, a.params[kGamma], a.params[kBeta], a.y);
    else
      kernels::cpu::batchnorm_forward_eval(s, c0, c1, a.x, a.params[kGamma], a.params[kBeta],
                                           a.params[kMean], a.params[kVar], a.y);
  });
}

void BatchNorm::backward(const BackwardArgs& a) const {
  const kernels::BnShape s{a.n, c_, hw_, cfg_.eps};
  const kernels::BnGrads g = bn_grads(a);
  if (a.exchange != nullptr) {
    // The forward's global statistics again (nothing is saved), then the global sums of dy
    // and dy x xhat; this tower's own sums are its share of dgamma and dbeta.
    std::vector<double> mean, var;
    const double m = global_moments(s, a.x, *a.exchange, mean, var);
    std::vector<double> own(2 * c_), sums;
    for_chunks(c_, kChannelsPerTask, [&](int64_t, int64_t c0, int64_t c1) {
      kernels::cpu::batchnorm_backward_sums(s, c0, c1, a.x, a.dy, mean.data(), var.data(),
                                            own.data(), own.data() + c_);
    });
    sums = own;
    a.exchange->sum(sums.data(), 2 * c_);
    for_chunks(c_, kChannelsPerTask, [&](int64_t, int64_t c0, int64_t c1) {
      kernels::cpu::batchnorm_backward_with(s, c0, c1, m, a.x, a.dy, a.params[kGamma], mean.data(),
                                            var.data(), sums.data(), sums.data() + c_, own.data(),
                                            own.data() + c_, a.params[kMean], a.params[kVar], g);
    });
    return;
  }
  for_chunks(c_, kChannelsPerTask, [&](int64_t, int64_t c0, int64_t c1) {
    kernels::cpu::batchnorm_backward(s, c0, c1, a.x, a.dy, a.params[kGamma], a.params[kMean],
                                     a.params[kVar], g);
  });
}

#if TOWERS_HAVE_CUDA
// ---- the GPU twin ----------------------------------------------------------------------------
namespace kc = kernels::cuda;

namespace {
// The call's device doubles in its scratch (8-byte aligned): for --sync-bn the global mean and
// variance, the tower's own sums of dy and dy x xhat, and the global ones (c each); then the
// kernels' work (kernels::cuda::batchnorm_work_doubles).
struct BnDevice {
  double *mean, *var, *own_sdy, *own_sdyx, *sdy, *sdyx, *work;
};
BnDevice bn_device(const GpuExec& e, int64_t c, const std::string& who) {
  float* f = gpu_scratch_at(e, 0, BatchNorm::gpu_scratch_floats(c), who);
  auto* d = reinterpret_cast<double*>((reinterpret_cast<uintptr_t>(f) + 7) & ~uintptr_t{7});
  return {d, d + c, d + 2 * c, d + 3 * c, d + 4 * c, d + 5 * c, d + 6 * c};
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
// device and copied out for the exchange; the statistics end in d.mean and d.var.
double global_moments_gpu(const GpuExec& e, const kernels::BnShape& s, const float* x,
                          TowerExchange& ex, const BnDevice& d) {
  std::vector<double> mean, var;
  const double m = exchange_moments(s, ex, mean, var, [&](const double* center, double* out) {
    if (center != nullptr) to_device(e, d.mean, center, s.c);
    double* sums = center != nullptr ? d.var : d.mean;
    kc::batchnorm_channel_sums(e.stream, s, x, center != nullptr ? d.mean : nullptr, sums, d.work);
    to_host(e, out, sums, s.c);
  });
  to_device(e, d.var, var.data(), s.c);
  return m;
}

}  // namespace

int64_t BatchNorm::gpu_scratch(int64_t) const { return gpu_scratch_floats(c_); }

void BatchNorm::forward_gpu(const GpuExec& e, const ForwardArgs& a) const {
  const kernels::BnShape s{a.n, c_, hw_, cfg_.eps};
  const BnDevice d = bn_device(e, c_, name());
  if (a.training && a.exchange != nullptr) {
    global_moments_gpu(e, s, a.x, *a.exchange, d);
    kc::batchnorm_forward_with(e.stream, s, a.x, a.params[kGamma], a.params[kBeta], d.mean, d.var,
                               a.y, d.work);
    return;
  }
  if (a.training)
    kc::batchnorm_forward_train(e.stream, s, a.x, a.params[kGamma], a.params[kBeta], a.y, d.work);
  else
    kc::batchnorm_forward_eval(e.stream, s, a.x, a.params[kGamma], a.params[kBeta], a.params[kMean],
                               a.params[kVar], a.y, d.work);
}

void BatchNorm::backward_gpu(const GpuExec& e, const BackwardArgs& a) const {
  const kernels::BnShape s{a.n, c_, hw_, cfg_.eps};
  const BnDevice d = bn_device(e, c_, name());
  if (a.exchange != nullptr) {
    // As the CPU path: the global statistics again, the tower's own sums of dy and dy x xhat
    // (its share of dgamma and dbeta), and their global totals.
    const double m = global_moments_gpu(e, s, a.x, *a.exchange, d);
    kc::batchnorm_backward_sums(e.stream, s, a.x, a.dy, d.mean, d.var, d.own_sdy, d.own_sdyx,
                                d.work);
    std::vector<double> sums(2 * c_);
    to_host(e, sums.data(), d.own_sdy, 2 * c_);  // own_sdy and own_sdyx are adjacent
    a.exchange->sum(sums.data(), 2 * c_);
    to_device(e, d.sdy, sums.data(), 2 * c_);
    kc::batchnorm_backward_with(e.stream, s, m, a.x, a.dy, a.params[kGamma], d.mean, d.var, d.sdy,
                                d.sdyx, d.own_sdy, d.own_sdyx, a.params[kMean], a.params[kVar],
                                bn_grads(a), d.work);
    return;
  }
  kc::batchnorm_backward(e.stream, s, a.x, a.dy, a.params[kGamma], a.params[kMean], a.params[kVar],
                         bn_grads(a), d.work);
}
#endif  // TOWERS_HAVE_CUDA

}  // namespace towers
