#include "core/gpu.h"

#include "core/check.h"

#if TOWERS_HAVE_CUDA
#include <cuda_runtime.h>

#include "core/cuda_check.h"
#include "core/cudnn_conv.h"
#endif

namespace towers {

float* gpu_scratch_at(const GpuExec& e, int64_t offset, int64_t count, const std::string& who) {
  TOWERS_CHECK(offset + count <= e.scratch_size, "{}: GPU scratch of {} floats is short of {}",
               who, e.scratch_size, offset + count);
  return e.scratch + offset;
}

GpuList list_gpus(bool with_free_memory) {
  GpuList out;
#if TOWERS_HAVE_CUDA
  cudaDriverGetVersion(&out.driver_version);
  cudaRuntimeGetVersion(&out.runtime_version);
  out.cudnn_version = static_cast<int>(cudnn_version());
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    out.why_none = std::string("CUDA reports: ") + cudaGetErrorString(e);
    cudaGetLastError();  // clear the sticky-free error so later calls start clean
    return out;
  }
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, i) != cudaSuccess) continue;
    GpuInfo g;
    g.ordinal = i;
    g.name = p.name;
    g.total_bytes = static_cast<int64_t>(p.totalGlobalMem);
    g.cc_major = p.major;
    g.cc_minor = p.minor;
    g.multiprocessors = p.multiProcessorCount;
    int prev = 0;
    size_t free_b = 0, total_b = 0;
    if (with_free_memory && cudaGetDevice(&prev) == cudaSuccess && cudaSetDevice(i) == cudaSuccess &&
        cudaMemGetInfo(&free_b, &total_b) == cudaSuccess)
      g.free_bytes = static_cast<int64_t>(free_b);
    if (with_free_memory) cudaSetDevice(prev);
    out.gpus.push_back(g);
  }
  if (out.gpus.empty()) out.why_none = "the CUDA runtime found 0 devices";
#else
  (void)with_free_memory;
  out.why_none = "this towers was built without CUDA (no nvcc at configure time)";
#endif
  return out;
}

std::shared_ptr<void> pin_host_memory(void* p, size_t bytes, std::string* why) {
#if TOWERS_HAVE_CUDA
  if (p == nullptr || bytes == 0) return nullptr;
  const cudaError_t e = cudaHostRegister(p, bytes, cudaHostRegisterPortable);
  if (e != cudaSuccess) {
    cudaGetLastError();  // not sticky: clear it so later checks do not see it
    if (why) *why = cudaGetErrorString(e);
    return nullptr;
  }
  return std::shared_ptr<void>(p, [](void* q) { cudaHostUnregister(q); });
#else
  (void)p, (void)bytes;
  if (why) *why = "built without CUDA";
  return nullptr;
#endif
}

}  // namespace towers
