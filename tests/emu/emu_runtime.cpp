// emu_runtime.cpp — the CUDA runtime, cuBLAS handle and NCCL calls towers makes, on the host.
// See emu_runtime.h for what the emulator is and is not. Beyond executing, it checks the
// rules a real GPU enforces and towers must respect: copies stay inside live allocations,
// nothing synchronises or allocates while a stream is being captured, captured copies touch
// only page-locked host memory, and a capture ends on the stream that began it.
#include "tests/emu/emu_runtime.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include <nccl.h>

struct CUstream_st {
  int device = 0;
};
struct CUevent_st {
  int unused = 0;
};
struct CUgraph_st {
  std::vector<std::function<void()>> ops;
};
struct CUgraphExec_st {
  std::vector<std::function<void()>> ops;
};
struct cublasContext {
  cudaStream_t stream = nullptr;
  bool tf32 = false;
};
struct ncclComm {
  int rank = 0, size = 1;
};

namespace {

std::mutex mu;                          // guards the tables below
std::map<const char*, size_t> device_;  // device allocation -> bytes
std::map<const char*, size_t> pinned_;  // page-locked host range -> bytes
thread_local int current_device = 0;
thread_local cudaError_t last_error = cudaSuccess;
thread_local CUgraph_st* capture = nullptr;  // the graph this thread is recording
thread_local cudaStream_t capture_origin = nullptr;

int device_count() {
  const char* env = std::getenv("TOWERS_EMU_GPUS");
  const int n = env ? std::atoi(env) : 1;
  return std::clamp(n, 0, 16);
}

cudaError_t fail(cudaError_t e) {
  last_error = e;
  return e;
}

// [p, p + bytes) inside one table entry?
bool inside(const std::map<const char*, size_t>& table, const void* p, size_t bytes) {
  const char* c = static_cast<const char*>(p);
  auto it = table.upper_bound(c);
  if (it == table.begin()) return false;
  --it;
  return c >= it->first && c + bytes <= it->first + it->second;
}

bool overlaps(const std::map<const char*, size_t>& table, const void* p, size_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (const auto& [q, n] : table)
    if (c < q + n && q < c + bytes) return true;
  return false;
}

// The checks of one copy: device sides inside a live allocation; while capturing, host sides
// page-locked (a graph cannot hold a copy to or from pageable memory).
cudaError_t check_copy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  std::lock_guard<std::mutex> l(mu);
  const bool dst_dev = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
  const bool src_dev = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
  if (kind == cudaMemcpyDefault || kind == cudaMemcpyHostToHost) return cudaSuccess;
  if (dst_dev && !inside(device_, dst, bytes)) return cudaErrorInvalidValue;
  if (src_dev && !inside(device_, src, bytes)) return cudaErrorInvalidValue;
  if (capture != nullptr) {
    if (!dst_dev && !inside(pinned_, dst, bytes)) return cudaErrorStreamCaptureUnsupported;
    if (!src_dev && !inside(pinned_, src, bytes)) return cudaErrorStreamCaptureUnsupported;
  }
  return cudaSuccess;
}

}  // namespace

namespace towers::emu {

void submit(cudaStream_t, std::function<void()> work) {
  if (capture != nullptr)
    capture->ops.push_back(std::move(work));
  else
    work();
}

cudaStream_t stream_of(cublasHandle_t h) { return h->stream; }
bool tf32(cublasHandle_t h) { return h->tf32; }
bool capturing() { return capture != nullptr; }
bool on_device(const void* p, size_t bytes) {
  std::lock_guard<std::mutex> l(mu);
  return inside(device_, p, bytes);
}

}  // namespace towers::emu

// ---- devices ---------------------------------------------------------------------------------
cudaError_t cudaGetDeviceCount(int* count) {
  *count = device_count();
  return *count > 0 ? cudaSuccess : fail(cudaErrorNoDevice);
}
cudaError_t cudaGetDevice(int* device) {
  *device = current_device;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= device_count()) return fail(cudaErrorInvalidDevice);
  current_device = device;
  return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (device < 0 || device >= device_count()) return fail(cudaErrorInvalidDevice);
  *prop = cudaDeviceProp{};
  std::snprintf(prop->name, sizeof(prop->name), "towers CUDA emulator (host)");
  prop->totalGlobalMem = size_t{8} << 30;
  prop->major = 9;
  prop->minor = 0;
  prop->multiProcessorCount = 1;
  return cudaSuccess;
}
cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total) {
  *total = size_t{8} << 30;
  *free_bytes = *total;
  return cudaSuccess;
}
cudaError_t cudaDriverGetVersion(int* v) {
  *v = CUDART_VERSION;
  return cudaSuccess;
}
cudaError_t cudaRuntimeGetVersion(int* v) {
  *v = CUDART_VERSION;
  return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize() {
  return capture ? fail(cudaErrorStreamCaptureUnsupported) : cudaSuccess;
}
cudaError_t cudaGetLastError() {
  cudaError_t e = last_error;
  last_error = cudaSuccess;
  return e;
}
const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorStreamCaptureUnsupported: return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureUnmatched: return "capture was not initiated in this stream";
    case cudaErrorHostMemoryAlreadyRegistered: return "part or all of the requested memory range is already mapped";
    default: return "emulated CUDA error";
  }
}
const char* cudaGetErrorName(cudaError_t e) {
  return e == cudaSuccess ? "cudaSuccess" : "cudaErrorEmulated";
}

// ---- memory ----------------------------------------------------------------------------------
cudaError_t cudaMalloc(void** p, size_t bytes) {
  if (capture) return fail(cudaErrorStreamCaptureUnsupported);
  void* q = std::aligned_alloc(256, (std::max<size_t>(bytes, 1) + 255) / 256 * 256);
  if (q == nullptr) return fail(cudaErrorMemoryAllocation);
  std::memset(q, 0xA5, bytes);  // never zero by accident: towers must clear what it reads
  std::lock_guard<std::mutex> l(mu);
  device_[static_cast<const char*>(q)] = bytes;
  *p = q;
  return cudaSuccess;
}
cudaError_t cudaFree(void* p) {
  if (capture) return fail(cudaErrorStreamCaptureUnsupported);
  if (p == nullptr) return cudaSuccess;
  std::lock_guard<std::mutex> l(mu);
  auto it = device_.find(static_cast<const char*>(p));
  if (it == device_.end()) return fail(cudaErrorInvalidValue);
  device_.erase(it);
  std::free(p);
  return cudaSuccess;
}
cudaError_t cudaMallocHost(void** p, size_t bytes) {
  void* q = std::aligned_alloc(4096, (std::max<size_t>(bytes, 1) + 4095) / 4096 * 4096);
  if (q == nullptr) return fail(cudaErrorMemoryAllocation);
  std::lock_guard<std::mutex> l(mu);
  pinned_[static_cast<const char*>(q)] = bytes;
  *p = q;
  return cudaSuccess;
}
cudaError_t cudaFreeHost(void* p) {
  std::lock_guard<std::mutex> l(mu);
  pinned_.erase(static_cast<const char*>(p));
  std::free(p);
  return cudaSuccess;
}
cudaError_t cudaHostRegister(void* p, size_t bytes, unsigned int) {
  std::lock_guard<std::mutex> l(mu);
  if (overlaps(pinned_, p, bytes)) return fail(cudaErrorHostMemoryAlreadyRegistered);
  pinned_[static_cast<const char*>(p)] = bytes;
  return cudaSuccess;
}
cudaError_t cudaHostUnregister(void* p) {
  std::lock_guard<std::mutex> l(mu);
  return pinned_.erase(static_cast<const char*>(p)) ? cudaSuccess : fail(cudaErrorInvalidValue);
}
cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  if (capture) return fail(cudaErrorStreamCaptureUnsupported);
  if (cudaError_t e = check_copy(dst, src, bytes, kind)) return fail(e);
  if (bytes > 0) std::memcpy(dst, src, bytes);  // a 0-byte copy may name null pointers
  return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t s) {
  if (cudaError_t e = check_copy(dst, src, bytes, kind)) return fail(e);
  if (bytes > 0) towers::emu::submit(s, [=] { std::memcpy(dst, src, bytes); });
  return cudaSuccess;
}
cudaError_t cudaMemset(void* p, int value, size_t bytes) {
  if (capture) return fail(cudaErrorStreamCaptureUnsupported);
  {
    std::lock_guard<std::mutex> l(mu);
    if (!inside(device_, p, bytes)) return fail(cudaErrorInvalidValue);
  }
  std::memset(p, value, bytes);
  return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t s) {
  {
    std::lock_guard<std::mutex> l(mu);
    if (!inside(device_, p, bytes)) return fail(cudaErrorInvalidValue);
  }
  towers::emu::submit(s, [=] { std::memset(p, value, bytes); });
  return cudaSuccess;
}

// ---- streams, events, graphs -----------------------------------------------------------------
cudaError_t cudaStreamCreate(cudaStream_t* s) {
  *s = new CUstream_st{current_device};
  return cudaSuccess;
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned int) { return cudaStreamCreate(s); }
cudaError_t cudaStreamDestroy(cudaStream_t s) {
  delete s;
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t) {
  // Work has run as it was issued; a synchronisation inside a capture is an error on a GPU.
  return capture ? fail(cudaErrorStreamCaptureUnsupported) : cudaSuccess;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned int) {
  *e = new CUevent_st{};
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t e) {
  delete e;
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t) {
  return e ? cudaSuccess : fail(cudaErrorInvalidValue);
}
cudaError_t cudaStreamWaitEvent(cudaStream_t, cudaEvent_t e, unsigned int) {
  return e ? cudaSuccess : fail(cudaErrorInvalidValue);
}
cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode) {
  if (capture) return fail(cudaErrorStreamCaptureUnsupported);
  capture = new CUgraph_st{};
  capture_origin = s;
  return cudaSuccess;
}
cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t* g) {
  if (!capture || s != capture_origin) return fail(cudaErrorStreamCaptureUnmatched);
  *g = capture;
  capture = nullptr;
  capture_origin = nullptr;
  return cudaSuccess;
}
cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t g, unsigned long long) {
  if (g == nullptr) return fail(cudaErrorInvalidValue);
  *exec = new CUgraphExec_st{g->ops};
  return cudaSuccess;
}
cudaError_t cudaGraphDestroy(cudaGraph_t g) {
  delete g;
  return cudaSuccess;
}
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t e) {
  delete e;
  return cudaSuccess;
}
cudaError_t cudaGraphLaunch(cudaGraphExec_t e, cudaStream_t s) {
  if (e == nullptr) return fail(cudaErrorInvalidValue);
  towers::emu::submit(s, [e] {
    for (const auto& op : e->ops) op();
  });
  return cudaSuccess;
}

// ---- cuBLAS handles (the GEMM itself is in emu_kernels.cpp) ----------------------------------
cublasStatus_t cublasCreate_v2(cublasHandle_t* h) {
  *h = new cublasContext{};
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasDestroy_v2(cublasHandle_t h) {
  delete h;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetStream_v2(cublasHandle_t h, cudaStream_t s) {
  h->stream = s;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetWorkspace_v2(cublasHandle_t, void* p, size_t bytes) {
  std::lock_guard<std::mutex> l(mu);
  return inside(device_, p, bytes) ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_INVALID_VALUE;
}
cublasStatus_t cublasSetMathMode(cublasHandle_t h, cublasMath_t mode) {
  h->tf32 = mode == CUBLAS_TF32_TENSOR_OP_MATH;
  return CUBLAS_STATUS_SUCCESS;
}
const char* cublasGetStatusString(cublasStatus_t s) {
  return s == CUBLAS_STATUS_SUCCESS ? "CUBLAS_STATUS_SUCCESS" : "CUBLAS_STATUS_EMULATED_ERROR";
}

// ---- NCCL: a single-process all-reduce over the emulated devices -----------------------------
namespace {
struct PendingReduce {
  const float* send;
  float* recv;
  size_t count;
  int rank;
};
std::vector<PendingReduce> group;
int group_depth = 0;

void run_group() {
  // Ranks summed in rank order, the same sum written to every rank.
  std::sort(group.begin(), group.end(),
            [](const PendingReduce& a, const PendingReduce& b) { return a.rank < b.rank; });
  if (group.empty()) return;
  const size_t n = group[0].count;
  std::vector<float> sum(group[0].send, group[0].send + n);
  for (size_t r = 1; r < group.size(); ++r)
    for (size_t i = 0; i < n; ++i) sum[i] += group[r].send[i];
  for (const auto& p : group) std::memcpy(p.recv, sum.data(), n * sizeof(float));
  group.clear();
}
}  // namespace

ncclResult_t ncclCommInitAll(ncclComm_t* comms, int ndev, const int* devlist) {
  for (int i = 0; i < ndev; ++i) {
    for (int j = 0; j < i; ++j)
      if (devlist[i] == devlist[j]) return ncclInvalidUsage;  // as NCCL: one rank per GPU
    if (devlist[i] < 0 || devlist[i] >= device_count()) return ncclInvalidArgument;
    comms[i] = new ncclComm{i, ndev};
  }
  return ncclSuccess;
}
ncclResult_t ncclCommFinalize(ncclComm_t) { return ncclSuccess; }
ncclResult_t ncclCommDestroy(ncclComm_t c) {
  delete c;
  return ncclSuccess;
}
const char* ncclGetErrorString(ncclResult_t r) {
  return r == ncclSuccess ? "no error" : "emulated NCCL error";
}
ncclResult_t ncclGroupStart() {
  ++group_depth;
  return ncclSuccess;
}
ncclResult_t ncclGroupEnd() {
  if (--group_depth == 0) run_group();
  return ncclSuccess;
}
ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count, ncclDataType_t type,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t) {
  if (type != ncclFloat || op != ncclSum) return ncclInvalidArgument;
  group.push_back({static_cast<const float*>(send), static_cast<float*>(recv), count, comm->rank});
  if (group_depth == 0) run_group();
  return ncclSuccess;
}
