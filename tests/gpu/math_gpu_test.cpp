// The CUDA twins of softmax_xent, standardize, the optimizer updates, tree_sum and scale against
// their CPU twins on fresh random inputs. Skips, with the reason, where no CUDA device is usable.
//
// Where the training step calls them (the tests below hold each to its CPU twin; a test of a
// kernel that no step calls says so):
//   - softmax_xent: every GPU tower's loss and its gradient;
//   - the optimizer updates (optimizer_update, optimizer_update_spans_at): the update of
//     --params mirrored (towers/mirrored_store.cpp); with host parameters the host applies it;
//   - tree_sum: the sync sum of several towers on one GPU with mirrored parameters, a residual
//     block's two branches (src/layers/residual.cpp), a placed tower's micro-batches;
//   - standardize: --input device (kernels/cuda/augment.cu); host input standardizes on the host;
//   - scale_at and norm_guard: the guard of a mirrored update (--clip-grad-norm,
//     --on-divergence skip-step);
//   - scale (a scalar from the host): no training step calls it; it is kept for callers that
//     average with a factor known on the host.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "core/check.h"
#include "core/cuda_check.h"
#include "core/rng.h"
#include "gpu_test_util.h"  // TOWERS_SKIP_WITHOUT_GPU, DeviceArray, random_floats, max_rel_error
#include "kernels/optimizer.h"
#include "optimizer_cases.h"
#include "kernels/norm_rules.h"
#include "kernels/reduce.h"
#include "kernels/softmax_xent.h"
#include "kernels/standardize.h"

namespace towers {
namespace {

using gputest::DeviceArray;
using gputest::max_rel_error;
using gputest::random_floats;

class Stream {
 public:
  Stream() { CUDA_CHECK(cudaStreamCreate(&s_)); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  ~Stream() { cudaStreamDestroy(s_); }
  operator cudaStream_t() const { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// ---- softmax cross-entropy ---------------------------------------------------------------------

TEST(SoftmaxXentGpu, MatchesCpuTwinIncludingLossAndCorrectThroughSumRows) {
  TOWERS_SKIP_WITHOUT_GPU();
  Stream s;
  const int64_t n = 1000, k = 10;
  const std::vector<float> logits = random_floats(n * k, 21, -8.0f, 8.0f);
  Rng rng(22);
  std::vector<int32_t> labels(n);
  for (auto& y : labels) y = static_cast<int32_t>(rng.below(k));
  const float grad_scale = 1.0f / n, smoothing = 0.1f;  // label smoothing on, as training has it

  std::vector<float> d_cpu(n * k);
  const auto want = kernels::cpu::softmax_xent(n, k, logits.data(), labels.data(), smoothing,
                                               grad_scale, d_cpu.data());

  DeviceArray<float> logits_d(logits), d_d(n * k);
  DeviceArray<int32_t> labels_d(labels), correct_d(n);
  DeviceArray<double> loss_d(n);
  kernels::cuda::softmax_xent(s, n, k, logits_d.get(), labels_d.get(), smoothing, grad_scale,
                              d_d.get(), loss_d.get(), correct_d.get());
  const std::vector<double> row_loss = loss_d.download();
  const std::vector<int32_t> row_correct = correct_d.download();
  const auto got = kernels::sum_rows(n, row_loss.data(), row_correct.data());

  // The same double arithmetic; only exp and log may differ from glibc's by an ulp or so, and
  // every row loss is a sum of two non-negative terms (no cancellation): 1e-12 relative, plus
  // an absolute 4e-16 for a row whose label is far ahead, where the loss is log(1 + e) for a
  // tiny e and one ulp of exp in 1 + e is all of its value that survives.
  EXPECT_EQ(got.correct, want.correct);
  EXPECT_NEAR(got.loss_sum, want.loss_sum, 1e-12 * want.loss_sum + 4e-16 * n);
  for (int64_t b = 0; b < n; ++b) {
    const auto row = kernels::cpu::softmax_xent(1, k, logits.data() + b * k, labels.data() + b,
                                                smoothing, grad_scale, nullptr);
    ASSERT_NEAR(row_loss[b], row.loss_sum, 1e-12 * row.loss_sum + 4e-16) << "example " << b;
    ASSERT_EQ(row_correct[b], row.correct) << "example " << b;
  }
  EXPECT_LT(max_rel_error(d_d.download(), d_cpu), 1e-5);
}

TEST(SoftmaxXentGpu, EvaluationWithoutGradient) {
  TOWERS_SKIP_WITHOUT_GPU();
  Stream s;
  const int64_t n = 77, k = 3;
  const std::vector<float> logits = random_floats(n * k, 23, -3.0f, 3.0f);
  std::vector<int32_t> labels(n);
  for (int64_t b = 0; b < n; ++b) labels[b] = static_cast<int32_t>(b % k);
  const auto want =
      kernels::cpu::softmax_xent(n, k, logits.data(), labels.data(), 0.0f, 1.0f, nullptr);
  DeviceArray<float> logits_d(logits);
  DeviceArray<int32_t> labels_d(labels), correct_d(n);
  DeviceArray<double> loss_d(n);
  kernels::cuda::softmax_xent(s, n, k, logits_d.get(), labels_d.get(), 0.0f, 1.0f, nullptr,
                              loss_d.get(), correct_d.get());
  const std::vector<double> row_loss = loss_d.download();
  const std::vector<int32_t> row_correct = correct_d.download();
  const auto got = kernels::sum_rows(n, row_loss.data(), row_correct.data());
  EXPECT_EQ(got.correct, want.correct);
  EXPECT_NEAR(got.loss_sum, want.loss_sum, 1e-12 * want.loss_sum);
}

// ---- per-image standardization -----------------------------------------------------------------

// Images of the cifar10 crop (24x24x3) with pixel values 0..255, one constant image (the stddev
// floor), and a size that is not a multiple of the block. Standardized values have unit scale,
// so they are compared relative to max(|want|, 1). The sums are in double in another order than
// the CPU's; after rounding to float the mean and the scale almost always agree exactly.
TEST(StandardizeGpu, MatchesCpuTwinOutOfPlaceAndInPlace) {
  TOWERS_SKIP_WITHOUT_GPU();
  Stream s;
  for (int64_t m : {int64_t{24 * 24 * 3}, int64_t{1000}, int64_t{5}}) {
    SCOPED_TRACE(testing::Message() << "m=" << m);
    const int64_t n = 37;
    std::vector<float> x = random_floats(n * m, 31 + m, 0.0f, 255.0f);
    for (int64_t i = 0; i < m; ++i) x[3 * m + i] = 17.0f;  // a constant image
    std::vector<float> want(n * m);
    kernels::cpu::standardize(n, m, x.data(), want.data());

    DeviceArray<float> x_d(x), y_d(n * m);
    kernels::cuda::standardize(s, n, m, x_d.get(), y_d.get());
    const std::vector<float> out_of_place = y_d.download();
    EXPECT_LT(max_rel_error(out_of_place, want, 1.0), 1e-5);
    for (int64_t i = 0; i < m; ++i) EXPECT_EQ(out_of_place[3 * m + i], 0.0f);
    EXPECT_TRUE(same_bits(x_d.download(), x));  // the input is left alone

    kernels::cuda::standardize(s, n, m, x_d.get(), x_d.get());
    EXPECT_TRUE(same_bits(x_d.download(), out_of_place));  // in place gives the same bits
  }
}

// ---- optimizer updates -------------------------------------------------------------------------

// Both twins run the rules of kernels/optimizer_rules.h, both built without FMA contraction,
// and the device's sqrtf and division round as IEEE requires (nvcc's defaults): the updates
// must agree bitwise (decision 25).
struct OptState {
  static constexpr int64_t kN = (1 << 20) + 13;
  std::vector<float> w = random_floats(kN, 41, -2.0f, 2.0f);
  std::vector<float> s1 = random_floats(kN, 42, 0.05f, 1.5f);  // positive: accumulators
  std::vector<float> s2 = random_floats(kN, 43, 0.05f, 1.5f);
  std::vector<float> g = random_floats(kN, 44, -3.0f, 3.0f);
};

constexpr int kSteps = 3;

struct OptDevice {
  explicit OptDevice(const OptState& h) : w(h.w), s1(h.s1), s2(h.s2), g(h.g) {}
  DeviceArray<float> w, s1, s2, g;
};

TEST(OptimizerGpu, EveryRuleMatchesItsCpuTwinBitwise) {
  TOWERS_SKIP_WITHOUT_GPU();
  Stream s;
  for (const cases::RuleCase& c : cases::rule_cases()) {
    SCOPED_TRACE(c.name);
    OptState h;
    OptDevice d(h);
    for (int step = 0; step < kSteps; ++step) {
      kernels::cpu::optimizer_update(OptState::kN, h.w.data(), h.s1.data(), h.s2.data(),
                                     h.g.data(), c.args);
      kernels::cuda::optimizer_update(s, OptState::kN, d.w.get(),
                                      c.slots >= 1 ? d.s1.get() : nullptr,
                                      c.slots >= 2 ? d.s2.get() : nullptr, d.g.get(), c.args);
    }
    EXPECT_TRUE(same_bits(d.w.download(), h.w));
    if (c.slots >= 1) EXPECT_TRUE(same_bits(d.s1.download(), h.s1));
    if (c.slots >= 2) EXPECT_TRUE(same_bits(d.s2.download(), h.s2));
  }
}

// The step's update (optimizer_update_spans_at): 20 variables with gaps between them (two
// launches of at most 16), each with its own weight decay, against the CPU twin variable by
// variable; the gaps stay as they were, and a set skip flag leaves everything untouched.
TEST(OptimizerGpu, SpansUpdateMatchesItsCpuTwinBitwise) {
  TOWERS_SKIP_WITHOUT_GPU();
  Stream s;
  constexpr int kVars = 20;
  std::vector<int64_t> offset, size;
  int64_t at = 3;
  for (int k = 0; k < kVars; ++k) {
    const int64_t n = k == 5 ? 0 : 1 + (k * 7919) % 3001;  // one empty variable
    offset.push_back(at);
    size.push_back(n);
    at += n + (k % 3);  // gaps of 0, 1 and 2 elements
  }
  const int64_t total = at + 4;
  for (const cases::RuleCase& c : cases::rule_cases()) {
    SCOPED_TRACE(c.name);
    std::vector<kernels::RuleArgs> args(kVars, c.args);
    for (int k = 0; k < kVars; ++k) args[k].wd = 0.001f * static_cast<float>(k % 4);
    std::vector<float> w = random_floats(total, 51, -2.0f, 2.0f);
    std::vector<float> s1 = random_floats(total, 52, 0.05f, 1.5f);
    std::vector<float> s2 = random_floats(total, 53, 0.05f, 1.5f);
    const std::vector<float> g = random_floats(total, 54, -3.0f, 3.0f);
    DeviceArray<float> w_d(w), s1_d(s1), s2_d(s2), g_d(g);
    DeviceArray<kernels::RuleArgs> args_d(args);
    for (int32_t skip : {1, 0}) {
      DeviceArray<int32_t> skip_d(std::vector<int32_t>{skip});
      kernels::cuda::optimizer_update_spans_at(
          s, kVars, offset.data(), size.data(), w_d.get(), c.slots >= 1 ? s1_d.get() : nullptr,
          c.slots >= 2 ? s2_d.get() : nullptr, g_d.get(), c.args.rule, args_d.get(), skip_d.get());
    }
    for (int k = 0; k < kVars; ++k)
      kernels::cpu::optimizer_update(size[k], w.data() + offset[k], s1.data() + offset[k],
                                     s2.data() + offset[k], g.data() + offset[k], args[k]);
    EXPECT_TRUE(same_bits(w_d.download(), w));
    if (c.slots >= 1) EXPECT_TRUE(same_bits(s1_d.download(), s1));
    if (c.slots >= 2) EXPECT_TRUE(same_bits(s2_d.download(), s2));
  }
}

// ---- tree sum and scale ------------------------------------------------------------------------

// Blocks whose magnitudes span several binades, so that another order of additions would show.
std::vector<std::vector<float>> tree_blocks(int64_t count, int64_t n, uint64_t seed) {
  Rng rng(seed);
  std::vector<std::vector<float>> blocks(count, std::vector<float>(n));
  for (auto& b : blocks)
    for (float& x : b) x = rng.uniform(-1, 1) * std::ldexp(1.0f, static_cast<int>(rng.below(20)));
  return blocks;
}

TEST(TreeSumGpu, BitwiseEqualToCpuTwin) {
  TOWERS_SKIP_WITHOUT_GPU();
  Stream s;
  const int64_t n = 100003;
  for (int64_t count : {1, 2, 3, 4, 5, 6, 7, 8, kernels::cuda::kMaxTreeBlocks}) {
    SCOPED_TRACE(testing::Message() << "count=" << count);
    auto host = tree_blocks(count, count > 8 ? 1000 : n, 50 + count);
    const int64_t len = static_cast<int64_t>(host[0].size());
    std::vector<std::unique_ptr<DeviceArray<float>>> dev;
    std::vector<float*> dev_ptrs, host_ptrs;
    for (auto& b : host) {
      dev.push_back(std::make_unique<DeviceArray<float>>(b));
      dev_ptrs.push_back(dev.back()->get());
      host_ptrs.push_back(b.data());
    }
    kernels::cpu::tree_sum(host_ptrs.data(), count, 0, len);
    kernels::cuda::tree_sum(s, dev_ptrs.data(), count, len);
    for (int64_t i = 0; i < count; ++i)  // the sum and the scratch blocks alike
      EXPECT_TRUE(same_bits(dev[i]->download(), host[i])) << "block " << i;
  }
}

TEST(TreeSumGpu, TooManyBlocksIsAnError) {
  std::vector<float*> ptrs(kernels::cuda::kMaxTreeBlocks + 1, nullptr);
  EXPECT_THROW(kernels::cuda::tree_sum(nullptr, ptrs.data(), static_cast<int64_t>(ptrs.size()), 8),
               InternalError);
}

// scale() is called by no training step (the mirrored guard uses scale_at, tested with
// norm_guard below); a pass here says nothing about training.
TEST(ScaleGpu, BitwiseEqualToHostMultiply) {
  TOWERS_SKIP_WITHOUT_GPU();
  Stream s;
  const int64_t n = (1 << 20) + 5;
  for (float alpha : {0.25f, 1.0f / 3.0f}) {
    std::vector<float> x = random_floats(n, 61, -100.0f, 100.0f);
    DeviceArray<float> x_d(x);
    kernels::cuda::scale(s, n, alpha, x_d.get());
    for (float& v : x) v *= alpha;  // one IEEE multiply either side
    EXPECT_TRUE(same_bits(x_d.download(), x)) << "alpha " << alpha;
  }
}

// The update's guard on the device (--clip-grad-norm, --on-divergence skip-step) against the
// host's norm of the same kept ranges (norm_rules.h), then the clip it makes.
TEST(NormGuardGpu, TheNormIsTheHostsBitwiseAndTheClipScalesTheKeptRanges) {
  TOWERS_SKIP_WITHOUT_GPU();
  using kernels::kNormChunk;
  Stream s;
  const int64_t n = 3 * kNormChunk + 77;
  std::vector<float> x = random_floats(n, 81, -3.0f, 3.0f);
  const std::vector<int64_t> keep = {5, 1000, 1003, kNormChunk + 9, 2 * kNormChunk, n - 1};
  const int64_t nkeep = static_cast<int64_t>(keep.size() / 2);
  for (int64_t j = 1000; j < 1003; ++j) x[j] = std::nanf("");  // outside the ranges: never read
  double host = 0.0;
  for (int64_t k = 0; k < kernels::norm_chunks(n); ++k)
    host += kernels::norm_chunk(x.data(), k * kNormChunk, std::min(n, (k + 1) * kNormChunk),
                                keep.data(), nkeep);
  host = std::sqrt(host);
  ASSERT_TRUE(std::isfinite(host));
  DeviceArray<float> x_d(x);
  DeviceArray<int64_t> keep_d(keep);
  DeviceArray<double> partials(kernels::norm_chunks(n)), norm(1);
  DeviceArray<float> scale(1);
  DeviceArray<int32_t> flag(std::vector<int32_t>{7});  // a finite norm leaves it as it is
  const double bound = host / 4;
  kernels::cuda::norm_guard(s, n, x_d.get(), keep_d.get(), nkeep, bound, partials.get(),
                            norm.get(), scale.get(), flag.get());
  const double got = norm.download()[0];
  EXPECT_EQ(std::memcmp(&got, &host, sizeof(double)), 0) << got << " vs " << host;
  const float want_scale = kernels::norm_clip_scale(host, bound);
  EXPECT_EQ(scale.download()[0], want_scale);
  EXPECT_LT(want_scale, 0.5f);
  EXPECT_EQ(flag.download()[0], 7);
  // The clip, read from the device's scale: one IEEE multiply, as the host's.
  kernels::cuda::scale_at(s, keep[1] - keep[0], scale.get(), x_d.get() + keep[0]);
  const std::vector<float> clipped = x_d.download();
  for (int64_t j = keep[0]; j < keep[1]; ++j) ASSERT_EQ(clipped[j], x[j] * want_scale) << j;
  EXPECT_EQ(std::memcmp(clipped.data(), x.data(), sizeof(float) * keep[0]), 0);
  // A kept element that is not finite: the norm is not, the flag is set, nothing is clipped.
  x[kNormChunk + 3] = std::numeric_limits<float>::infinity();
  x_d.upload(x);
  flag.upload({0});
  kernels::cuda::norm_guard(s, n, x_d.get(), keep_d.get(), nkeep, bound, partials.get(),
                            norm.get(), scale.get(), flag.get());
  EXPECT_FALSE(std::isfinite(norm.download()[0]));
  EXPECT_EQ(scale.download()[0], 1.0f);
  EXPECT_EQ(flag.download()[0], 1);
}

// Zero sizes return before any launch: host-side only, runs wherever CUDA is built.
TEST(MathGpu, ZeroSizesLaunchNothing) {
  EXPECT_NO_THROW(kernels::cuda::softmax_xent(nullptr, 0, 10, nullptr, nullptr, 0.0f, 1.0f,
                                              nullptr, nullptr, nullptr));
  EXPECT_NO_THROW(kernels::cuda::standardize(nullptr, 0, 10, nullptr, nullptr));
  for (const cases::RuleCase& c : cases::rule_cases())
    EXPECT_NO_THROW(
        kernels::cuda::optimizer_update(nullptr, 0, nullptr, nullptr, nullptr, nullptr, c.args));
  EXPECT_NO_THROW(kernels::cuda::tree_sum(nullptr, nullptr, 0, 10));
  EXPECT_NO_THROW(kernels::cuda::scale(nullptr, 0, 2.0f, nullptr));
}

}  // namespace
}  // namespace towers
