// batchnorm.h — batch normalization over the channels of (n, C, HW) activations, CPU and CUDA
// twins (the CUDA twin takes its stream first). The per-channel rules are in
// kernels/batchnorm_rules.h: every channel's sums are taken in kBnLanes strided lanes in double
// and the lanes summed in order, by the CPU loop and by the CUDA kernels (a thread per lane),
// which the emulator runs as host loops, so the twins agree bitwise (their files are built
// without FMA contraction).
//
// Training normalizes with the batch's statistics (mean and biased variance over n x HW, in
// double), which the forward also writes out for its backward; evaluation with the running
// ones. Backward takes the forward's statistics and writes, besides dx, dgamma and dbeta, the
// deltas of the running
// statistics: state_weight x (batch mean - running mean) and state_weight x (unbiased batch
// variance - running variance). The optimizer adds state_rate x their average over the update
// (ParamSpec::state_rate), so the running averages follow the towers' batches through any
// parameter store.
#pragma once

#include <cstdint>

#include "kernels/hd.h"

namespace towers::kernels {

// The lanes of a channel's sums (kernels/batchnorm_rules.h).
inline constexpr int kBnLanes = 256;

struct BnShape {
  int64_t n = 0;   // examples
  int64_t c = 0;   // channels
  int64_t hw = 1;  // positions per channel and example
  double eps = 1e-5;
};

// The state a training backward writes, per channel (device or host pointers, as the call).
struct BnGrads {
  float* dx = nullptr;  // (n, C, HW); null: not wanted (the first layer)
  float* dgamma = nullptr;
  float* dbeta = nullptr;
  float* dmean = nullptr;  // running-statistics deltas, scaled by state_weight
  float* dvar = nullptr;
  float state_weight = 1.0f;
};

namespace cpu {
// Channels [c0, c1) of each call: a caller may split the channels between threads.
//   y, and the batch mean and biased variance per channel (mean[ch], var[ch]) for the backward
void batchnorm_forward_train(const BnShape& s, int64_t c0, int64_t c1, const float* x,
                             const float* gamma, const float* beta, float* y, double* mean,
                             double* var);
void batchnorm_forward_eval(const BnShape& s, int64_t c0, int64_t c1, const float* x,
                            const float* gamma, const float* beta, const float* mean,
                            const float* var, float* y);
//   from the forward's batch statistics
void batchnorm_backward(const BnShape& s, int64_t c0, int64_t c1, const float* x, const float* dy,
                        const float* gamma, const double* mean, const double* var,
                        const float* running_mean, const float* running_var, const BnGrads& g);

// The pieces of a training step whose statistics are those of a global batch spread over
// towers (--sync-bn): each tower takes its channel sums over its own examples (the lanes of
// the rules), the towers add them (TowerExchange), and each normalizes and differentiates its
// own examples with the global statistics. m is the global batch's elements per channel
// (examples x HW).
//   out[ch] = sum of x, or (center non-null) of (x - center[ch])^2, over channel ch
void batchnorm_channel_sums(const BnShape& s, int64_t c0, int64_t c1, const float* x,
                            const double* center, double* out);
//   y with the given mean and biased variance
void batchnorm_forward_with(const BnShape& s, int64_t c0, int64_t c1, const float* x,
                            const float* gamma, const float* beta, const double* mean,
                            const double* var, float* y);
//   sdy[ch] = sum of dy, sdyx[ch] = sum of dy x xhat over channel ch
void batchnorm_backward_sums(const BnShape& s, int64_t c0, int64_t c1, const float* x,
                             const float* dy, const double* mean, const double* var,
                             double* sdy, double* sdyx);
//   dx from the global sums; dgamma and dbeta from the tower's own (its share of the global
//   gradient); the state deltas from the global statistics (weighted by g.state_weight)
void batchnorm_backward_with(const BnShape& s, int64_t c0, int64_t c1, double m, const float* x,
                             const float* dy, const float* gamma, const double* mean,
                             const double* var, const double* sdy, const double* sdyx,
                             const double* own_sdy, const double* own_sdyx,
                             const float* running_mean, const float* running_var,
                             const BnGrads& g);
}  // namespace cpu

namespace cuda {
// Each sum is one thread per lane of every channel (C x kBnLanes threads, each walking its
// lane's elements in order), then one thread per channel adding its lanes in order; the
// normalization and dx are one thread per element, with each channel's 1 / sqrt(var + eps)
// taken once. `work` is device scratch of batchnorm_work_doubles(C) doubles (the lane sums and
// the per-channel sums), used only while the call's kernels run on the stream. The batch
// statistics (mean, var: C doubles each) are device memory the caller keeps from the forward
// to its backward.
constexpr int64_t batchnorm_work_doubles(int64_t c) { return c * (2 * int64_t{kBnLanes} + 3); }
void batchnorm_forward_train(CUstream_st* stream, const BnShape& s, const float* x,
                             const float* gamma, const float* beta, float* y, double* mean,
                             double* var, double* work);
void batchnorm_forward_eval(CUstream_st* stream, const BnShape& s, const float* x,
                            const float* gamma, const float* beta, const float* mean,
                            const float* var, float* y, double* work);
void batchnorm_backward(CUstream_st* stream, const BnShape& s, const float* x, const float* dy,
                        const float* gamma, const double* mean, const double* var,
                        const float* running_mean, const float* running_var, const BnGrads& g,
                        double* work);

// The --sync-bn pieces, every channel at once, with the statistics and sums (double) in device
// memory; the same lanes and rules as the CPU pieces above, so that a GPU tower's sync-bn step
// is bitwise a CPU tower's wherever their inputs are. work: as above.
void batchnorm_channel_sums(CUstream_st* stream, const BnShape& s, const float* x,
                            const double* center, double* out, double* work);
void batchnorm_forward_with(CUstream_st* stream, const BnShape& s, const float* x,
                            const float* gamma, const float* beta, const double* mean,
                            const double* var, float* y, double* work);
void batchnorm_backward_sums(CUstream_st* stream, const BnShape& s, const float* x, const float* dy,
                             const double* mean, const double* var, double* sdy, double* sdyx,
                             double* work);
void batchnorm_backward_with(CUstream_st* stream, const BnShape& s, double m, const float* x,
                             const float* dy, const float* gamma, const double* mean,
                             const double* var, const double* sdy, const double* sdyx,
                             const double* own_sdy, const double* own_sdyx,
                             const float* running_mean, const float* running_var, const BnGrads& g,
                             double* work);
}  // namespace cuda

}  // namespace towers::kernels
