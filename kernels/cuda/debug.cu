#include "kernels/cuda/launch.cuh"
#include "kernels/debug.h"

namespace towers::kernels::cuda {

__global__ void spin_delay_kernel(int64_t ns) {
  const long long start = clock64();
  // clock64 counts SM cycles; at most ~2 GHz, so ns * 2 cycles last at least ns nanoseconds.
  while (clock64() - start < 2 * ns) __nanosleep(100);
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
  return cudaGetErrorString(e);
}

}  // namespace towers::kernels::cuda
