// Divisor<int32_t> (kernels/divisor.h), the multiply-and-shift division of the kernels' 32-bit
// index arithmetic, against plain division: every divisor the kernels meet in practice, the
// divisors around each power of two, the largest ones, and for each the numerators where a
// wrong multiplier would show first (next to multiples of d, and at the top of the range).
#include <algorithm>
#include <cstdint>
#include <vector>

#include <gtest/gtest.h>

#include "core/rng.h"
#include "kernels/divisor.h"

namespace towers {
namespace {

using kernels::cuda::Divisor;

constexpr int64_t kTop = (int64_t{1} << 31) - 1;  // the largest numerator allowed

// The numerators checked for divisor d: 0 .. 4d, the values next to multiples of d at the top
// of the range, around every power of two, and random ones.
std::vector<int32_t> numerators(int64_t d, Rng& rng) {
  std::vector<int32_t> n;
  for (int64_t i = 0; i <= 4 * d && i <= kTop && i < 4096; ++i) n.push_back(static_cast<int32_t>(i));
  for (int64_t k = kTop / d - 3; k <= kTop / d; ++k)
    for (int64_t delta : {-1, 0, 1}) {
      const int64_t v = k * d + delta;
      if (v >= 0 && v <= kTop) n.push_back(static_cast<int32_t>(v));
    }
  for (int b = 0; b <= 31; ++b)
    for (int64_t delta : {-1, 0, 1}) {
      const int64_t v = (int64_t{1} << b) + delta;
      if (v >= 0 && v <= kTop) n.push_back(static_cast<int32_t>(v));
    }
  for (int i = 0; i < 64; ++i) n.push_back(static_cast<int32_t>(rng.below(uint64_t{1} << 31)));
  return n;
}

::testing::AssertionResult divides(int64_t d, Rng& rng) {
  const Divisor<int32_t> div(static_cast<int32_t>(d));
  if (div.value() != d) return ::testing::AssertionFailure() << "value() of " << d;
  for (int32_t n : numerators(d, rng)) {
    int32_t q = -1, r = -1;
    div.divmod(n, q, r);
    if (div.div(n) != n / d || q != n / d || r != n % d)
      return ::testing::AssertionFailure()
             << n << " / " << d << ": got " << div.div(n) << " (divmod " << q << ", " << r
             << "), want " << n / d << " remainder " << n % d;
  }
  return ::testing::AssertionSuccess();
}

TEST(Divisor, MatchesDivisionForSmallDivisors) {
  Rng rng(1);
  for (int64_t d = 1; d <= 5000; ++d) ASSERT_TRUE(divides(d, rng));
}

TEST(Divisor, MatchesDivisionAroundPowersOfTwo) {
  Rng rng(2);
  for (int b = 1; b <= 31; ++b)
    for (int64_t delta : {-2, -1, 0, 1, 2}) {
      const int64_t d = (int64_t{1} << b) + delta;
      if (d >= 1 && d <= kTop) ASSERT_TRUE(divides(d, rng));
    }
  ASSERT_TRUE(divides(kTop, rng));
}

TEST(Divisor, MatchesDivisionForRandomDivisors) {
  Rng rng(3);
  for (int i = 0; i < 2000; ++i) {
    // Divisors spread over every magnitude: a random bit length, then a random value of it.
    const int bits = 1 + static_cast<int>(rng.below(31));
    const int64_t d = std::max<int64_t>(1, static_cast<int64_t>(rng.below(uint64_t{1} << bits)));
    ASSERT_TRUE(divides(d, rng));
  }
}

// Every numerator below 2^22 for the divisors of the CIFAR-10 net's shapes (planes of 24 x 24
// and 12 x 12, 64 channels, windows of stride 2).
TEST(Divisor, EveryNumeratorBelow2To22ForTheNetsShapes) {
  for (int32_t d : {2, 3, 6, 12, 24, 64, 144, 576, 36864}) {
    const Divisor<int32_t> div(d);
    for (int32_t n = 0; n < (1 << 22); ++n)
      if (div.div(n) != n / d) FAIL() << n << " / " << d << ": got " << div.div(n);
  }
}

TEST(Divisor, WideIsPlainDivision) {
  const Divisor<int64_t> div(int64_t{3} << 33);
  int64_t q = 0, r = 0;
  div.divmod((int64_t{7} << 33) + 5, q, r);
  EXPECT_EQ(q, 2);
  EXPECT_EQ(r, (int64_t{1} << 33) + 5);
  EXPECT_EQ(div.div(int64_t{1} << 40), (int64_t{1} << 40) / (int64_t{3} << 33));
}

}  // namespace
}  // namespace towers
