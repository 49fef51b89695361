#include "core/cudnn_conv.h"

#include <cuda_runtime.h>
#include <cudnn.h>
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <map>
#include <memory>
#include <mutex>

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

// What a plan may choose: the precision asked for (tf32), whether the algorithm must be
// deterministic, and whether it must be of the GEMM family (--cudnn-gemm-only).
struct Rules {
  bool tf32 = false;
  bool deterministic = true;
  bool gemm_only = false;
};

// The GEMM family: algorithms that compute each output as a sum of products of the inputs
// themselves, as the CPU tower does, so that they round as a GEMM does. The others transform
// the operands (FFT, Winograd) and round in the transformed domain: in FP32 their results lie
// about 1e-3 from a GEMM's, relative (up to 3e-2 seen), where two GEMM orders lie about 1e-6.
bool gemm_family(cudnnConvolutionFwdAlgo_t a) {
  return a == CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM ||
         a == CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM ||
         a == CUDNN_CONVOLUTION_FWD_ALGO_GEMM || a == CUDNN_CONVOLUTION_FWD_ALGO_DIRECT;
}
bool gemm_family(cudnnConvolutionBwdDataAlgo_t a) {
  return a == CUDNN_CONVOLUTION_BWD_DATA_ALGO_0 || a == CUDNN_CONVOLUTION_BWD_DATA_ALGO_1;
}
bool gemm_family(cudnnConvolutionBwdFilterAlgo_t a) {
  return a == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0 || a == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1 ||
         a == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3;
}

// Whether cuDNN's ranked entry may be used at all: it ran, is deterministic (unless any will
// do), keeps to the precision asked for (FP32: no tensor-op math; never ALLOW_CONVERSION,
// which may compute in FP16 or BF16) and, with --cudnn-gemm-only, is of the GEMM family.
template <class Perf>
bool usable(const Perf& p, const Rules& r) {
  if (p.status != CUDNN_STATUS_SUCCESS) return false;
  if (r.deterministic && p.determinism != CUDNN_DETERMINISTIC) return false;
  if (r.gemm_only && !gemm_family(p.algo)) return false;
  if (p.mathType == CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION) return false;
  return r.tf32 || p.mathType != CUDNN_TENSOR_OP_MATH;
}

// Whether a plan may take the entry: usable, within kOwnWorkspaceLimit.
template <class Perf>
bool allowed(const Perf& p, const Rules& r) {
  return usable(p, r) && p.memory <= kOwnWorkspaceLimit;
}

// The first usable entry of cuDNN's ranking (its order is its estimate of speed, or with
// --cudnn-benchmark the times cudnnFind*AlgorithmEx measured) that needs at
// most kOwnWorkspaceLimit; it runs in the workspace offered (the layer's scratch) where it
// fits, else in a workspace of the plan's own. cuDNN's deterministic backward-filter
// algorithms often need a little more than the im2col buffer the scratch is sized by (conv1 of
// cifar10 at batch 128 with TF32 on an H100: ALGO_1 wants 21.2 MiB of a 21.1 MiB scratch, and
// every other deterministic one more). A towers::Error listing the ranking if nothing is usable.
template <class Perf, class Name>
const Perf& pick(const Perf* perf, int count, const Rules& r, Name name, const char* direction,
                 const std::string& who, int64_t n) {
  for (int i = 0; i < count; ++i)
    if (allowed(perf[i], r)) return perf[i];
  std::string seen;
  for (int i = 0; i < count; ++i)
    seen += fmt::format("{}{} ({}, {}{})", i ? ", " : "", name(perf[i].algo),
                        perf[i].determinism == CUDNN_DETERMINISTIC ? "deterministic"
                                                                    : "not deterministic",
                        mib(perf[i].memory),
                        perf[i].status == CUDNN_STATUS_SUCCESS ? "" : ", not supported");
  TOWERS_BAD_INPUT(
      "{}: cuDNN has no {}{}{} algorithm for this shape (batch {}) within {} of "
      "workspace{}; its ranking: {}; use --conv im2col",
      who, r.deterministic ? "deterministic " : "", r.gemm_only ? "GEMM-family " : "", direction, n,
      mib(kOwnWorkspaceLimit), r.tf32 ? "" : " in FP32", seen.empty() ? "empty" : seen);
}

// A plan's set-up and first calls allocate and (with --cudnn-benchmark) run kernels: never
// inside a capture of the handle's stream, where they would be recorded or refused.
void require_no_capture(cudnnHandle_t handle, const char* what) {
  cudaStream_t stream = nullptr;
  CUDNN_CHECK(cudnnGetStream(handle, &stream));
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  TOWERS_CHECK(status == cudaStreamCaptureStatusNone,
               "{} inside a CUDA graph capture (a tower's first step of a batch size must run "
               "eagerly)", what);
}

// --cudnn-benchmark: the device memory cudnnFind*AlgorithmEx runs a plan's candidates on: the
// layer's x, w and y (doubling as dx, dw and dy), taken from the GPU's pool at the first search
// and zeroed on the plan's stream (nothing reads uninitialised memory), and each search's
// workspace, given back to the pool after its search. The Find calls block the host until their
// kernels are done; the stream is synchronised before any of it goes back.
class Trial {
 public:
  Trial(int device, cudnnHandle_t handle, size_t x, size_t w, size_t y)
      : device_(device), sizes_{x, w, y} {
    require_no_capture(handle, "a cuDNN plan timed with --cudnn-benchmark is made");
    CUDNN_CHECK(cudnnGetStream(handle, &stream_));
  }
  ~Trial() {
    cudaStreamSynchronize(stream_);
    for (void* p : buffers_)
      if (p) CudaMemoryPool::of(device_).release(p);
  }
  Trial(const Trial&) = delete;
  Trial& operator=(const Trial&) = delete;
  // The layer's buffers: 0 x, 1 w, 2 y.
  void* buffer(int i) {
    if (buffers_[i] == nullptr) buffers_[i] = take(sizes_[i]);
    return buffers_[i];
  }
  // The workspace a search may offer at most: 1 GiB, and a quarter of what the GPU has free.
  size_t room() const {
    size_t free = 0, total = 0;
    CUDA_CHECK(cudaMemGetInfo(&free, &total));
    return std::min(kOwnWorkspaceLimit, free / 4);
  }
  // Runs search(workspace, bytes) with a workspace of `bytes`, then gives it back.
  template <class Search>
  void with_workspace(size_t bytes, Search search) {
    void* ws = take(bytes);
    try {
      search(ws, bytes);
    } catch (...) {
      give_back(ws);
      throw;
    }
    give_back(ws);
  }

 private:
  void* take(size_t bytes) {
    if (bytes == 0) return nullptr;
    void* p = CudaMemoryPool::of(device_).allocate(bytes);
    CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, stream_));
    return p;
  }
  void give_back(void* p) {
    if (p == nullptr) return;
    cudaStreamSynchronize(stream_);
    CudaMemoryPool::of(device_).release(p);
  }
  int device_;
  std::array<size_t, 3> sizes_;
  std::array<void*, 3> buffers_{};
  cudaStream_t stream_ = nullptr;
};

// The workspace a timed search offers: as much as the largest algorithm of the heuristic
// ranking that pick could take (allowed), up to what the trial has room for; a candidate that
// wants more fails its trial and is passed over.
template <class Perf>
size_t search_workspace(const Perf* perf, int count, const Rules& r) {
  size_t most = 0;
  for (int i = 0; i < count; ++i)
    if (allowed(perf[i], r)) most = std::max(most, perf[i].memory);
  return most;
}

// Timed choices, for the process: every tower that plans the same shape on the same GPU with
// the same rules takes the first search's result, and searches run one at a time, so towers
// that share a GPU do not time their candidates against each other's kernels.
struct TimedChoice {
  int algo;
  cudnnMathType_t math;
  float ms;
};
std::mutex search_mu;
std::map<std::string, TimedChoice> searched;

// One direction's algorithm: the first usable entry of cuDNN's heuristic ranking (rank), or
// with a trial of the fastest usable one that cudnnFind*AlgorithmEx timed (find), falling back
// to the ranking where no timed entry is usable. *ms: the measured time of a timed choice, or
// -1 for a ranked one.
template <class Perf, class Rank, class Find, class Name>
Perf choose(Rank rank, Find find, Trial* trial, const std::string& key, const Rules& r, Name name,
            const char* direction, const std::string& who, int64_t n, float* ms) {
  std::array<Perf, 16> ranked{};
  int count = 0;
  rank(static_cast<int>(ranked.size()), &count, ranked.data());
  *ms = -1.0f;
  if (trial != nullptr) {
    std::lock_guard<std::mutex> l(search_mu);
    auto hit = searched.find(key);
    if (hit == searched.end()) {
      std::array<Perf, 16> timed{};
      int found = 0;
      const size_t ws = std::min(search_workspace(ranked.data(), count, r), trial->room());
      trial->with_workspace(ws, [&](void* space, size_t bytes) {
        find(static_cast<int>(timed.size()), &found, timed.data(), space, bytes);
      });
      for (int i = 0; i < found && hit == searched.end(); ++i)
        if (allowed(timed[i], r))
          hit = searched.emplace(key, TimedChoice{static_cast<int>(timed[i].algo),
                                                  timed[i].mathType, timed[i].time})
                    .first;
    }
    if (hit != searched.end()) {
      Perf p{};
      p.algo = static_cast<decltype(p.algo)>(hit->second.algo);
      p.mathType = hit->second.math;
      *ms = hit->second.ms;
      return p;
    }
  }
  return pick(ranked.data(), count, r, name, direction, who, n);
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
  // Per direction, the measured time (ms) of an algorithm chosen by timing it
  // (--cudnn-benchmark), or -1 where the heuristic ranking chose.
  std::array<float, 3> ms{-1.0f, -1.0f, -1.0f};
  bool benchmarked = false;  // --cudnn-benchmark
  std::array<size_t, 3> own_bytes{};
  mutable std::array<void*, 3> own{};

  void* workspace(int direction, void* scratch, cudnnHandle_t on) const {
    if (own_bytes[direction] == 0) return scratch;
    if (own[direction] == nullptr) {
      require_no_capture(on, "a cuDNN plan's first call, which allocates its workspace, is");
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
                     const std::string& who, const CudnnRules& cudnn)
    : impl_(std::make_unique<Impl>()) {
  const bool deterministic = !cudnn.nondeterministic, benchmark = cudnn.benchmark,
             gemm_only = cudnn.gemm_only;
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
  m.benchmarked = benchmark;
  const Rules rules{tf32, deterministic, gemm_only};
  // --cudnn-benchmark: each direction's candidates timed on buffers of the layer's shapes, in
  // place of the heuristic ranking (choose), once per shape, GPU and rules in the process.
  std::unique_ptr<Trial> trial;
  if (benchmark) {
    const auto bytes = [](int64_t floats) { return sizeof(float) * static_cast<size_t>(floats); };
    trial = std::make_unique<Trial>(
        m.device, handle, bytes(s.n * g.channels * g.height * g.width),
        bytes(s.out_channels * g.channels * g.rows.k * g.cols.k),
        bytes(s.n * s.out_channels * g.rows.out * g.cols.out));
  }
  const auto key = [&](const char* direction) {
    return fmt::format(
        "{} {} n{} c{} {}x{} k{} {}x{} pad {},{} stride {},{} tf32 {} det {} gemm {}", m.device,
        direction, s.n, g.channels, g.height, g.width, s.out_channels, g.rows.k, g.cols.k,
        g.rows.pad_before, g.cols.pad_before, g.rows.stride, g.cols.stride, tf32, deterministic,
        gemm_only);
  };
  Trial* t = trial.get();
  {
    const auto p = choose<cudnnConvolutionFwdAlgoPerf_t>(
        [&](int k, int* count, cudnnConvolutionFwdAlgoPerf_t* perf) {
          CUDNN_CHECK(cudnnGetConvolutionForwardAlgorithm_v7(handle, m.x, m.w, m.fwd, m.y, k,
                                                             count, perf));
        },
        [&](int k, int* count, cudnnConvolutionFwdAlgoPerf_t* perf, void* ws, size_t bytes) {
          CUDNN_CHECK(cudnnFindConvolutionForwardAlgorithmEx(
              handle, m.x, t->buffer(0), m.w, t->buffer(1), m.fwd, m.y, t->buffer(2), k, count,
              perf, ws, bytes));
        },
        t, key("forward"), rules, fwd_name, "forward", who, s.n, &m.ms[0]);
    m.fwd_algo = p.algo;
    adopt(m.fwd, p.mathType);
    CUDNN_CHECK(cudnnGetConvolutionForwardWorkspaceSize(handle, m.x, m.w, m.fwd, m.y, m.fwd_algo,
                                                        &m.fwd_ws));
    if (m.fwd_ws > workspace) m.own_bytes[0] = m.fwd_ws;
  }
  {
    const auto p = choose<cudnnConvolutionBwdDataAlgoPerf_t>(
        [&](int k, int* count, cudnnConvolutionBwdDataAlgoPerf_t* perf) {
          CUDNN_CHECK(cudnnGetConvolutionBackwardDataAlgorithm_v7(handle, m.w, m.y, m.bwd_data,
                                                                  m.x, k, count, perf));
        },
        [&](int k, int* count, cudnnConvolutionBwdDataAlgoPerf_t* perf, void* ws, size_t bytes) {
          CUDNN_CHECK(cudnnFindConvolutionBackwardDataAlgorithmEx(
              handle, m.w, t->buffer(1), m.y, t->buffer(2), m.bwd_data, m.x, t->buffer(0), k,
              count, perf, ws, bytes));
        },
        t, key("backward-data"), rules, bwd_data_name, "backward-data", who, s.n, &m.ms[1]);
    m.bwd_data_algo = p.algo;
    adopt(m.bwd_data, p.mathType);
    CUDNN_CHECK(cudnnGetConvolutionBackwardDataWorkspaceSize(handle, m.w, m.y, m.bwd_data, m.x,
                                                             m.bwd_data_algo, &m.bwd_data_ws));
    if (m.bwd_data_ws > workspace) m.own_bytes[1] = m.bwd_data_ws;
  }
  {
    const auto p = choose<cudnnConvolutionBwdFilterAlgoPerf_t>(
        [&](int k, int* count, cudnnConvolutionBwdFilterAlgoPerf_t* perf) {
          CUDNN_CHECK(cudnnGetConvolutionBackwardFilterAlgorithm_v7(handle, m.x, m.y,
                                                                    m.bwd_filter, m.w, k, count,
                                                                    perf));
        },
        [&](int k, int* count, cudnnConvolutionBwdFilterAlgoPerf_t* perf, void* ws, size_t bytes) {
          CUDNN_CHECK(cudnnFindConvolutionBackwardFilterAlgorithmEx(
              handle, m.x, t->buffer(0), m.y, t->buffer(2), m.bwd_filter, m.w, t->buffer(1), k,
              count, perf, ws, bytes));
        },
        t, key("backward-filter"), rules, bwd_filter_name, "backward-filter", who, s.n, &m.ms[2]);
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
    std::string how;
    if (m.benchmarked)
      how = m.ms[direction] >= 0.0f ? fmt::format(", {:.3f} ms", m.ms[direction]) : ", ranked";
    return mib(bytes) + (m.own_bytes[direction] != 0 ? ", its own" : "") + how;
  };
  return fmt::format("{}forward {} ({}), backward-data {} ({}), backward-filter {} ({})",
                     m.benchmarked ? "timed: " : "", fwd_name(m.fwd_algo), ws(0, m.fwd_ws),
                     bwd_data_name(m.bwd_data_algo), ws(1, m.bwd_data_ws),
                     bwd_filter_name(m.bwd_filter_algo), ws(2, m.bwd_filter_ws));
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
