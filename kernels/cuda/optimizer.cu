// optimizer.cu — the optimizer updates on the GPU, one element per thread. The per-element
// formulas are kernels/optimizer_rules.h's, shared with the CPU twin; built without FMA
// contraction (CMakeLists.txt), so the two round alike. The parameter, its slots and the
// gradient are distinct buffers.
#include <algorithm>

#include "core/check.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/optimizer.h"
#include "kernels/optimizer_rules.h"

namespace towers::kernels::cuda {

namespace {

template <class R>
struct Update {
  float *w, *s0, *s1;
  const float* g;
  RuleArgs a;
  TOWERS_HD void operator()(int64_t i) const { body(w, s0, s1, g, a, i); }
  static TOWERS_HD void body(float* __restrict__ w, float* __restrict__ s0, float* __restrict__ s1,
                             const float* __restrict__ g, const RuleArgs a, int64_t i) {
    R::at(i, w, s0, s1, g, a);
  }
};

// The scalars and the skip flag from device memory, read when the kernel runs (at replay, for
// a captured step), for up to kUpdateSpans variables in one launch: thread i is element i of
// the variables' elements laid end to end; it finds its variable among the span ends (a scan
// of at most kUpdateSpans values held in the kernel's parameters) and updates that element of
// the flat arrays.
struct Spans {
  int count;
  int64_t offset[kUpdateSpans];  // where span k starts in the flat arrays
  int64_t end[kUpdateSpans];     // the first thread past span k
};

template <class R>
struct UpdateSpansAt {
  Spans spans;
  float *w, *s0, *s1;
  const float* g;
  const RuleArgs* args;
  const int32_t* skip;
  TOWERS_HD void operator()(int64_t i) const { body(spans, w, s0, s1, g, args, skip, i); }
  static TOWERS_HD void body(const Spans& spans, float* __restrict__ w, float* __restrict__ s0,
                             float* __restrict__ s1, const float* __restrict__ g,
                             const RuleArgs* __restrict__ args, const int32_t* __restrict__ skip,
                             int64_t i) {
    if (*skip != 0) return;
    int k = 0;
    while (k + 1 < spans.count && i >= spans.end[k]) ++k;
    const int64_t start = k == 0 ? 0 : spans.end[k - 1];
    const RuleArgs a = args[k];
    R::at(spans.offset[k] + (i - start), w, s0, s1, g, a);
  }
};

struct StateStep {
  float* w;
  const float* delta;
  float rate;
  const int32_t* skip;
  TOWERS_HD void operator()(int64_t i) const {
    if (skip != nullptr && *skip != 0) return;
    w[i] = state_step(w[i], rate, delta[i]);
  }
};

struct WrappersBegin {
  const float* w;
  float *ema, *slow;
  WrapperArgs a;
  const WrapperArgs* at;
  const int32_t* skip;
  TOWERS_HD void operator()(int64_t i) const {
    if ((skip != nullptr && *skip != 0) || (at != nullptr ? at->first : a.first) == 0) return;
    if (ema != nullptr) ema[i] = w[i];
    if (slow != nullptr) slow[i] = w[i];
  }
};

struct LookaheadStep {
  float *w, *slow;
  WrapperArgs a;
  const WrapperArgs* at;
  const int32_t* skip;
  TOWERS_HD void operator()(int64_t i) const {
    if (skip != nullptr && *skip != 0) return;
    const WrapperArgs x = at != nullptr ? *at : a;
    if (x.lookahead_now == 0) return;
    const float moved = lookahead_step(slow[i], w[i], x.alpha);
    slow[i] = moved;
    w[i] = moved;
  }
};

struct EmaStep {
  const float* w;
  float* ema;
  WrapperArgs a;
  const WrapperArgs* at;
  const int32_t* skip;
  TOWERS_HD void operator()(int64_t i) const {
    if (skip != nullptr && *skip != 0) return;
    ema[i] = ema_step(ema[i], w[i], at != nullptr ? at->decay : a.decay);
  }
};

}  // namespace

void state_update(CUstream_st* s, int64_t n, float* w, const float* delta, float rate,
                  const int32_t* skip) {
  for_each_index(s, n, StateStep{w, delta, rate, skip});
}

void wrappers_begin(CUstream_st* s, int64_t n, const float* w, float* ema, float* slow,
                    const WrapperArgs& a, const WrapperArgs* at, const int32_t* skip) {
  if (ema == nullptr && slow == nullptr) return;
  for_each_index(s, n, WrappersBegin{w, ema, slow, a, at, skip});
}

void lookahead_update(CUstream_st* s, int64_t n, float* w, float* slow, const WrapperArgs& a,
                      const WrapperArgs* at, const int32_t* skip) {
  for_each_index(s, n, LookaheadStep{w, slow, a, at, skip});
}

void ema_update(CUstream_st* s, int64_t n, const float* w, float* ema, const WrapperArgs& a,
                const WrapperArgs* at, const int32_t* skip) {
  for_each_index(s, n, EmaStep{w, ema, a, at, skip});
}

void optimizer_update(CUstream_st* s, int64_t n, float* w, float* s0, float* s1, const float* g,
                      const RuleArgs& a) {
  with_rule(a.rule, [&](auto rule) {
    for_each_index(s, n, Update<decltype(rule)>{w, s0, s1, g, a});
  });
}

void optimizer_update_spans_at(CUstream_st* s, int count, const int64_t* offset,
                               const int64_t* size, float* w, float* s0, float* s1,
                               const float* g, OptRule rule, const RuleArgs* args,
                               const int32_t* skip) {
  for (int first = 0; first < count; first += kUpdateSpans) {
    Spans spans{};
    spans.count = std::min(kUpdateSpans, count - first);
    int64_t total = 0;
    for (int k = 0; k < spans.count; ++k) {
      TOWERS_CHECK(size[first + k] >= 0 && offset[first + k] >= 0,
                   "optimizer_update_spans_at: span {} at {} of {} elements", first + k,
                   offset[first + k], size[first + k]);
      spans.offset[k] = offset[first + k];
      total += size[first + k];
      spans.end[k] = total;
    }
    with_rule(rule, [&](auto r) {
      for_each_index(s, total, UpdateSpansAt<decltype(r)>{spans, w, s0, s1, g, args + first, skip});
    });
  }
}

}  // namespace towers::kernels::cuda
