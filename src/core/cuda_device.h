// cuda_device.h — the CUDA device (DESIGN.md, decision 3), for CUDA builds only.
// A CudaDevice is one tower's view of one GPU: its own compute stream, copy stream, cuBLAS
// handle and (on demand) cuDNN handle, both handles bound to the compute stream, so several
// towers can share a GPU without sharing queues. Memory comes from one caching pool per GPU,
// shared by every tower on it: cudaMalloc and cudaFree synchronise the whole device, so they
// happen once at set-up, never per step.
// Ordering between the streams uses events, never a device-wide synchronisation.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "core/device.h"
#include "kernels/hd.h"  // cudnnContext

namespace towers {

// A caching allocator over cudaMalloc for one GPU (no managed memory). Sizes are rounded up
// (512 B for small blocks, 2 MiB for large), freed blocks are kept and reused by the next
// request they fit without wasting more than half; when cudaMalloc runs out, the cache is
// returned to the driver and the request retried once.
class CudaMemoryPool {
 public:
  static CudaMemoryPool& of(int ordinal);  // one per GPU, for the life of the process
  void* allocate(size_t bytes);            // throws towers::Error naming the GPU and sizes
  void release(void* p);

 private:
  explicit CudaMemoryPool(int ordinal) : ordinal_(ordinal) {}
  static size_t round_up(size_t bytes);
  void trim_locked();  // returns the cached blocks to the driver

  int ordinal_;
  std::mutex mu_;
  std::multimap<size_t, void*> free_;  // size -> block
  std::map<void*, size_t> live_;       // block -> size
  int64_t in_use_ = 0;  // bytes handed out, for the out-of-memory message
};

class CudaDevice final : public Device {
 public:
  CudaDevice(int ordinal, bool tf32);
  ~CudaDevice() override;
  CudaDevice(const CudaDevice&) = delete;
  CudaDevice& operator=(const CudaDevice&) = delete;

  DeviceKind kind() const override { return DeviceKind::Cuda; }
  std::string name() const override;
  float* allocate(int64_t count) override;  // zeroed
  void deallocate(float* p) override;
  // Synchronous copies on the copy stream (set-up and tests); the hot path uses the streams.
  void copy_in(float* dst, const float* host_src, int64_t count) override;
  void copy_out(float* host_dst, const float* src, int64_t count) override;
  void synchronize() override;

  int ordinal() const { return ordinal_; }
  bool tf32() const { return tf32_; }
  void activate() const;  // makes this GPU current for the calling thread
  cudaStream_t compute() const { return compute_; }
  cudaStream_t copy() const { return copy_; }
  cublasHandle_t blas() const { return blas_; }
  // The device's cuDNN handle, bound to the compute stream, made on first use (a CudaTower
  // asks for it at set-up; a bare device in a test need not).
  cudnnContext* dnn();
  // A second lane on this GPU for a tower's backward branches (--backward-branches, core/gpu.h):
  // a stream, a cuBLAS handle with a workspace of its own and this device's math mode, and a
  // cuDNN handle, both bound to that stream. make_lane() makes them (once); until then the
  // accessors return null.
  void make_lane();
  cudaStream_t lane() const { return lane_; }
  cublasHandle_t lane_blas() const { return lane_blas_; }
  cudnnContext* lane_dnn() const { return lane_dnn_; }

 private:
  cublasHandle_t blas_on(cudaStream_t stream, void** workspace);
  int ordinal_;
  bool tf32_;
  cudaStream_t compute_ = nullptr, copy_ = nullptr;
  cublasHandle_t blas_ = nullptr;
  void* blas_workspace_ = nullptr;
  cudnnContext* dnn_ = nullptr;
  cudaStream_t lane_ = nullptr;
  cublasHandle_t lane_blas_ = nullptr;
  void* lane_blas_workspace_ = nullptr;
  cudnnContext* lane_dnn_ = nullptr;
};

// Page-locked host memory from cudaMallocHost: the landing buffers of gradients, the staging
// of batches. Zeroed.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  explicit PinnedBuffer(size_t bytes);
  PinnedBuffer(PinnedBuffer&& o) noexcept { *this = std::move(o); }
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept {
    std::swap(p_, o.p_), std::swap(bytes_, o.bytes_);
    return *this;
  }
  ~PinnedBuffer();
  template <class T = float>
  T* as() const {
    return static_cast<T*>(p_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

const char* cublas_status_text(cublasStatus_t s);

}  // namespace towers

#define CUBLAS_CHECK(call)                                                                \
  do {                                                                                    \
    cublasStatus_t towers_st_ = (call);                                                   \
    if (towers_st_ != CUBLAS_STATUS_SUCCESS)                                              \
      TOWERS_SYSTEM_FAIL("cuBLAS call {} failed: {}", #call, ::towers::cublas_status_text(towers_st_)); \
  } while (0)
