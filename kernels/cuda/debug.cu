#include "kernels/cuda/launch.cuh"
#include "kernels/debug.h"

namespace towers::kernels::cuda {

__device__ inline uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));  // nanoseconds, any clock speed
  return t;
}

__global__ void spin_delay_kernel(int64_t ns) {
  const uint64_t start = global_ns();
  while (global_ns() - start < static_cast<uint64_t>(ns)) {
#if __CUDA_ARCH__ >= 700
    __nanosleep(100);
#endif
  }
}

void spin_delay(CUstream_st* stream, int64_t ns) {
  if (ns <= 0) return;
  spin_delay_kernel<<<1, 1, 0, stream>>>(ns);
  CUDA_CHECK_LAUNCH();
}

std::string device_code_missing() {
  cudaFuncAttributes attr{};
  const cudaError_t e = cudaFuncGetAttributes(&attr, spin_delay_kernel);
  if (e == cudaSuccess) return {};
  cudaGetLastError();  // the failed query is not an error of the next call
  // Only these mean "no code for this GPU"; any other error (a driver too old for the PTX,
  // say) is left to the first CUDA call that checks, which names it.
  if (e != cudaErrorNoKernelImageForDevice && e != cudaErrorInvalidDeviceFunction) return {};
  return cudaGetErrorString(e);
}

}  // namespace towers::kernels::cuda
