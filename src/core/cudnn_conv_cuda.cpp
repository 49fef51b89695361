#include "core/cudnn_conv.h"

#include <cuda_runtime.h>
#include <cudnn.h>
#include <fmt/format.h>

#include <algorithm>
#include <array>

#include "core/check.h"
#include "core/cuda_check.h"
#include "core/cuda_device.h"

#define CUDNN_CHECK(call)                                                                   \
  do {                                                                                      \
    cudnnStatus_t towers_st_ = (call);                                                      \
    if (towers_st_ != CUDNN_STATUS_SUCCESS)                                                 \
      TOWERS_SYSTEM_FAIL("cuDNN call {} failed: {}", #call, cudnnGetErrorString(towers_st_)); \
  } while (0)

namespace towers {

bool cudnn_window_fits(const kernels::Window& w) {
  // cuDNN: out = (in + 2 pad - k) / stride + 1, rounded down; the first window starts at -pad.
  const int64_t span = w.in + 2 * w.pad_before - w.k;
  return span >= 0 && span / w.stride + 1 == w.out;
}

size_t cudnn_version() { return cudnnGetVersion(); }

namespace {

const char* fwd_name(cudnnConvolutionFwdAlgo_t a) {
  static constexpr std::array<const char*, 8> kNames = {
      "IMPLICIT_GEMM", "IMPLICIT_PRECOMP_GEMM", "GEMM", "DIRECT", "FFT", "FFT_TILING",
      "WINOGRAD", "WINOGRAD_NONFUSED"};
  return a >= 0 && a < static_cast<int>(kNames.size()) ? kNames[a] : "?";
}
const char* bwd_data_name(cudnnConvolutionBwdDataAlgo_t a) {
  static constexpr std::array<const char*, 6> kNames = {
      "ALGO_0", "ALGO_1", "FFT", "FFT_TILING", "WINOGRAD", "WINOGRAD_NONFUSED"};
  return a >= 0 && a < static_cast<int>(kNames.size()) ? kNames[a] : "?";
}
const char* bwd_filter_name(cudnnConvolutionBwdFilterAlgo_t a) {
  static constexpr std::array<const char*, 7> kNames = {
      "ALGO_0", "ALGO_1", "FFT", "ALGO_3", "WINOGRAD", "WINOGRAD_NONFUSED", "FFT_TILING"};
  return a >= 0 && a < static_cast<int>(kNames.size()) ? kNames[a] : "?";
}

std::string mib(size_t bytes) { return fmt::format("{:.1f} MiB", bytes / 1048576.0); }

// The most workspace a plan allocates for itself when no deterministic algorithm fits the
// layer's scratch (see pick).
constexpr size_t kOwnWorkspaceLimit = size_t{1} << 30;

// Whether cuDNN's ranked entry may be used at all: it ran, is deterministic (unless any will
// do) and keeps to the precision asked for (FP32: no tensor-op math; never ALLOW_CONVERSION,
// which may compute in FP16 or BF16).
template <class Perf>
bool usable(const Perf& p, bool tf32, bool deterministic) {
  if (p.status != CUDNN_STATUS_SUCCESS) return false;
  if (deterministic && p.determinism != CUDNN_DETERMINISTIC) return false;
  if (p.mathType == CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION) return false;
  return tf32 || p.mathType != CUDNN_TENSOR_OP_MATH;
}

// The first usable entry of cuDNN's ranking (its order is its estimate of speed) that needs at
// most kOwnWorkspaceLimit; it runs in the workspace offered (the layer's scratch) where it
// fits, else in a workspace of the plan's own. cuDNN's deterministic backward-filter
// algorithms often need a little more than the im2col buffer the scratch is sized by (conv1 of
// cifar10 at batch 128 with TF32 on an H100: ALGO_1 wants 21.2 MiB of a 21.1 MiB scratch, and
// every other deterministic one more). A towers::Error listing the ranking if nothing is usable.
template <class Perf, class Name>
const Perf& pick(const Perf* perf, int count, bool tf32, bool deterministic,
                 Name name, const char* direction, const std::string& who, int64_t n) {
  for (int i = 0; i < count; ++i)
    if (usable(perf[i], tf32, deterministic) && perf[i].memory <= kOwnWorkspaceLimit)
      return perf[i];
  std::string seen;
  for (int i = 0; i < count; ++i)
    seen += fmt::format("{}{} ({}, {}{})", i ? ", " : "", name(perf[i].algo),
                        perf[i].determinism == CUDNN_DETERMINISTIC ? "deterministic"
                                                                    : "not deterministic",
                        mib(perf[i].memory),
                        perf[i].status == CUDNN_STATUS_SUCCESS ? "" : ", not supported");
  TOWERS_BAD_INPUT("{}: cuDNN has no {}{} algorithm for this shape (batch {}) within {} of "
                   "workspace{}; its ranking: {}; use --conv im2col",
                   who, deterministic ? "deterministic " : "", direction, n,
                   mib(kOwnWorkspaceLimit), tf32 ? "" : " in FP32",
                   seen.empty() ? "empty" : seen);
}

}  // namespace

struct CudnnConv::Impl {
  cudnnHandle_t handle = nullptr;
  cudnnTensorDescriptor_t x = nullptr, y = nullptr;
  cudnnFilterDescriptor_t w = nullptr;
  // One per direction: each runs with the math type its algorithm was ranked with.
  cudnnConvolutionDescriptor_t fwd = nullptr, bwd_data = nullptr, bwd_filter = nullptr;
  cudnnConvolutionFwdAlgo_t fwd_algo{};
  cudnnConvolutionBwdDataAlgo_t bwd_data_algo{};
  cudnnConvolutionBwdFilterAlgo_t bwd_filter_algo{};
  size_t fwd_ws = 0, bwd_data_ws = 0, bwd_filter_ws = 0;
  // A direction whose algorithm needs more than the layer's scratch runs in a workspace of the
  // plan's own (forward, backward-data, backward-filter): own_bytes > 0. One per direction, as
  // backward-filter may run on the tower's lane beside backward-data. Taken from the GPU's
  // pool at the direction's first call, which is never inside a capture (a tower's first step
  // of a batch size runs eagerly; GpuPlans), so that a forward-only tower (evaluation) holds
  // no backward workspace.
  int device = 0;
  std::array<size_t, 3> own_bytes{};
  mutable std::array<void*, 3> own{};

  void* workspace(int direction, void* scratch, cudnnHandle_t on) const {
    if (own_bytes[direction] == 0) return scratch;
    if (own[direction] == nullptr) {
      cudaStream_t stream = nullptr;
      CUDNN_CHECK(cudnnGetStream(on, &stream));
      cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
      CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
      TOWERS_CHECK(status == cudaStreamCaptureStatusNone,
                   "a cuDNN plan's first call is inside a CUDA graph capture, where its workspace "
                   "cannot be allocated (a tower's first step of a batch size must run eagerly)");
      own[direction] = CudaMemoryPool::of(device).allocate(own_bytes[direction]);
    }
    return own[direction];
  }

  ~Impl() {
    for (void* p : own)
      if (p) CudaMemoryPool::of(device).release(p);
    for (cudnnConvolutionDescriptor_t d : {fwd, bwd_data, bwd_filter})
      if (d) cudnnDestroyConvolutionDescriptor(d);
    if (w) cudnnDestroyFilterDescriptor(w);
    if (y) cudnnDestroyTensorDescriptor(y);
    if (x) cudnnDestroyTensorDescriptor(x);
  }
};

CudnnConv::CudnnConv(cudnnContext* handle, const Shape& s, bool tf32, size_t workspace,
                     const std::string& who, bool deterministic)
    : impl_(std::make_unique<Impl>()) {
  const kernels::ConvGeometry& g = s.geo;
  TOWERS_CHECK(cudnn_window_fits(g.rows) && cudnn_window_fits(g.cols),
               "{}: cuDNN's symmetric padding cannot give this layer's window", who);
  Impl& m = *impl_;
  m.handle = handle;
  auto i32 = [](int64_t v) { return static_cast<int>(v); };
  CUDNN_CHECK(cudnnCreateTensorDescriptor(&m.x));
  CUDNN_CHECK(cudnnSetTensor4dDescriptor(m.x, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, i32(s.n),
                                         i32(g.channels), i32(g.height), i32(g.width)));
  CUDNN_CHECK(cudnnCreateTensorDescriptor(&m.y));
  CUDNN_CHECK(cudnnSetTensor4dDescriptor(m.y, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, i32(s.n),
                                         i32(s.out_channels), i32(g.rows.out), i32(g.cols.out)));
  CUDNN_CHECK(cudnnCreateFilterDescriptor(&m.w));
  CUDNN_CHECK(cudnnSetFilter4dDescriptor(m.w, CUDNN_DATA_FLOAT, CUDNN_TENSOR_NCHW,
                                         i32(s.out_channels), i32(g.channels), i32(g.rows.k),
                                         i32(g.cols.k)));
  const cudnnMathType_t math = tf32 ? CUDNN_DEFAULT_MATH : CUDNN_FMA_MATH;
  for (cudnnConvolutionDescriptor_t* d : {&m.fwd, &m.bwd_data, &m.bwd_filter}) {
    CUDNN_CHECK(cudnnCreateConvolutionDescriptor(d));
    CUDNN_CHECK(cudnnSetConvolution2dDescriptor(*d, i32(g.rows.pad_before), i32(g.cols.pad_before),
                                                i32(g.rows.stride), i32(g.cols.stride), 1, 1,
                                                CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT));
    CUDNN_CHECK(cudnnSetConvolutionMathType(*d, math));
  }
  // Set the descriptor to the chosen math type (TF32 mode may rank FMA and tensor-op kernels
  // together), then ask for the workspace that combination needs.
  const auto adopt = [&](cudnnConvolutionDescriptor_t d, cudnnMathType_t chosen) {
    if (tf32) CUDNN_CHECK(cudnnSetConvolutionMathType(d, chosen));
  };
  // A direction whose algorithm needs more than the scratch (by the size query after adopting
  // the math type, the one that counts) runs in a workspace of its own, on this device.
  CUDA_CHECK(cudaGetDevice(&m.device));

  {
    std::array<cudnnConvolutionFwdAlgoPerf_t, CUDNN_CONVOLUTION_FWD_ALGO_COUNT> perf{};
    int count = 0;
    CUDNN_CHECK(cudnnGetConvolutionForwardAlgorithm_v7(handle, m.x, m.w, m.fwd, m.y,
                                                       static_cast<int>(perf.size()), &count,
                                                       perf.data()));
    const auto& p = pick(perf.data(), count, tf32, deterministic, fwd_name, "forward",
                         who, s.n);
    m.fwd_algo = p.algo;
    adopt(m.fwd, p.mathType);
    CUDNN_CHECK(cudnnGetConvolutionForwardWorkspaceSize(handle, m.x, m.w, m.fwd, m.y, m.fwd_algo,
                                                        &m.fwd_ws));
    if (m.fwd_ws > workspace) m.own_bytes[0] = m.fwd_ws;
  }
  {
    std::array<cudnnConvolutionBwdDataAlgoPerf_t, CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT> perf{};
    int count = 0;
    CUDNN_CHECK(cudnnGetConvolutionBackwardDataAlgorithm_v7(handle, m.w, m.y, m.bwd_data, m.x,
                                                            static_cast<int>(perf.size()), &count,
                                                            perf.data()));
    const auto& p = pick(perf.data(), count, tf32, deterministic, bwd_data_name,
                         "backward-data", who, s.n);
    m.bwd_data_algo = p.algo;
    adopt(m.bwd_data, p.mathType);
    CUDNN_CHECK(cudnnGetConvolutionBackwardDataWorkspaceSize(handle, m.w, m.y, m.bwd_data, m.x,
                                                             m.bwd_data_algo, &m.bwd_data_ws));
    if (m.bwd_data_ws > workspace) m.own_bytes[1] = m.bwd_data_ws;
  }
  {
    std::array<cudnnConvolutionBwdFilterAlgoPerf_t, CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT> perf{};
    int count = 0;
    CUDNN_CHECK(cudnnGetConvolutionBackwardFilterAlgorithm_v7(handle, m.x, m.y, m.bwd_filter, m.w,
                                                              static_cast<int>(perf.size()),
                                                              &count, perf.data()));
    const auto& p = pick(perf.data(), count, tf32, deterministic, bwd_filter_name,
                         "backward-filter", who, s.n);
    m.bwd_filter_algo = p.algo;
    adopt(m.bwd_filter, p.mathType);
    CUDNN_CHECK(cudnnGetConvolutionBackwardFilterWorkspaceSize(
        handle, m.x, m.y, m.bwd_filter, m.w, m.bwd_filter_algo, &m.bwd_filter_ws));
    if (m.bwd_filter_ws > workspace) m.own_bytes[2] = m.bwd_filter_ws;
  }
}

CudnnConv::~CudnnConv() = default;

size_t CudnnConv::workspace_bytes() const {
  const Impl& m = *impl_;
  return std::max({m.own_bytes[0] ? 0 : m.fwd_ws, m.own_bytes[1] ? 0 : m.bwd_data_ws,
                   m.own_bytes[2] ? 0 : m.bwd_filter_ws});
}

size_t CudnnConv::own_workspace_bytes() const {
  const Impl& m = *impl_;
  return m.own_bytes[0] + m.own_bytes[1] + m.own_bytes[2];
}

std::string CudnnConv::algorithms() const {
  const Impl& m = *impl_;
  const auto ws = [&](int direction, size_t bytes) {
    return mib(bytes) + (m.own_bytes[direction] != 0 ? ", its own" : "");
  };
  return fmt::format("forward {} ({}), backward-data {} ({}), backward-filter {} ({})",
                     fwd_name(m.fwd_algo), ws(0, m.fwd_ws), bwd_data_name(m.bwd_data_algo),
                     ws(1, m.bwd_data_ws), bwd_filter_name(m.bwd_filter_algo),
                     ws(2, m.bwd_filter_ws));
}

void CudnnConv::forward(const float* x, const float* w, float* y, void* ws) const {
  const Impl& m = *impl_;
  const float one = 1.0f, zero = 0.0f;
  CUDNN_CHECK(cudnnConvolutionForward(m.handle, &one, m.x, x, m.w, w, m.fwd, m.fwd_algo,
                                      m.workspace(0, ws, m.handle), m.fwd_ws, &zero, m.y, y));
}

void CudnnConv::backward_filter(const float* x, const float* dy, float* dw, void* ws,
                                cudnnContext* on) const {
  const Impl& m = *impl_;
  const float one = 1.0f, zero = 0.0f;
  cudnnHandle_t h = on != nullptr ? on : m.handle;
  CUDNN_CHECK(cudnnConvolutionBackwardFilter(h, &one, m.x, x, m.y, dy, m.bwd_filter,
                                             m.bwd_filter_algo, m.workspace(2, ws, h),
                                             m.bwd_filter_ws, &zero, m.w, dw));
}

void CudnnConv::backward_data(const float* w, const float* dy, float* dx, void* ws) const {
  const Impl& m = *impl_;
  const float one = 1.0f, zero = 0.0f;
  CUDNN_CHECK(cudnnConvolutionBackwardData(m.handle, &one, m.w, w, m.y, dy, m.bwd_data,
                                           m.bwd_data_algo, m.workspace(1, ws, m.handle),
                                           m.bwd_data_ws, &zero, m.x, dx));
}

}  // namespace towers
