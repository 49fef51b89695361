// The host-side pieces the CUDA twins are built from, checked on the CPU (no GPU needed):
// the row-major -> column-major gemm mapping of cuda::gemm against cpu::gemm, the optimizer
// rules and the tree-sum rule the CUDA kernels run per element against the CPU updates, and
// sum_rows (the host half of cuda::softmax_xent) against cpu::softmax_xent.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include <gtest/gtest.h>

#include "core/rng.h"
#include "kernels/gemm.h"
#include "kernels/norm_rules.h"
#include "kernels/optimizer.h"
#include "kernels/optimizer_rules.h"
#include "kernels/reduce.h"
#include "kernels/reduce_rules.h"
#include "kernels/softmax_xent.h"
#include "optimizer_cases.h"

namespace towers {
namespace {

std::vector<float> randoms(int64_t n, uint64_t seed, float lo = -1.0f, float hi = 1.0f) {
  Rng rng(seed);
  std::vector<float> v(n);
  for (float& x : v) x = rng.uniform(lo, hi);
  return v;
}

// Bitwise equality of float arrays (== would equate 0 and -0 and never match NaN).
bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// ---- gemm: row-major -> column-major --------------------------------------------------------

// Reference BLAS sgemm, column-major: C = alpha op(A) op(B) + beta C, op(A) (m, k), op(B) (k, n),
// element (i, j) of a column-major X with leading dimension ld at X[i + j * ld]. Sums in double.
void colmajor_sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                    const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
                    int64_t ldc) {
  for (int64_t j = 0; j < n; ++j)
    for (int64_t i = 0; i < m; ++i) {
      double s = 0.0;
      for (int64_t p = 0; p < k; ++p) {
        const float av = trans_a ? a[p + i * lda] : a[i + p * lda];
        const float bv = trans_b ? b[j + p * ldb] : b[p + j * ldb];
        s += static_cast<double>(av) * bv;
      }
      float& cij = c[i + j * ldc];
      cij = static_cast<float>(alpha * s + static_cast<double>(beta) * cij);
    }
}

struct GemmShape {
  int64_t m, n, k;
};

TEST(GemmMapping, ColumnMajorCallReproducesRowMajorGemm) {
  constexpr float kPad = 12345.0f;      // outside the matrices; a wrong mapping reads or writes it
  constexpr int64_t kBuffer = 1 << 12;  // room for any misread of the shapes below
  const GemmShape shapes[] = {{5, 7, 3}, {1, 4, 9}, {8, 2, 6}, {13, 11, 17}};
  int cases = 0;
  for (const GemmShape& s : shapes)
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        SCOPED_TRACE(testing::Message() << "m=" << s.m << " n=" << s.n << " k=" << s.k
                                        << " trans_a=" << ta << " trans_b=" << tb);
        // Row-major storage: A is (m, k), or (k, m) when transposed; likewise B; C is (m, n).
        // Each leading dimension exceeds its minimum.
        const int64_t a_rows = ta ? s.k : s.m, a_cols = ta ? s.m : s.k;
        const int64_t b_rows = tb ? s.n : s.k, b_cols = tb ? s.k : s.n;
        const int64_t lda = a_cols + 3, ldb = b_cols + 2, ldc = s.n + 5;
        std::vector<float> a(kBuffer, kPad), b(kBuffer, kPad), c0(kBuffer, kPad);
        // Small integers: every product and partial sum is exact in float, whatever order the
        // two gemms add in, so any difference is the mapping's.
        Rng rng(100 + cases);
        auto draw = [&rng] { return static_cast<float>(static_cast<int>(rng.below(9)) - 4); };
        for (int64_t r = 0; r < a_rows; ++r)
          for (int64_t q = 0; q < a_cols; ++q) a[r * lda + q] = draw();
        for (int64_t r = 0; r < b_rows; ++r)
          for (int64_t q = 0; q < b_cols; ++q) b[r * ldb + q] = draw();
        for (int64_t r = 0; r < s.m; ++r)
          for (int64_t q = 0; q < s.n; ++q) c0[r * ldc + q] = draw();
        const float alpha = 0.75f, beta = -0.5f;

        std::vector<float> want = c0, got = c0;
        kernels::cpu::gemm(ta, tb, s.m, s.n, s.k, alpha, a.data(), lda, b.data(), ldb, beta,
                           want.data(), ldc);
        const kernels::cuda::ColMajorGemm g = kernels::cuda::row_major_as_col_major(
            ta, tb, s.m, s.n, s.k, a.data(), lda, b.data(), ldb, got.data(), ldc);
        colmajor_sgemm(g.trans_a, g.trans_b, g.m, g.n, g.k, alpha, g.a, g.lda, g.b, g.ldb, beta,
                       g.c, g.ldc);

        double worst = 0.0;
        for (int64_t r = 0; r < s.m; ++r)
          for (int64_t q = 0; q < s.n; ++q) {
            const double w = want[r * ldc + q], d = std::fabs(got[r * ldc + q] - w);
            worst = std::max(worst, d / std::max(std::fabs(w), 1.0));
          }
        EXPECT_LT(worst, 1e-5);  // in fact 0: the arithmetic is exact
        // Nothing outside C (its padding included) was written.
        for (int64_t i = 0; i < kBuffer; ++i)
          if (i >= s.m * ldc || i % ldc >= s.n) ASSERT_EQ(got[i], kPad) << "written at " << i;
        ++cases;
      }
  EXPECT_EQ(cases, 16);
}

TEST(GemmMapping, SwapsOperandsAndSizesKeepsEachOperandsTranspose) {
  float a = 0, b = 0, c = 0;
  auto g = kernels::cuda::row_major_as_col_major(true, false, 2, 3, 4, &a, 10, &b, 20, &c, 30);
  EXPECT_EQ(g.trans_a, false);  // cuBLAS's A is our B, with B's flag
  EXPECT_EQ(g.trans_b, true);
  EXPECT_EQ(g.m, 3);
  EXPECT_EQ(g.n, 2);
  EXPECT_EQ(g.k, 4);
  EXPECT_EQ(g.a, &b);
  EXPECT_EQ(g.lda, 20);
  EXPECT_EQ(g.b, &a);
  EXPECT_EQ(g.ldb, 10);
  EXPECT_EQ(g.c, &c);
  EXPECT_EQ(g.ldc, 30);
}

// ---- optimizer rules --------------------------------------------------------------------------

// The state of one slice: parameters, up to two slots, a gradient. Slots are positive so that
// Adagrad's and RMSProp's square roots are of positive numbers, as in training.
struct OptSlice {
  static constexpr int64_t kN = 1037;
  std::vector<float> w = randoms(kN, 1, -2, 2);
  std::vector<float> s1 = randoms(kN, 2, 0.05f, 1.5f);
  std::vector<float> s2 = randoms(kN, 3, 0.05f, 1.5f);
  std::vector<float> g = randoms(kN, 4, -3, 3);
};

// Each rule's CPU loop against its formulas called element by element, written out here
// (not through Rule<R>), for 3 steps: the same bits.
TEST(OptimizerRules, EveryCpuUpdateIsItsFormulaElementWise) {
  for (const cases::RuleCase& c : cases::rule_cases()) {
    SCOPED_TRACE(c.name);
    OptSlice cpu, rule;
    const kernels::RuleArgs& a = c.args;
    for (int step = 0; step < 3; ++step) {
      kernels::cpu::optimizer_update(OptSlice::kN, cpu.w.data(), cpu.s1.data(), cpu.s2.data(),
                                     cpu.g.data(), a);
      for (int64_t i = 0; i < OptSlice::kN; ++i) {
        float &w = rule.w[i], &s1 = rule.s1[i], &s2 = rule.s2[i];
        const float g = rule.g[i];
        switch (a.rule) {
          case kernels::OptRule::Sgd: kernels::sgd_rule(w, g, a.lr, a.wd); break;
          case kernels::OptRule::Momentum:
            kernels::momentum_rule(w, s1, g, a.lr, a.mu, a.nesterov, a.wd);
            break;
          case kernels::OptRule::Adagrad: kernels::adagrad_rule(w, s1, g, a.lr, a.wd); break;
          case kernels::OptRule::Adam:
            kernels::adam_rule(w, s1, s2, g, a.lr, a.b1, a.b2, a.eps, a.wd);
            break;
          case kernels::OptRule::Rmsprop:
            kernels::rmsprop_rule(w, s1, s2, g, a.lr, a.rho, a.mu, a.eps, a.wd);
            break;
        }
      }
    }
    EXPECT_TRUE(same_bits(cpu.w, rule.w));
    EXPECT_TRUE(same_bits(cpu.s1, rule.s1));
    EXPECT_TRUE(same_bits(cpu.s2, rule.s2));  // slots a rule does not have stay as they were
  }
}

// A rule reads only its own slots: null for the others is fine.
TEST(OptimizerRules, RulesWithFewerSlotsTakeNullForTheRest) {
  for (const cases::RuleCase& c : cases::rule_cases()) {
    SCOPED_TRACE(c.name);
    OptSlice with, without;
    kernels::cpu::optimizer_update(OptSlice::kN, with.w.data(), with.s1.data(), with.s2.data(),
                                   with.g.data(), c.args);
    kernels::cpu::optimizer_update(OptSlice::kN, without.w.data(),
                                   c.slots >= 1 ? without.s1.data() : nullptr,
                                   c.slots >= 2 ? without.s2.data() : nullptr,
                                   without.g.data(), c.args);
    EXPECT_TRUE(same_bits(with.w, without.w));
  }
}

// ---- tree sum -----------------------------------------------------------------------------------

// count blocks of n floats whose magnitudes span several binades, so that a different order of
// additions gives different bits.
std::vector<std::vector<float>> tree_blocks(int64_t count, int64_t n, uint64_t seed) {
  Rng rng(seed);
  std::vector<std::vector<float>> blocks(count, std::vector<float>(n));
  for (auto& b : blocks)
    for (float& x : b) x = rng.uniform(-1, 1) * std::ldexp(1.0f, static_cast<int>(rng.below(20)));
  return blocks;
}

std::vector<float*> pointers(std::vector<std::vector<float>>& blocks) {
  std::vector<float*> p;
  for (auto& b : blocks) p.push_back(b.data());
  return p;
}

TEST(ReduceRules, TreeSumRuleEqualsCpuTreeSumBitwise) {
  const int64_t n = 301;
  for (int64_t count = 1; count <= 9; ++count) {
    SCOPED_TRACE(testing::Message() << "count=" << count);
    auto cpu = tree_blocks(count, n, 40 + count), rule = cpu;
    auto cp = pointers(cpu), rp = pointers(rule);
    kernels::cpu::tree_sum(cp.data(), count, 0, n);
    float* const* rblocks = rp.data();
    for (int64_t j = 0; j < n; ++j) kernels::tree_sum_rule(rblocks, count, j);
    for (int64_t i = 0; i < count; ++i)  // the sum and the scratch blocks alike
      EXPECT_TRUE(same_bits(cpu[i], rule[i])) << "block " << i;
  }
}

TEST(ReduceRules, TreeIsPairwiseNotSequential) {
  // count 4: (b0 + b1) + (b2 + b3). With these values a left-to-right sum would give 1.
  std::vector<std::vector<float>> blocks = {{1e8f}, {1.0f}, {-1e8f}, {1.0f}};
  auto p = pointers(blocks);
  kernels::tree_sum_rule(p.data(), 4, 0);
  EXPECT_EQ(blocks[0][0], (1e8f + 1.0f) + (-1e8f + 1.0f));
  EXPECT_EQ(blocks[0][0], 0.0f);  // both pairs round to +-1e8, so the tree gives exactly 0
  std::vector<std::vector<float>> three = {{1.0f}, {2.0f}, {4.0f}};
  auto q = pointers(three);
  kernels::tree_sum_rule(q.data(), 3, 0);
  EXPECT_EQ(three[0][0], 7.0f);
}

// ---- the gradient norm's order (norm_rules.h) -----------------------------------------------

// Kept ranges that start and end mid-row, one shorter than a row, one across a chunk's end, and
// gaps between them; the last chunk is short and ends mid-row.
std::vector<int64_t> norm_keep() {
  using kernels::kNormChunk;
  return {3, 700, 701, 702, 1000, kNormChunk + 4000, kNormChunk + 4016, 2 * kNormChunk + 77,
          2 * kNormChunk + 300, 2 * kNormChunk + 555};
}

// Wide magnitudes, so that the order of the additions shows in the last bits.
std::vector<float> norm_values(int64_t n, uint64_t seed) {
  std::vector<float> x = randoms(n, seed);
  Rng rng(seed + 1);
  for (float& v : x) v *= std::ldexp(1.0f, static_cast<int>(rng.uniform(-20.0f, 20.0f)));
  return x;
}

TEST(NormRules, TheHostWalkOfAChunkIsItsLanesBitwise) {
  using namespace kernels;
  const int64_t n = 2 * kNormChunk + 555;
  const std::vector<float> x = norm_values(n, 71);
  const std::vector<int64_t> keep = norm_keep();
  const std::vector<int64_t> all = {0, n};
  for (int64_t k = 0; k < norm_chunks(n); ++k) {
    const int64_t b = k * kNormChunk, e = std::min(n, b + kNormChunk);
    for (const auto* ranges : {&keep, &all}) {
      const int64_t nr = static_cast<int64_t>(ranges->size() / 2);
      std::vector<double> lanes(kNormLanes);
      for (int l = 0; l < kNormLanes; ++l) lanes[l] = norm_lane(x.data(), b, e, l, ranges->data(), nr);
      const double by_lanes = norm_lanes_total(lanes.data());
      const double walked = norm_chunk(x.data(), b, e, ranges->data(), nr);
      EXPECT_EQ(std::memcmp(&by_lanes, &walked, sizeof(double)), 0)
          << "chunk " << k << ": " << by_lanes << " vs " << walked;
      EXPECT_GT(walked, 0.0);
    }
  }
  EXPECT_EQ(norm_chunk(x.data(), 0, kNormChunk, nullptr, 0), 0.0);
  EXPECT_EQ(norm_lane(x.data(), 0, kNormChunk, 5, keep.data(), 0), 0.0);
}

// The order is a summation order and nothing else: the kept elements' sum of squares, to
// double rounding, and the elements outside the ranges (here NaN) are never read.
TEST(NormRules, TheNormSumsTheSquaresOfTheKeptElementsOnly) {
  using namespace kernels;
  const int64_t n = 2 * kNormChunk + 555;
  std::vector<float> x = norm_values(n, 72);
  const std::vector<int64_t> keep = norm_keep();
  long double want = 0.0L;
  std::vector<bool> kept(n, false);
  for (size_t r = 0; r < keep.size(); r += 2)
    for (int64_t j = keep[r]; j < keep[r + 1]; ++j) {
      kept[j] = true;
      want += static_cast<long double>(x[j]) * x[j];
    }
  for (int64_t j = 0; j < n; ++j)
    if (!kept[j]) x[j] = std::nanf("");
  const int64_t nkeep = static_cast<int64_t>(keep.size() / 2);
  double lanes_way = 0.0, walk_way = 0.0;
  for (int64_t k = 0; k < norm_chunks(n); ++k) {
    const int64_t b = k * kNormChunk, e = std::min(n, b + kNormChunk);
    std::vector<double> lanes(kNormLanes);
    for (int l = 0; l < kNormLanes; ++l) lanes[l] = norm_lane(x.data(), b, e, l, keep.data(), nkeep);
    lanes_way += norm_lanes_total(lanes.data());
    walk_way += norm_chunk(x.data(), b, e, keep.data(), nkeep);
  }
  EXPECT_NEAR(lanes_way, static_cast<double>(want), 1e-12 * static_cast<double>(want));
  EXPECT_NEAR(walk_way, static_cast<double>(want), 1e-12 * static_cast<double>(want));
}

TEST(NormRules, TheClipScaleIsTheBoundOverTheNormAboveTheBoundOnly) {
  using kernels::norm_clip_scale;
  EXPECT_EQ(norm_clip_scale(4.0, 1.0), 0.25f);
  EXPECT_EQ(norm_clip_scale(3.0, 1.0), static_cast<float>(1.0 / 3.0));
  EXPECT_EQ(norm_clip_scale(1.0, 1.0), 1.0f);  // at the bound: not clipped
  EXPECT_EQ(norm_clip_scale(0.5, 1.0), 1.0f);
  EXPECT_EQ(norm_clip_scale(4.0, 0.0), 1.0f);  // no bound
  EXPECT_EQ(norm_clip_scale(std::nan(""), 1.0), 1.0f);  // not finite: skipped, not clipped
  EXPECT_EQ(norm_clip_scale(INFINITY, 1.0), 1.0f);
}

// ---- softmax cross-entropy: the host sums ----------------------------------------------------

TEST(XentRows, SumRowsOfPerExampleResultsEqualsTheBatchResultBitwise) {
  // Wide logits: per-example losses from ~1e-8 to ~40, so the order of the additions shows in
  // the last bits of the sum.
  const int64_t n = 257, k = 10;
  const std::vector<float> logits = randoms(n * k, 9, -20, 20);
  Rng rng(10);
  std::vector<int32_t> labels(n);
  for (auto& y : labels) y = static_cast<int32_t>(rng.below(k));
  // Per-example results with the CPU twin's arithmetic, as cuda::softmax_xent leaves them.
  std::vector<double> row_loss(n);
  std::vector<int32_t> row_correct(n);
  for (int64_t b = 0; b < n; ++b) {
    auto r =
        kernels::cpu::softmax_xent(1, k, logits.data() + b * k, labels.data() + b, 0.0f, 0.0f, nullptr);
    row_loss[b] = r.loss_sum;
    row_correct[b] = static_cast<int32_t>(r.correct);
  }
  const auto want = kernels::cpu::softmax_xent(n, k, logits.data(), labels.data(), 0.0f, 0.0f, nullptr);
  const auto got = kernels::sum_rows(n, row_loss.data(), row_correct.data());
  EXPECT_EQ(got.loss_sum, want.loss_sum);  // bitwise: the same additions in the same order
  EXPECT_EQ(got.correct, want.correct);
  EXPECT_GT(want.correct, 0);
}

TEST(XentRows, EmptyBatchIsZero) {
  const auto r = kernels::sum_rows(0, nullptr, nullptr);
  EXPECT_EQ(r.loss_sum, 0.0);
  EXPECT_EQ(r.correct, 0);
}

}  // namespace
}  // namespace towers
