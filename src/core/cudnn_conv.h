// cudnn_conv.h — one convolution shape through cuDNN (CUDA builds; src/core/cudnn_conv_cuda.cpp).
//
// A CudnnConv is made once per (layer, batch size) on a tower's cuDNN handle, before the tower
// captures a CUDA graph of the step (GpuPlans, core/gpu.h): the tensor, filter and convolution
// descriptors, and for each of forward, backward-data and backward-filter one algorithm.
//
// The algorithm is the first in cuDNN's heuristic ranking for this GPU (the _v7 queries, which
// run nothing on the GPU; the ranking is cuDNN's estimate of speed) that succeeds, is
// deterministic and needs at most 1 GiB of workspace. Heuristics rather than cudnnFind*, which
// times every algorithm: timing picks different algorithms from run to run, and with them
// different rounding, where a heuristic pick gives a run the same bits every time on one GPU
// and library version, as the rest of towers does. --cudnn-nondeterministic drops the
// determinism requirement (cuDNN's first-ranked backward algorithms often add with atomics, as
// PyTorch lets them by default): faster where they are, and then a run's bits vary from run to
// run. --cudnn-benchmark times the candidates instead (cudnnFind*AlgorithmEx, on buffers of the
// layer's shapes taken from the GPU's pool for the search) and takes the fastest that the
// same rules allow, as PyTorch's torch.backends.cudnn.benchmark does, or the ranking's choice
// where no timed candidate is usable; searches run one at a time and their choices are kept
// for the process, per GPU, shape and rules. The choice can then differ from run to run with
// the timings, and with it the rounding, so it is off by default.
// Precision of the algorithm families: cuDNN's ranking often puts FFT and Winograd algorithms
// first (on an H200 in FP32, for cifar10 at batch 128: FFT and Winograd backward passes), and
// they round in the transformed domain: their FP32 results lie about 1e-3 from a GEMM's,
// relative (1e-3 to 3e-2 seen there), where two summation orders of a GEMM lie about 1e-6
// apart. They are
// allowed by default, as in PyTorch and TensorFlow; --cudnn-gemm-only keeps every direction to
// the GEMM family (implicit GEMM, GEMM, direct; backward ALGO_0, ALGO_1, ALGO_3), whose results
// stay within FP32 summation-order rounding of the CPU tower's.
// A direction runs in the caller's workspace (the tower's scratch, sized for im2col and
// allocated before any capture) where its algorithm fits; where not (cuDNN's deterministic
// backward-filter algorithms often want a little more than im2col's buffer), in a workspace of
// the plan's own, taken from the GPU's pool (CudaMemoryPool) at that direction's first call,
// which comes before any capture (a tower's first step of a batch size runs eagerly; a first
// call inside a capture is an error).
//
// Precision: in FP32 mode (the default) every convolution descriptor asks for CUDNN_FMA_MATH,
// which excludes tensor-core TF32; with --tf32 it asks for CUDNN_DEFAULT_MATH, which permits
// TF32 on Ampere and later, and each direction runs with the math type its algorithm came with.
//
// Layout NCHW, float, cross-correlation (no kernel flip), symmetric padding: cuDNN pads each side
// by the same amount, so a TF SAME window with an extra row or column after the image (even
// total padding is symmetric; odd is not) does not fit (cudnn_window_fits), and the layer keeps
// im2col there.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "core/cudnn_rules.h"
#include "kernels/conv.h"
#include "kernels/hd.h"  // cudnnContext

namespace towers {

// Whether cuDNN's symmetric padding of pad_before on both sides gives TF's window: the same
// output size (the windows then start at the same places).
bool cudnn_window_fits(const kernels::Window& w);

class CudnnConv {
 public:
  struct Shape {
    int64_t n = 0;                           // batch
    kernels::ConvGeometry geo;               // input (C, H, W) and the two windows
    int64_t out_channels = 0;
  };
  // Throws towers::Error naming `who` when the shape does not fit cuDNN (cudnn_window_fits) or
  // a direction has no deterministic algorithm within 1 GiB of workspace. The current device
  // is the handle's (a workspace of its own is taken from its pool). workspace_bytes is what
  // the caller offers each call. rules.nondeterministic (--cudnn-nondeterministic) lets every
  // direction take the first of cuDNN's ranking, deterministic or not. rules.benchmark
  // (--cudnn-benchmark) ranks by measured time (cudnnFind*AlgorithmEx, which runs kernels on
  // the handle's stream and blocks until they are done; never inside a capture).
  // rules.gemm_only (--cudnn-gemm-only) passes over every algorithm outside the GEMM family.
  CudnnConv(cudnnContext* handle, const Shape& shape, bool tf32, size_t workspace_bytes,
            const std::string& who, const CudnnRules& rules = {});
  ~CudnnConv();
  CudnnConv(const CudnnConv&) = delete;
  CudnnConv& operator=(const CudnnConv&) = delete;

  // Queued on the handle's stream (cudnnSetStream); ws is the workspace (workspace_bytes()).
  // Each overwrites its output: y (n, out, OH, OW); dw (out, C, KH, KW); dx (n, C, H, W).
  void forward(const float* x, const float* w, float* y, void* ws) const;
  // on: another handle of the same GPU to queue it on (a tower's lane, core/gpu.h); the plan
  // and its algorithm are the same.
  void backward_filter(const float* x, const float* dy, float* dw, void* ws,
                       cudnnContext* on = nullptr) const;
  void backward_data(const float* w, const float* dy, float* dx, void* ws) const;

  // The most any of the three chosen algorithms needs of the caller's workspace (the directions
  // that run in a workspace of the plan's own need none of it).
  size_t workspace_bytes() const;
  // The device memory the plan allocated for itself (0 when everything fits the caller's).
  size_t own_workspace_bytes() const;
  // "forward IMPLICIT_PRECOMP_GEMM (0.0 MiB), backward-data ALGO_1 (1.2 MiB), backward-filter ...";
  // with --cudnn-benchmark after "timed: ", each direction with its measured time ("0.031 ms")
  // or "ranked" where the ranking chose.
  std::string algorithms() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// cuDNN's version as cudnnGetVersion() reports it (91900 = 9.19.0), of the library loaded.
size_t cudnn_version();

}  // namespace towers
