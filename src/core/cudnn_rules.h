// cudnn_rules.h — how a tower's cuDNN plans choose their convolution algorithms
// (core/cudnn_conv.h; README decisions 62 and 64), from the command line down to each plan.
#pragma once

namespace towers {

// The default: the first deterministic algorithm of cuDNN's heuristic ranking, of any family.
struct CudnnRules {
  bool nondeterministic =
      false;               // --cudnn-nondeterministic: the first ranked, deterministic or not
  bool benchmark = false;  // --cudnn-benchmark: ranked by measured time (cudnnFind*)
  bool gemm_only = false;  // --cudnn-gemm-only: the GEMM family only (no FFT, Winograd)
  bool is_default() const { return !nondeterministic && !benchmark && !gemm_only; }
};

}  // namespace towers
