// optimizer.h — element-wise optimizer updates over a contiguous slice of parameters.
// Every update first forms g' = g + weight_decay * w (L2 decay, as the TF CIFAR-10 tutorial's
// wd * l2_loss(w) term contributes), then applies the rule. Semantics follow TensorFlow's
// tf.compat.v1.train optimizers; the formulas are next to each function.
#pragma once

#include <cstdint>

#include "kernels/hd.h"

namespace towers::kernels {

namespace cpu {

// w -= lr * g'
void sgd_update(int64_t n, float* w, const float* g, float lr, float wd);
// a = mu * a + g';  w -= lr * a  (Nesterov: w -= lr * (g' + mu * a))
void momentum_update(int64_t n, float* w, float* a, const float* g, float lr, float mu,
                     bool nesterov, float wd);
// acc += g'^2;  w -= lr * g' / sqrt(acc)   (acc starts at 0.1, TF's default)
void adagrad_update(int64_t n, float* w, float* acc, const float* g, float lr, float wd);
// m = b1 m + (1-b1) g';  v = b2 v + (1-b2) g'^2;  w -= lr_t * m / (sqrt(v) + eps),
// with lr_t = lr * sqrt(1 - b2^t) / (1 - b1^t) computed by the caller.
void adam_update(int64_t n, float* w, float* m, float* v, const float* g, float lr_t, float b1,
                 float b2, float eps, float wd);
// ms = rho ms + (1-rho) g'^2;  mom = mu mom + lr g' / sqrt(ms + eps);  w -= mom
// (ms starts at 1, TF's default)
void rmsprop_update(int64_t n, float* w, float* ms, float* mom, const float* g, float lr,
                    float rho, float mu, float eps, float wd);

}  // namespace cpu

namespace cuda {  // the same rules (kernels/optimizer_rules.h), one thread per element
void sgd_update(CUstream_st* s, int64_t n, float* w, const float* g, float lr, float wd);
void momentum_update(CUstream_st* s, int64_t n, float* w, float* a, const float* g, float lr,
                     float mu, bool nesterov, float wd);
void adagrad_update(CUstream_st* s, int64_t n, float* w, float* acc, const float* g, float lr,
                    float wd);
void adam_update(CUstream_st* s, int64_t n, float* w, float* m, float* v, const float* g,
                 float lr_t, float b1, float b2, float eps, float wd);
void rmsprop_update(CUstream_st* s, int64_t n, float* w, float* ms, float* mom, const float* g,
                    float lr, float rho, float mu, float eps, float wd);
}  // namespace cuda

}  // namespace towers::kernels
