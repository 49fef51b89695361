// optimizer.h — element-wise optimizer updates over a contiguous slice of parameters.
// Every update first forms g' = g + weight_decay * w (L2 decay, as the TF CIFAR-10 tutorial's
// wd * l2_loss(w) term contributes), then applies the rule. Semantics follow TensorFlow's
// tf.compat.v1.train optimizers; the rules and their formulas are in
// kernels/optimizer_rules.h:
//   sgd      w -= lr * g'
//   momentum a = mu * a + g';  w -= lr * a  (Nesterov: w -= lr * (g' + mu * a))
//   adagrad  acc += g'^2;  w -= lr * g' / sqrt(acc)   (acc starts at 0.1, TF's default)
//   adam     m = b1 m + (1-b1) g';  v = b2 v + (1-b2) g'^2;  w -= lr_t * m / (sqrt(v) + eps),
//            with lr_t = lr * sqrt(1 - b2^t) / (1 - b1^t) computed by the caller
//   rmsprop  ms = rho ms + (1-rho) g'^2;  mom = mu mom + lr g' / sqrt(ms + eps);  w -= mom
//            (ms starts at 1, TF's default)
#pragma once

#include <cstdint>

#include "kernels/hd.h"
#include "kernels/optimizer_rules.h"

namespace towers::kernels {

namespace cpu {
// a.rule on n elements; s0 and s1 are the rule's slots (null where it has fewer).
void optimizer_update(int64_t n, float* w, float* s0, float* s1, const float* g,
                      const RuleArgs& a);
}  // namespace cpu

namespace cuda {  // the same rules, one thread per element
void optimizer_update(CUstream_st* s, int64_t n, float* w, float* s0, float* s1, const float* g,
                      const RuleArgs& a);
// The same update as a step's last kernels, captured once in its CUDA graph and replayed every
// step: the scalars are read from device memory when the kernel runs, so each replay applies
// that step's learning rate, and nothing is written when *skip is non-zero (the step's loss was
// not finite). Several variables of one flat array go in as few launches as fit (kUpdateSpans
// variables a launch): variable k is elements [offset[k], offset[k] + size[k]) of w, s0, s1 and
// g (s0, s1 null where the rule has fewer slots), updated with args[k] (its rule fixed at
// launch). Spans must not overlap; elements outside them are not touched. The floats are
// optimizer_update's on each variable.
constexpr int kUpdateSpans = 16;
void optimizer_update_spans_at(CUstream_st* s, int count, const int64_t* offset,
                               const int64_t* size, float* w, float* s0, float* s1,
                               const float* g, OptRule rule, const RuleArgs* args,
                               const int32_t* skip);

// What an update does beside the rule (optimizer_rules.h), on n elements. The scalars come
// from *at when it is not null (read when the kernel runs, as optimizer_update_spans_at's),
// else from a; nothing is written when skip is not null and *skip is non-zero.
// A state variable's running average: w = state_step(w, rate, delta).
void state_update(CUstream_st* s, int64_t n, float* w, const float* delta, float rate,
                  const int32_t* skip);
// Before the rule of update 1 (first): the wrappers' slots (either may be null) start as w.
void wrappers_begin(CUstream_st* s, int64_t n, const float* w, float* ema, float* slow,
                    const WrapperArgs& a, const WrapperArgs* at, const int32_t* skip);
// After the rule: Lookahead's move when due (lookahead_now; trainable variables only)...
void lookahead_update(CUstream_st* s, int64_t n, float* w, float* slow, const WrapperArgs& a,
                      const WrapperArgs* at, const int32_t* skip);
// ...then the average of every variable.
void ema_update(CUstream_st* s, int64_t n, const float* w, float* ema, const WrapperArgs& a,
                const WrapperArgs* at, const int32_t* skip);
}  // namespace cuda

}  // namespace towers::kernels
