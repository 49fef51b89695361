// emu_cudnn.cpp — the cuDNN calls towers makes (handles, 4-D tensor, filter and convolution
// descriptors, the _v7 algorithm rankings and the timed searches (cudnnFind*AlgorithmEx, whose
// order is a stand-in: see timed()), workspace sizes, and the three convolutions), on the
// host: each convolution is the CPU twin's im2col + GEMM (col2im for backward-data), image by
// image, queued on the handle's stream like every emulated operation.
//
// What it checks, as cuDNN would refuse it: NCHW float tensors, cross-correlation without
// dilation, output descriptors of the size the convolution gives, pointers inside live device
// allocations, and a workspace at least as large as the algorithm's size query, which the
// algorithms that need one really use as their im2col buffer. Its rankings put algorithms that
// a caller must skip ahead of the usable ones: non-deterministic ones (backward-data ALGO_0,
// backward-filter ALGO_0 and ALGO_3) and, where the descriptor permits tensor-op math, a
// tensor-op forward; the usable ones need workspace (the one image's col buffer) or none.
// A tensor-op forward rounds its inputs to TF32, as the emulated cuBLAS does in TF32 mode. Set-up
// (handles, descriptors, rankings, workspace queries) is refused while the calling thread
// captures a graph: towers plans its convolutions before any capture, and this holds it to that.
// Only beta = 0 (overwrite) is emulated, which is all towers uses.
// TOWERS_EMU_CUDNN_TRANSFORMS_FIRST=1 (tests) ranks a transform algorithm first in each
// direction, as cuDNN often does on a GPU (forward FFT_TILING, backward-data WINOGRAD_NONFUSED,
// backward-filter FFT_TILING: not the FFT algorithms whose timed trials fail, see timed();
// deterministic, FP32, one image's col buffer of workspace): a plan takes
// them by default and passes over them with --cudnn-gemm-only. The emulator computes them as
// it computes every algorithm (im2col + GEMM): only the choice differs, not the rounding.
#include <cudnn.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "kernels/conv.h"
#include "kernels/gemm.h"
#include "tests/emu/emu_runtime.h"

struct cudnnContext {
  cudaStream_t stream = nullptr;
};
struct cudnnTensorStruct {
  bool set = false;
  int n = 0, c = 0, h = 0, w = 0;
};
struct cudnnFilterStruct {
  bool set = false;
  int k = 0, c = 0, h = 0, w = 0;
};
struct cudnnConvolutionStruct {
  bool set = false;
  int pad_h = 0, pad_w = 0, u = 1, v = 1;
  cudnnMathType_t math = CUDNN_DEFAULT_MATH;
};

namespace {

using towers::kernels::ConvGeometry;

// The geometry of one image's convolution, or false if the descriptors do not describe one
// (unset, channels disagree, or y is not the size the convolution gives).
bool geometry(const cudnnTensorStruct* x, const cudnnFilterStruct* w,
              const cudnnConvolutionStruct* c, const cudnnTensorStruct* y, ConvGeometry* g) {
  if (!x || !w || !c || !y || !x->set || !w->set || !c->set || !y->set) return false;
  if (x->c != w->c || y->c != w->k || y->n != x->n) return false;
  const int span_h = x->h + 2 * c->pad_h - w->h, span_w = x->w + 2 * c->pad_w - w->w;
  if (span_h < 0 || span_w < 0) return false;
  g->channels = x->c, g->height = x->h, g->width = x->w;
  g->rows = {x->h, w->h, c->u, span_h / c->u + 1, c->pad_h};
  g->cols = {x->w, w->w, c->v, span_w / c->v + 1, c->pad_w};
  return y->h == g->rows.out && y->w == g->cols.out;
}

size_t col_bytes(const ConvGeometry& g) {
  return sizeof(float) * static_cast<size_t>(g.patch() * g.out_pixels());
}

// The workspace the algorithms that need one ask for: one image's im2col buffer, plus
// TOWERS_EMU_CUDNN_EXTRA_WORKSPACE bytes (tests: more than a layer's scratch, so that towers run
// their plans in workspaces of the plans' own).
size_t needed_bytes(const ConvGeometry& g) {
  const char* extra = std::getenv("TOWERS_EMU_CUDNN_EXTRA_WORKSPACE");
  return col_bytes(g) + (extra != nullptr ? std::strtoull(extra, nullptr, 10) : 0);
}

// Whether the pointers are device memory of the sizes the call reads and writes, and the
// workspace is large enough for the algorithm.
bool usable(const ConvGeometry& g, int n, int k, const void* x, const void* w, const void* y,
            const void* ws, size_t ws_bytes, size_t needed) {
  const size_t in = sizeof(float) * n * g.channels * g.height * g.width;
  const size_t out = sizeof(float) * n * k * g.out_pixels();
  const size_t wb = sizeof(float) * k * g.patch();
  using towers::emu::on_device;
  if (!on_device(x, in) || !on_device(w, wb) || !on_device(y, out)) return false;
  if (ws_bytes < needed) return false;
  return needed == 0 || on_device(ws, needed);
}

// The checks every convolution call shares, then image(i, col) for each image, queued on the
// handle's stream; col is the workspace when the algorithm needs one (it is the im2col buffer
// of one image), else the emulator's own.
template <class Image>
cudnnStatus_t convolve(cudnnHandle_t h, const ConvGeometry& g, int n, int k, const void* x,
                       const void* w, const void* y, void* ws, size_t ws_bytes, size_t needed,
                       const void* beta, Image image) {
  if (*static_cast<const float*>(beta) != 0.0f) return CUDNN_STATUS_NOT_SUPPORTED;
  if (!usable(g, n, k, x, w, y, ws, ws_bytes, needed)) return CUDNN_STATUS_BAD_PARAM;
  towers::emu::submit(h->stream, [=] {
    std::vector<float> own(needed ? 0 : g.patch() * g.out_pixels());
    float* col = needed ? static_cast<float*>(ws) : own.data();
    for (int i = 0; i < n; ++i) image(i, col);
  });
  return CUDNN_STATUS_SUCCESS;
}

template <class Perf, class Algo>
Perf entry(Algo a, bool deterministic, size_t memory, cudnnMathType_t math) {
  Perf p{};
  p.algo = a;
  p.status = CUDNN_STATUS_SUCCESS;
  p.time = -1.0f;
  p.memory = memory;
  p.determinism = deterministic ? CUDNN_DETERMINISTIC : CUDNN_NON_DETERMINISTIC;
  p.mathType = math;
  return p;
}

// Set-up inside a capture: refused (see the top of the file).
bool setup_refused() { return towers::emu::capturing(); }

template <class T>
cudnnStatus_t make(T** d) {
  if (setup_refused()) return CUDNN_STATUS_NOT_SUPPORTED;
  *d = new T{};
  return CUDNN_STATUS_SUCCESS;
}
template <class T>
cudnnStatus_t drop(T* d) {
  delete d;
  return CUDNN_STATUS_SUCCESS;
}

template <class Perf>
void ranking(const std::vector<Perf>& all, int requested, int* returned, Perf* out) {
  *returned = 0;
  for (const Perf& p : all)
    if (*returned < requested) out[(*returned)++] = p;
}

// Whether the rankings start with a transform algorithm (see the top of the file).
bool transforms_first() { return std::getenv("TOWERS_EMU_CUDNN_TRANSFORMS_FIRST") != nullptr; }

// The algorithms of each direction, in the order of the _v7 ranking.
std::vector<cudnnConvolutionFwdAlgoPerf_t> fwd_candidates(const cudnnConvolutionStruct* c,
                                                          const ConvGeometry& g) {
  using P = cudnnConvolutionFwdAlgoPerf_t;
  std::vector<P> all;
  if (transforms_first())
    all.push_back(
        entry<P>(CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING, true, needed_bytes(g), CUDNN_FMA_MATH));
  if (c->math != CUDNN_FMA_MATH)
    all.push_back(entry<P>(CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM, true, 0,
                           CUDNN_TENSOR_OP_MATH));
  all.push_back(entry<P>(CUDNN_CONVOLUTION_FWD_ALGO_GEMM, true, needed_bytes(g), CUDNN_FMA_MATH));
  all.push_back(entry<P>(CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM, true, 0, CUDNN_FMA_MATH));
  return all;
}
std::vector<cudnnConvolutionBwdDataAlgoPerf_t> bwd_data_candidates(const ConvGeometry& g) {
  using P = cudnnConvolutionBwdDataAlgoPerf_t;
  std::vector<P> all;
  if (transforms_first())
    all.push_back(entry<P>(CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD_NONFUSED, true, needed_bytes(g),
                           CUDNN_FMA_MATH));
  all.push_back(entry<P>(CUDNN_CONVOLUTION_BWD_DATA_ALGO_0, false, 0, CUDNN_FMA_MATH));
  all.push_back(entry<P>(CUDNN_CONVOLUTION_BWD_DATA_ALGO_1, true, needed_bytes(g), CUDNN_FMA_MATH));
  return all;
}
std::vector<cudnnConvolutionBwdFilterAlgoPerf_t> bwd_filter_candidates(const ConvGeometry& g) {
  using P = cudnnConvolutionBwdFilterAlgoPerf_t;
  std::vector<P> all;
  if (transforms_first())
    all.push_back(entry<P>(CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT_TILING, true, needed_bytes(g),
                           CUDNN_FMA_MATH));
  all.push_back(entry<P>(CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0, false, 0, CUDNN_FMA_MATH));
  all.push_back(entry<P>(CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3, false, 0, CUDNN_FMA_MATH));
  all.push_back(
      entry<P>(CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1, true, needed_bytes(g), CUDNN_FMA_MATH));
  return all;
}

// cudnnFind*AlgorithmEx: the direction's algorithms "timed" on the caller's buffers. The
// emulator times nothing; its order is a stand-in that differs from the ranking where it can:
// first an FFT entry whose trial failed (NOT_SUPPORTED: a caller must pass over it), then the
// others with the fewest workspace bytes first (so a timed forward takes IMPLICIT_GEMM where
// the ranking takes GEMM), with times 1, 2, ... ms in that order. An algorithm that needs more
// workspace than offered is not run: NOT_SUPPORTED. TOWERS_EMU_CUDNN_FIND_FAILS=1 (tests)
// fails every trial. The buffers must be device memory of the sizes the convolution reads and
// writes, and the workspace device memory of the size offered.
template <class Perf, class Algo>
cudnnStatus_t timed(std::vector<Perf> all, Algo fft, const ConvGeometry& g, int n, int k,
                    const void* x, const void* w, const void* y, const void* ws, size_t ws_bytes,
                    int requested, int* returned, Perf* out) {
  if (!usable(g, n, k, x, w, y, ws, ws_bytes, ws_bytes)) return CUDNN_STATUS_BAD_PARAM;
  std::stable_sort(all.begin(), all.end(),
                   [](const Perf& a, const Perf& b) { return a.memory < b.memory; });
  Perf failed = entry<Perf>(fft, true, 0, CUDNN_FMA_MATH);
  failed.status = CUDNN_STATUS_NOT_SUPPORTED;
  all.insert(all.begin(), failed);
  const bool fail_all = std::getenv("TOWERS_EMU_CUDNN_FIND_FAILS") != nullptr;
  for (size_t i = 1; i < all.size(); ++i) {
    all[i].time = static_cast<float>(i);
    if (all[i].memory > ws_bytes || fail_all) all[i].status = CUDNN_STATUS_NOT_SUPPORTED;
  }
  ranking(all, requested, returned, out);
  return CUDNN_STATUS_SUCCESS;
}

}  // namespace

extern "C" {

size_t cudnnGetVersion() { return CUDNN_VERSION; }

const char* cudnnGetErrorString(cudnnStatus_t s) {
  switch (s) {
    case CUDNN_STATUS_SUCCESS: return "CUDNN_STATUS_SUCCESS";
    case CUDNN_STATUS_BAD_PARAM: return "CUDNN_STATUS_BAD_PARAM (emulated)";
    case CUDNN_STATUS_NOT_SUPPORTED: return "CUDNN_STATUS_NOT_SUPPORTED (emulated)";
    default: return "CUDNN_STATUS_EMULATED_ERROR";
  }
}

cudnnStatus_t cudnnCreate(cudnnHandle_t* h) { return make(h); }
cudnnStatus_t cudnnDestroy(cudnnHandle_t h) { return drop(h); }
cudnnStatus_t cudnnSetStream(cudnnHandle_t h, cudaStream_t s) {
  if (setup_refused()) return CUDNN_STATUS_NOT_SUPPORTED;
  h->stream = s;
  return CUDNN_STATUS_SUCCESS;
}
cudnnStatus_t cudnnGetStream(cudnnHandle_t h, cudaStream_t* s) {
  *s = h->stream;
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnCreateTensorDescriptor(cudnnTensorDescriptor_t* d) { return make(d); }
cudnnStatus_t cudnnDestroyTensorDescriptor(cudnnTensorDescriptor_t d) { return drop(d); }
cudnnStatus_t cudnnSetTensor4dDescriptor(cudnnTensorDescriptor_t d, cudnnTensorFormat_t format,
                                         cudnnDataType_t type, int n, int c, int h, int w) {
  if (setup_refused()) return CUDNN_STATUS_NOT_SUPPORTED;
  if (format != CUDNN_TENSOR_NCHW || type != CUDNN_DATA_FLOAT) return CUDNN_STATUS_NOT_SUPPORTED;
  if (n <= 0 || c <= 0 || h <= 0 || w <= 0) return CUDNN_STATUS_BAD_PARAM;
  *d = {true, n, c, h, w};
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnCreateFilterDescriptor(cudnnFilterDescriptor_t* d) { return make(d); }
cudnnStatus_t cudnnDestroyFilterDescriptor(cudnnFilterDescriptor_t d) { return drop(d); }
cudnnStatus_t cudnnSetFilter4dDescriptor(cudnnFilterDescriptor_t d, cudnnDataType_t type,
                                         cudnnTensorFormat_t format, int k, int c, int h, int w) {
  if (setup_refused()) return CUDNN_STATUS_NOT_SUPPORTED;
  if (format != CUDNN_TENSOR_NCHW || type != CUDNN_DATA_FLOAT) return CUDNN_STATUS_NOT_SUPPORTED;
  if (k <= 0 || c <= 0 || h <= 0 || w <= 0) return CUDNN_STATUS_BAD_PARAM;
  *d = {true, k, c, h, w};
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnCreateConvolutionDescriptor(cudnnConvolutionDescriptor_t* d) { return make(d); }
cudnnStatus_t cudnnDestroyConvolutionDescriptor(cudnnConvolutionDescriptor_t d) { return drop(d); }
cudnnStatus_t cudnnSetConvolution2dDescriptor(cudnnConvolutionDescriptor_t d, int pad_h,
                                              int pad_w, int u, int v, int dilation_h,
                                              int dilation_w, cudnnConvolutionMode_t mode,
                                              cudnnDataType_t compute) {
  if (setup_refused()) return CUDNN_STATUS_NOT_SUPPORTED;
  if (mode != CUDNN_CROSS_CORRELATION || compute != CUDNN_DATA_FLOAT || dilation_h != 1 ||
      dilation_w != 1)
    return CUDNN_STATUS_NOT_SUPPORTED;
  if (pad_h < 0 || pad_w < 0 || u <= 0 || v <= 0) return CUDNN_STATUS_BAD_PARAM;
  d->set = true;
  d->pad_h = pad_h, d->pad_w = pad_w, d->u = u, d->v = v;
  return CUDNN_STATUS_SUCCESS;
}
cudnnStatus_t cudnnSetConvolutionMathType(cudnnConvolutionDescriptor_t d, cudnnMathType_t math) {
  if (setup_refused()) return CUDNN_STATUS_NOT_SUPPORTED;
  d->math = math;
  return CUDNN_STATUS_SUCCESS;
}

// ---- forward --------------------------------------------------------------------------------
cudnnStatus_t cudnnGetConvolutionForwardAlgorithm_v7(
    cudnnHandle_t, const cudnnTensorDescriptor_t x, const cudnnFilterDescriptor_t w,
    const cudnnConvolutionDescriptor_t c, const cudnnTensorDescriptor_t y, const int requested,
    int* returned, cudnnConvolutionFwdAlgoPerf_t* out) {
  if (setup_refused()) return CUDNN_STATUS_NOT_SUPPORTED;
  ConvGeometry g;
  if (!geometry(x, w, c, y, &g)) return CUDNN_STATUS_BAD_PARAM;
  ranking(fwd_candidates(c, g), requested, returned, out);
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnFindConvolutionForwardAlgorithmEx(
    cudnnHandle_t, const cudnnTensorDescriptor_t xd, const void* x, const cudnnFilterDescriptor_t wd,
    const void* w, const cudnnConvolutionDescriptor_t c, const cudnnTensorDescriptor_t yd, void* y,
    const int requested, int* returned, cudnnConvolutionFwdAlgoPerf_t* out, void* ws,
    size_t ws_bytes) {
  if (setup_refused()) return CUDNN_STATUS_NOT_SUPPORTED;
  ConvGeometry g;
  if (!geometry(xd, wd, c, yd, &g)) return CUDNN_STATUS_BAD_PARAM;
  return timed(fwd_candidates(c, g), CUDNN_CONVOLUTION_FWD_ALGO_FFT, g, xd->n, wd->k, x, w, y, ws,
               ws_bytes, requested, returned, out);
}

cudnnStatus_t cudnnGetConvolutionForwardWorkspaceSize(cudnnHandle_t, const cudnnTensorDescriptor_t x,
                                                      const cudnnFilterDescriptor_t w,
                                                      const cudnnConvolutionDescriptor_t c,
                                                      const cudnnTensorDescriptor_t y,
                                                      cudnnConvolutionFwdAlgo_t algo,
                                                      size_t* bytes) {
  ConvGeometry g;
  if (!geometry(x, w, c, y, &g)) return CUDNN_STATUS_BAD_PARAM;
  switch (algo) {
    case CUDNN_CONVOLUTION_FWD_ALGO_GEMM:
    case CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING:
      *bytes = needed_bytes(g);
      return CUDNN_STATUS_SUCCESS;
    case CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM:
    case CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM: *bytes = 0; return CUDNN_STATUS_SUCCESS;
    default: return CUDNN_STATUS_NOT_SUPPORTED;
  }
}

cudnnStatus_t cudnnConvolutionForward(cudnnHandle_t h, const void* alpha,
                                      const cudnnTensorDescriptor_t xd, const void* x,
                                      const cudnnFilterDescriptor_t wd, const void* w,
                                      const cudnnConvolutionDescriptor_t cd,
                                      cudnnConvolutionFwdAlgo_t algo, void* ws, size_t ws_bytes,
                                      const void* beta, const cudnnTensorDescriptor_t yd, void* y) {
  ConvGeometry g;
  if (!geometry(xd, wd, cd, yd, &g)) return CUDNN_STATUS_BAD_PARAM;
  size_t needed = 0;
  if (cudnnGetConvolutionForwardWorkspaceSize(h, xd, wd, cd, yd, algo, &needed) != CUDNN_STATUS_SUCCESS)
    return CUDNN_STATUS_NOT_SUPPORTED;
  const int k = wd->k;
  const int64_t K = g.patch(), P = g.out_pixels(), in = g.channels * g.height * g.width;
  const float a = *static_cast<const float*>(alpha);
  const float* xf = static_cast<const float*>(x);
  const float* wf = static_cast<const float*>(w);
  float* yf = static_cast<float*>(y);
  const bool tf32 =
      cd->math != CUDNN_FMA_MATH && algo == CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM;
  return convolve(h, g, xd->n, k, x, w, y, ws, ws_bytes, needed, beta, [=](int i, float* col) {
    towers::kernels::cpu::im2col(g, xf + i * in, col, P);
    const float* wu = wf;
    std::vector<float> wr;
    if (tf32) {  // the tensor-op forward: both operands rounded to TF32
      for (int64_t j = 0; j < K * P; ++j) col[j] = towers::emu::to_tf32(col[j]);
      wr.assign(wf, wf + k * K);
      for (float& v : wr) v = towers::emu::to_tf32(v);
      wu = wr.data();
    }
    towers::kernels::cpu::gemm(false, false, k, P, K, a, wu, K, col, P, 0.0f, yf + i * k * P, P);
  });
}

// ---- backward-data --------------------------------------------------------------------------
cudnnStatus_t cudnnGetConvolutionBackwardDataAlgorithm_v7(
    cudnnHandle_t, const cudnnFilterDescriptor_t w, const cudnnTensorDescriptor_t dy,
    const cudnnConvolutionDescriptor_t c, const cudnnTensorDescriptor_t dx, const int requested,
    int* returned, cudnnConvolutionBwdDataAlgoPerf_t* out) {
  if (setup_refused()) return CUDNN_STATUS_NOT_SUPPORTED;
  ConvGeometry g;
  if (!geometry(dx, w, c, dy, &g)) return CUDNN_STATUS_BAD_PARAM;
  ranking(bwd_data_candidates(g), requested, returned, out);
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnFindConvolutionBackwardDataAlgorithmEx(
    cudnnHandle_t, const cudnnFilterDescriptor_t wd, const void* w, const cudnnTensorDescriptor_t dyd,
    const void* dy, const cudnnConvolutionDescriptor_t c, const cudnnTensorDescriptor_t dxd,
    void* dx, const int requested, int* returned, cudnnConvolutionBwdDataAlgoPerf_t* out, void* ws,
    size_t ws_bytes) {
  if (setup_refused()) return CUDNN_STATUS_NOT_SUPPORTED;
  ConvGeometry g;
  if (!geometry(dxd, wd, c, dyd, &g)) return CUDNN_STATUS_BAD_PARAM;
  return timed(bwd_data_candidates(g), CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT, g, dxd->n, wd->k, dx,
               w, dy, ws, ws_bytes, requested, returned, out);
}

cudnnStatus_t cudnnGetConvolutionBackwardDataWorkspaceSize(cudnnHandle_t,
                                                           const cudnnFilterDescriptor_t w,
                                                           const cudnnTensorDescriptor_t dy,
                                                           const cudnnConvolutionDescriptor_t c,
                                                           const cudnnTensorDescriptor_t dx,
                                                           cudnnConvolutionBwdDataAlgo_t algo,
                                                           size_t* bytes) {
  ConvGeometry g;
  if (!geometry(dx, w, c, dy, &g)) return CUDNN_STATUS_BAD_PARAM;
  switch (algo) {
    case CUDNN_CONVOLUTION_BWD_DATA_ALGO_0: *bytes = 0; return CUDNN_STATUS_SUCCESS;
    case CUDNN_CONVOLUTION_BWD_DATA_ALGO_1:
    case CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD_NONFUSED:
      *bytes = needed_bytes(g);
      return CUDNN_STATUS_SUCCESS;
    default: return CUDNN_STATUS_NOT_SUPPORTED;
  }
}

cudnnStatus_t cudnnConvolutionBackwardData(cudnnHandle_t h, const void* alpha,
                                           const cudnnFilterDescriptor_t wd, const void* w,
                                           const cudnnTensorDescriptor_t dyd, const void* dy,
                                           const cudnnConvolutionDescriptor_t cd,
                                           cudnnConvolutionBwdDataAlgo_t algo, void* ws,
                                           size_t ws_bytes, const void* beta,
                                           const cudnnTensorDescriptor_t dxd, void* dx) {
  ConvGeometry g;
  if (!geometry(dxd, wd, cd, dyd, &g)) return CUDNN_STATUS_BAD_PARAM;
  size_t needed = 0;
  if (cudnnGetConvolutionBackwardDataWorkspaceSize(h, wd, dyd, cd, dxd, algo, &needed) !=
      CUDNN_STATUS_SUCCESS)
    return CUDNN_STATUS_NOT_SUPPORTED;
  const int k = wd->k;
  const int64_t K = g.patch(), P = g.out_pixels(), in = g.channels * g.height * g.width;
  const float a = *static_cast<const float*>(alpha);
  const float* wf = static_cast<const float*>(w);
  const float* dyf = static_cast<const float*>(dy);
  float* dxf = static_cast<float*>(dx);
  return convolve(h, g, dxd->n, k, dx, w, dy, ws, ws_bytes, needed, beta, [=](int i, float* col) {
    towers::kernels::cpu::gemm(true, false, K, P, k, a, wf, K, dyf + i * k * P, P, 0.0f, col, P);
    towers::kernels::cpu::col2im(g, col, P, dxf + i * in);
  });
}

// ---- backward-filter ------------------------------------------------------------------------
cudnnStatus_t cudnnGetConvolutionBackwardFilterAlgorithm_v7(
    cudnnHandle_t, const cudnnTensorDescriptor_t x, const cudnnTensorDescriptor_t dy,
    const cudnnConvolutionDescriptor_t c, const cudnnFilterDescriptor_t dw, const int requested,
    int* returned, cudnnConvolutionBwdFilterAlgoPerf_t* out) {
  if (setup_refused()) return CUDNN_STATUS_NOT_SUPPORTED;
  ConvGeometry g;
  if (!geometry(x, dw, c, dy, &g)) return CUDNN_STATUS_BAD_PARAM;
  ranking(bwd_filter_candidates(g), requested, returned, out);
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnFindConvolutionBackwardFilterAlgorithmEx(
    cudnnHandle_t, const cudnnTensorDescriptor_t xd, const void* x, const cudnnTensorDescriptor_t dyd,
    const void* dy, const cudnnConvolutionDescriptor_t c, const cudnnFilterDescriptor_t dwd,
    void* dw, const int requested, int* returned, cudnnConvolutionBwdFilterAlgoPerf_t* out,
    void* ws, size_t ws_bytes) {
  if (setup_refused()) return CUDNN_STATUS_NOT_SUPPORTED;
  ConvGeometry g;
  if (!geometry(xd, dwd, c, dyd, &g)) return CUDNN_STATUS_BAD_PARAM;
  return timed(bwd_filter_candidates(g), CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT, g, xd->n, dwd->k,
               x, dw, dy, ws, ws_bytes, requested, returned, out);
}

cudnnStatus_t cudnnGetConvolutionBackwardFilterWorkspaceSize(
    cudnnHandle_t, const cudnnTensorDescriptor_t x, const cudnnTensorDescriptor_t dy,
    const cudnnConvolutionDescriptor_t c, const cudnnFilterDescriptor_t dw,
    cudnnConvolutionBwdFilterAlgo_t algo, size_t* bytes) {
  ConvGeometry g;
  if (!geometry(x, dw, c, dy, &g)) return CUDNN_STATUS_BAD_PARAM;
  switch (algo) {
    case CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0:
    case CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3: *bytes = 0; return CUDNN_STATUS_SUCCESS;
    case CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1:
    case CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT_TILING:
      *bytes = needed_bytes(g);
      return CUDNN_STATUS_SUCCESS;
    default: return CUDNN_STATUS_NOT_SUPPORTED;
  }
}

cudnnStatus_t cudnnConvolutionBackwardFilter(cudnnHandle_t h, const void* alpha,
                                             const cudnnTensorDescriptor_t xd, const void* x,
                                             const cudnnTensorDescriptor_t dyd, const void* dy,
                                             const cudnnConvolutionDescriptor_t cd,
                                             cudnnConvolutionBwdFilterAlgo_t algo, void* ws,
                                             size_t ws_bytes, const void* beta,
                                             const cudnnFilterDescriptor_t dwd, void* dw) {
  ConvGeometry g;
  if (!geometry(xd, dwd, cd, dyd, &g)) return CUDNN_STATUS_BAD_PARAM;
  size_t needed = 0;
  if (cudnnGetConvolutionBackwardFilterWorkspaceSize(h, xd, dyd, cd, dwd, algo, &needed) !=
      CUDNN_STATUS_SUCCESS)
    return CUDNN_STATUS_NOT_SUPPORTED;
  const int k = dwd->k;
  const int64_t K = g.patch(), P = g.out_pixels(), in = g.channels * g.height * g.width;
  const float a = *static_cast<const float*>(alpha);
  const float* xf = static_cast<const float*>(x);
  const float* dyf = static_cast<const float*>(dy);
  float* dwf = static_cast<float*>(dw);
  // dW (k, K) (+)= alpha dy_i (k, P) col_i^T (P, K); the first image overwrites.
  return convolve(h, g, xd->n, k, x, dw, dy, ws, ws_bytes, needed, beta, [=](int i, float* col) {
    towers::kernels::cpu::im2col(g, xf + i * in, col, P);
    towers::kernels::cpu::gemm(false, true, k, K, P, a, dyf + i * k * P, P, col, P,
                               i == 0 ? 0.0f : 1.0f, dwf, K);
  });
}

}  // extern "C"
