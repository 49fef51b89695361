// emu_runtime.h — the CUDA emulator the emulated test suite runs on: the CUDA runtime, cuBLAS
// handle and NCCL entry points towers calls, implemented on the host (tests/emu/emu_runtime.cpp),
// the cuDNN convolution calls (tests/emu/emu_cudnn.cpp),
// and every kernels::cuda:: launcher as a sequential host loop: the element-wise ones are their
// own .cu files compiled as host code (tests/emu/emu_launchers.cpp, through launch_host_loop),
// the others host loops over the rules their kernels run (tests/emu/emu_kernels.cpp).
//
// What it is for: running towers' real GPU host code — CudaDevice, CudaTower (staging, the
// per-layer gradient copies, CUDA graph capture and replay), the layers' GPU paths with their
// cuBLAS arguments, the engine on GPU towers — on a machine without a GPU, against the CPU
// twins. What it is not: a GPU. Device code, launch configurations, CUB reductions, real
// stream concurrency and cuBLAS itself are not exercised; the GPU suite on a real GPU is.
//
// Semantics: TOWERS_EMU_GPUS emulated devices (default 1), which do not check which device's
// memory a kernel touches; device memory is host memory. Streams run lazily: an operation
// runs only when something needs it (a synchronisation, a wait of a stream being run, a copy
// to pageable memory, a free), in its stream's order and after what its stream waits for, so
// a missing wait shows as wrong results (TOWERS_EMU_STREAMS=issue runs each at once instead).
// While a stream capture is active on a thread, every operation that thread issues, and every
// event it records or waits for, is recorded into the graph instead; a launch of the graph
// replays each captured stream on a queue of its own, ordered by those records and waits
// (towers captures fork/join patterns: the copy stream and a tower's lane join the capture).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>

#include <cublas_v2.h>
#include <cuda_runtime.h>

namespace towers::emu {

// Queues work on s (runs it later, when s is run), or records it while the calling thread is
// capturing.
void submit(cudaStream_t s, std::function<void()> work);
// The stream a cuBLAS handle was bound to with cublasSetStream.
cudaStream_t stream_of(cublasHandle_t h);
// Whether a cuBLAS handle asked for TF32 (the emulator computes in FP32 regardless).
bool tf32(cublasHandle_t h);
// Whether [p, p + bytes) lies inside one live device allocation.
bool on_device(const void* p, size_t bytes);
// Whether the calling thread is capturing a stream into a graph.
bool capturing();

// x rounded to TF32 (1 sign, 8 exponent, 10 mantissa bits), to nearest with ties to even:
// what tensor cores multiply in TF32 mode.
inline float to_tf32(float x) {
  if (!std::isfinite(x)) return x;
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  u += 0x0FFFu + ((u >> 13) & 1u);
  u &= 0xFFFFE000u;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

}  // namespace towers::emu
