// dropout.h — inverted dropout (Srivastava et al.; TF's tf.nn.dropout, PyTorch's nn.Dropout):
// in training each element is kept with probability 1 - rate and scaled by 1 / (1 - rate), or
// zeroed; in evaluation the layer is the identity. CPU and CUDA twins; the CUDA twin takes its
// stream first.
//
// The mask is a pure function, not a stream of random numbers: element j of the example at
// global position e of a step is kept iff dropout_keep(key, e, j) (kernels/dropout_rules.h),
// where key mixes the step's noise key (the run's seed and the batch's index in the data
// stream) with the layer's salt (a hash of its name). So
//   - backward recomputes the mask and nothing is saved;
//   - the CPU loop, the CUDA kernel and the emulator draw the same mask, bit for bit;
//   - N sync towers of B / N draw, example for example, the mask one tower of B draws (each
//     tower's examples are numbered from its offset in the global batch);
//   - a resumed run draws the masks the uninterrupted run drew.
#pragma once

#include <cstdint>

#include "kernels/hd.h"

namespace towers::kernels {

// The noise of one forward/backward call: the step's key and the global position of the
// call's first example (its tower's offset in a sync global batch, plus its micro-batch's).
struct StepNoise {
  uint64_t key = 0;
  int64_t first_example = 0;
};

struct DropoutParams {
  int64_t per_example = 0;  // elements per example (< 2^32)
  uint64_t salt = 0;        // the layer's: a hash of its name
  uint32_t threshold = 0;   // dropped iff the element's 24-bit uniform is < threshold
  float scale = 1.0f;       // 1 / (1 - rate), rounded once to float
};

// The threshold round(rate * 2^24) and the scale of a layer; rate in [0, 1) and per_example in
// [1, 2^32), as the layer checks.
DropoutParams dropout_params(double rate, int64_t per_example, uint64_t salt);

namespace cpu {
// Examples [e0, e1) of a call (a caller may split the examples between threads); x, y, dy and
// dx point at the call's example 0.
void dropout_forward(const DropoutParams& p, const StepNoise& noise, int64_t e0, int64_t e1,
                     const float* x, float* y);
void dropout_backward(const DropoutParams& p, const StepNoise& noise, int64_t e0, int64_t e1,
                      const float* dy, float* dx);
}  // namespace cpu

namespace cuda {
// noise is device memory, read when the kernel runs: a CUDA graph's replay reads the noise of
// the step it replays (the tower copies each step's noise in before launching it).
void dropout_forward(CUstream_st* stream, const DropoutParams& p, const StepNoise* noise,
                     int64_t n, const float* x, float* y);
void dropout_backward(CUstream_st* stream, const DropoutParams& p, const StepNoise* noise,
                      int64_t n, const float* dy, float* dx);
}  // namespace cuda

}  // namespace towers::kernels
