#include "core/cuda_device.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include <cudnn.h>
#include <fmt/format.h>

#include "core/cuda_check.h"
#include "core/gpu.h"
#include "kernels/debug.h"

namespace towers {

namespace {
constexpr size_t kSmall = 1 << 20;           // blocks up to 1 MiB round to 512 B
constexpr size_t kLargeUnit = 2 << 20;       // larger ones to 2 MiB
constexpr size_t kBlasWorkspace = 32 << 20;  // fixed cuBLAS workspace: graph capture safe
double mib(int64_t b) { return static_cast<double>(b) / (1 << 20); }

// Makes a GPU current for a scope and restores the caller's, also when the scope throws.
class CurrentDevice {
 public:
  explicit CurrentDevice(int ordinal) {
    CUDA_CHECK(cudaGetDevice(&prev_));
    CUDA_CHECK(cudaSetDevice(ordinal));
  }
  ~CurrentDevice() { cudaSetDevice(prev_); }
  CurrentDevice(const CurrentDevice&) = delete;
  CurrentDevice& operator=(const CurrentDevice&) = delete;

 private:
  int prev_ = 0;
};
}  // namespace

// ---- memory pool ---------------------------------------------------------------------------
CudaMemoryPool& CudaMemoryPool::of(int ordinal) {
  static std::mutex mu;
  // Never destroyed: blocks may outlive static destruction order, and the driver reclaims
  // device memory at process exit anyway.
  static auto* pools = new std::vector<std::unique_ptr<CudaMemoryPool>>();
  std::lock_guard<std::mutex> l(mu);
  if (static_cast<int>(pools->size()) <= ordinal) pools->resize(ordinal + 1);
  auto& p = (*pools)[ordinal];
  if (!p) p.reset(new CudaMemoryPool(ordinal));
  return *p;
}

size_t CudaMemoryPool::round_up(size_t bytes) {
  if (bytes == 0) bytes = 1;
  if (bytes <= kSmall) return (bytes + 511) / 512 * 512;
  return (bytes + kLargeUnit - 1) / kLargeUnit * kLargeUnit;
}

void* CudaMemoryPool::allocate(size_t bytes) {
  const size_t want = round_up(bytes);
  std::lock_guard<std::mutex> l(mu_);
  auto it = free_.lower_bound(want);
  if (it != free_.end() && it->first <= 2 * want) {
    void* p = it->second;
    const size_t size = it->first;
    free_.erase(it);
    live_[p] = size;
    in_use_ += static_cast<int64_t>(size);
    return p;
  }
  void* p = nullptr;
  cudaError_t e;
  {
    CurrentDevice on(ordinal_);
    e = cudaMalloc(&p, want);
    if (e == cudaErrorMemoryAllocation) {
      // Only at set-up (every tower allocates before its first step): returning the cache
      // synchronises the device, which a running step must never see.
      cudaGetLastError();
      trim_locked();
      e = cudaMalloc(&p, want);
    }
  }
  if (e != cudaSuccess) {
    cudaGetLastError();
    TOWERS_SYSTEM_FAIL("cuda:{}: cannot allocate {:.1f} MiB of GPU memory ({:.1f} MiB already in use "
                "by towers on it): {}",
                ordinal_, mib(static_cast<int64_t>(want)), mib(in_use_), cudaGetErrorString(e));
  }
  live_[p] = want;
  in_use_ += static_cast<int64_t>(want);
  return p;
}

void CudaMemoryPool::release(void* p) {
  if (p == nullptr) return;
  std::lock_guard<std::mutex> l(mu_);
  auto it = live_.find(p);
  TOWERS_CHECK(it != live_.end(), "cuda:{}: releasing a block this pool did not allocate",
               ordinal_);
  free_.emplace(it->second, p);
  in_use_ -= static_cast<int64_t>(it->second);
  live_.erase(it);
}

void CudaMemoryPool::trim_locked() {
  CurrentDevice on(ordinal_);
  for (auto& [size, p] : free_) cudaFree(p);
  free_.clear();
}

// ---- device --------------------------------------------------------------------------------
CudaDevice::CudaDevice(int ordinal, bool tf32) : ordinal_(ordinal), tf32_(tf32) {
  int count = 0;
  CUDA_CHECK(cudaGetDeviceCount(&count));
  TOWERS_CHECK(ordinal >= 0 && ordinal < count, "cuda:{} does not exist ({} GPU(s) found)",
               ordinal, count);
  activate();
  if (const std::string why = kernels::cuda::device_code_missing(); !why.empty()) {
    cudaDeviceProp prop{};
    cudaGetDeviceProperties(&prop, ordinal);
    TOWERS_BAD_INPUT("cuda:{} ({}, compute capability {}.{}): this towers has no GPU code for it "
                     "({}); it was built for CUDA architectures {}: rebuild with "
                     "-DCMAKE_CUDA_ARCHITECTURES={}{}",
                     ordinal, prop.name, prop.major, prop.minor, why, TOWERS_CUDA_ARCHITECTURES,
                     prop.major, prop.minor);
  }
  CUDA_CHECK(cudaStreamCreateWithFlags(&compute_, cudaStreamNonBlocking));
  CUDA_CHECK(cudaStreamCreateWithFlags(&copy_, cudaStreamNonBlocking));
  blas_ = blas_on(compute_, &blas_workspace_);
}

// A cuBLAS handle bound to stream, with this device's math mode and a workspace of its own
// (*workspace): cuBLAS then never allocates during a call, which CUDA graph capture requires.
// Every handle gets the same workspace size, so every handle picks the same kernels.
cublasHandle_t CudaDevice::blas_on(cudaStream_t stream, void** workspace) {
  cublasHandle_t h = nullptr;
  CUBLAS_CHECK(cublasCreate(&h));
  CUBLAS_CHECK(cublasSetStream(h, stream));
  *workspace = CudaMemoryPool::of(ordinal_).allocate(kBlasWorkspace);
  CUBLAS_CHECK(cublasSetWorkspace(h, *workspace, kBlasWorkspace));
  CUBLAS_CHECK(cublasSetMathMode(h, tf32_ ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH));
  return h;
}

CudaDevice::~CudaDevice() {
  cudaSetDevice(ordinal_);
  if (compute_) cudaStreamSynchronize(compute_);
  if (copy_) cudaStreamSynchronize(copy_);
  if (lane_) cudaStreamSynchronize(lane_);
  if (blas_) cublasDestroy(blas_);
  if (dnn_) cudnnDestroy(dnn_);
  if (lane_blas_) cublasDestroy(lane_blas_);
  if (lane_dnn_) cudnnDestroy(lane_dnn_);
  if (blas_workspace_) CudaMemoryPool::of(ordinal_).release(blas_workspace_);
  if (lane_blas_workspace_) CudaMemoryPool::of(ordinal_).release(lane_blas_workspace_);
  if (compute_) cudaStreamDestroy(compute_);
  if (copy_) cudaStreamDestroy(copy_);
  if (lane_) cudaStreamDestroy(lane_);
}

namespace {
cudnnContext* cudnn_on(int ordinal, cudaStream_t stream) {
  cudnnHandle_t h = nullptr;
  cudnnStatus_t st = cudnnCreate(&h);
  if (st != CUDNN_STATUS_SUCCESS)
    TOWERS_SYSTEM_FAIL("cuda:{}: cudnnCreate failed: {} (GPU towers need cuDNN 9: "
                       "libcudnn.so.9 and its sub-libraries on the library path)",
                       ordinal, cudnnGetErrorString(st));
  st = cudnnSetStream(h, stream);
  if (st != CUDNN_STATUS_SUCCESS) {
    cudnnDestroy(h);
    TOWERS_SYSTEM_FAIL("cuda:{}: cudnnSetStream failed: {}", ordinal, cudnnGetErrorString(st));
  }
  return h;
}
}  // namespace

cudnnContext* CudaDevice::dnn() {
  if (dnn_ == nullptr) {
    activate();
    dnn_ = cudnn_on(ordinal_, compute_);
  }
  return dnn_;
}

void CudaDevice::make_lane() {
  if (lane_ != nullptr) return;
  activate();
  CUDA_CHECK(cudaStreamCreateWithFlags(&lane_, cudaStreamNonBlocking));
  // The main handle's workspace size and math mode: a branch computes the bits the main
  // stream would.
  lane_blas_ = blas_on(lane_, &lane_blas_workspace_);
  lane_dnn_ = cudnn_on(ordinal_, lane_);
}

GpuExec fork_lane(const GpuExec& e) {
  if (e.lane == nullptr) return e;
  const GpuLane& l = *e.lane;
  CUDA_CHECK(cudaEventRecord(l.fork, e.stream));
  CUDA_CHECK(cudaStreamWaitEvent(l.exec.stream, l.fork, 0));
  kernels::cuda::spin_delay(l.exec.stream, l.test_delay_ns);
  ++l.forks;
  return l.exec;
}

void join_lane(const GpuExec& e) {
  if (e.lane == nullptr) return;
  CUDA_CHECK(cudaEventRecord(e.lane->join, e.lane->exec.stream));
  CUDA_CHECK(cudaStreamWaitEvent(e.stream, e.lane->join, 0));
}

std::string CudaDevice::name() const {
  cudaDeviceProp p{};
  std::string n = cudaGetDeviceProperties(&p, ordinal_) == cudaSuccess ? p.name : "?";
  return fmt::format("cuda:{} ({}{})", ordinal_, n, tf32_ ? ", TF32" : "");
}

void CudaDevice::activate() const { CUDA_CHECK(cudaSetDevice(ordinal_)); }

float* CudaDevice::allocate(int64_t count) {
  const size_t bytes = static_cast<size_t>(std::max<int64_t>(count, 1)) * sizeof(float);
  void* p = CudaMemoryPool::of(ordinal_).allocate(bytes);
  activate();
  CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, compute_));
  CUDA_CHECK(cudaStreamSynchronize(compute_));
  return static_cast<float*>(p);
}

void CudaDevice::deallocate(float* p) {
  // Work queued on this tower's streams may still use the block.
  cudaStreamSynchronize(compute_);
  cudaStreamSynchronize(copy_);
  CudaMemoryPool::of(ordinal_).release(p);
}

void CudaDevice::copy_in(float* dst, const float* src, int64_t count) {
  activate();
  CUDA_CHECK(cudaMemcpyAsync(dst, src, sizeof(float) * count, cudaMemcpyHostToDevice, copy_));
  CUDA_CHECK(cudaStreamSynchronize(copy_));
}

void CudaDevice::copy_out(float* dst, const float* src, int64_t count) {
  activate();
  CUDA_CHECK(cudaStreamSynchronize(compute_));
  CUDA_CHECK(cudaMemcpyAsync(dst, src, sizeof(float) * count, cudaMemcpyDeviceToHost, copy_));
  CUDA_CHECK(cudaStreamSynchronize(copy_));
}

void CudaDevice::synchronize() {
  activate();
  CUDA_CHECK(cudaStreamSynchronize(compute_));
  CUDA_CHECK(cudaStreamSynchronize(copy_));
}

// ---- pinned host memory --------------------------------------------------------------------
PinnedBuffer::PinnedBuffer(size_t bytes) : bytes_(bytes) {
  CUDA_CHECK(cudaMallocHost(&p_, std::max<size_t>(bytes, 64)));
  std::memset(p_, 0, std::max<size_t>(bytes, 64));
}

PinnedBuffer::~PinnedBuffer() {
  if (p_ != nullptr) cudaFreeHost(p_);
}

const char* cublas_status_text(cublasStatus_t s) { return cublasGetStatusString(s); }

}  // namespace towers
