// cudnn_rules.h — how a tower's cuDNN plans choose their convolution algorithms
// (core/cudnn_conv.h; README decisions 62 and 64), from the command line down to each plan.
#pragma once

namespace towers {

// The default: the first deterministic algorithm of cuDNN's heuristic ranking, of any family.
struct CudnnRules {
  // --cudnn-nondeterministic: the first ranked algorithm, deterministic or not.
  bool nondeterministic = false;
  // --cudnn-benchmark: ranked by measured time (cudnnFind*), not by cuDNN's heuristic.
  bool benchmark = false;
  // --cudnn-gemm-only: the GEMM family only (no FFT or Winograd).
  bool gemm_only = false;
  bool is_default() const { return !nondeterministic && !benchmark && !gemm_only; }
};

}  // namespace towers
