// divisor.h — integer division by a number fixed when a kernel is launched, for the index
// arithmetic of the element-wise kernels. A GPU has no integer divider: nvcc turns a 32-bit
// division by a value known only at run time into some twenty instructions, and a 64-bit one
// into a call of several times that. In kernels that split a flat index into (plane, row,
// column) that arithmetic, not memory, sets the time (the 2026-11-27 profile: max-pool's gather
// and the bias add ran at a third of HBM's rate or less).
//
// Divisor<int32_t> divides a non-negative 32-bit numerator with one 32 x 32-bit multiply-high,
// an add and a shift (Granlund and Montgomery, "Division by invariant integers using
// multiplication", 1994): for a divisor d >= 1, with l = ceil(log2 d) and
// m = floor(2^32 (2^l - d) / d) + 1,
//   floor(n / d) = (umulhi(n, m) + n) >> l   for every 0 <= n < 2^31,
// where umulhi(n, m) = floor(n m / 2^32). Why: with M = m + 2^32 = floor(2^(32+l) / d) + 1,
// umulhi(n, m) + n = floor(n M / 2^32), so the result is floor(n M / 2^(32+l)); and
// M = 2^(32+l) / d + e with 0 < e <= 1, so n M / 2^(32+l) = n / d + n e / 2^(32+l), whose excess
// n e / 2^(32+l) < 2^31 / 2^(32+l) = 2^-(l+1) < 1 / d (as d <= 2^l) cannot carry n / d past the
// next integer, which lies at least 1 / d above it. m fits in 32 bits: 2^l - d < d, since
// d > 2^(l-1), and the floor is at most 2^32 - 2 for any d below 2^31 (m = 1 when d is a power of
// two, 1 included). umulhi(n, m) + n < 2^32 for n < 2^31, so nothing overflows. The quotient is
// exact: the kernels that use it compute what plain division computes (tests/divisor_test.cpp
// checks it across the range), and their CPU tests need no new tolerance.
//
// Divisor<int64_t> is plain division: the wide instantiations (tensors past 2^30 elements) keep
// it. Both are built on the host, once per launch, and copied into the kernel's functor.
#pragma once

#include <cstdint>

#include "kernels/hd.h"

namespace towers::kernels::cuda {

template <class I>
class Divisor;

template <>
class Divisor<int32_t> {
 public:
  Divisor() = default;
  // d in [1, 2^31). A d below 1 makes a Divisor that must not divide (a launch with no
  // elements builds one for its empty sizes).
  TOWERS_HD explicit Divisor(int32_t d) : d_(d) {
    if (d < 1) return;
    while ((int64_t{1} << shift_) < d) ++shift_;  // l = ceil(log2 d)
    const uint64_t excess = (uint64_t{1} << shift_) - static_cast<uint64_t>(d);  // 2^l - d < 2^30
    mul_ = static_cast<uint32_t>((excess << 32) / static_cast<uint64_t>(d) + 1);
  }
  TOWERS_HD int32_t value() const { return d_; }
  // n / d for n in [0, 2^31).
  TOWERS_HD int32_t div(int32_t n) const {
    const auto u = static_cast<uint32_t>(n);
#if defined(__CUDA_ARCH__)
    const uint32_t hi = __umulhi(u, mul_);
#else
    const auto hi = static_cast<uint32_t>((static_cast<uint64_t>(u) * mul_) >> 32);
#endif
    return static_cast<int32_t>((hi + u) >> shift_);
  }
  // n / d into q, n - q d into r.
  TOWERS_HD void divmod(int32_t n, int32_t& q, int32_t& r) const {
    q = div(n);
    r = n - q * d_;
  }

 private:
  int32_t d_ = 1;
  uint32_t mul_ = 1;  // d = 1: (umulhi(n, 1) + n) >> 0 = n
  int shift_ = 0;
};

template <>
class Divisor<int64_t> {
 public:
  Divisor() = default;
  TOWERS_HD explicit Divisor(int64_t d) : d_(d) {}
  TOWERS_HD int64_t value() const { return d_; }
  TOWERS_HD int64_t div(int64_t n) const { return n / d_; }
  TOWERS_HD void divmod(int64_t n, int64_t& q, int64_t& r) const {
    q = n / d_;
    r = n - q * d_;
  }

 private:
  int64_t d_ = 1;
};

// The channel of element i of an (n, C, HW) tensor: (i / HW) mod C.
template <class I>
TOWERS_HD I channel_of(const Divisor<I>& c, const Divisor<I>& hw, I i) {
  I q, ch;
  c.divmod(hw.div(i), q, ch);
  return ch;
}

}  // namespace towers::kernels::cuda
