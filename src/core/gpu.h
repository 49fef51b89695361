// gpu.h — what host code may know about GPUs without CUDA headers: the GPUs found, and the
// execution context a layer's GPU path runs in. Works in every build; in a build without CUDA
// list_gpus() finds none and says why.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kernels/hd.h"  // CUstream_st, cublasContext

namespace towers {

struct GpuInfo {
  int ordinal = 0;
  std::string name;
  int64_t total_bytes = 0, free_bytes = 0;
  int cc_major = 0, cc_minor = 0;
  int multiprocessors = 0;
};

struct GpuList {
  std::vector<GpuInfo> gpus;
  std::string why_none;  // set when gpus is empty: built without CUDA, no driver, no device
  int driver_version = 0, runtime_version = 0;  // CUDA's encoding: 13000 = 13.0
};
// with_free_memory also reads each GPU's free memory, which creates a CUDA context on every
// GPU (hundreds of MiB each, for the life of the process): for `towers devices` only.
GpuList list_gpus(bool with_free_memory = false);

// Pins existing host memory for every GPU (cudaHostRegister) until the handle is released.
// Pinning only makes copies faster: when it is not possible (a build without CUDA, memory
// already pinned by the caller, a locked-memory limit) the handle is null and *why (if given)
// says why; copies from the memory remain correct.
std::shared_ptr<void> pin_host_memory(void* p, size_t bytes, std::string* why = nullptr);

// Everything a layer's GPU path needs: the tower's compute stream and cuBLAS handle (bound to
// that stream), and device scratch of scratch_size floats that the call may overwrite.
struct GpuExec {
  CUstream_st* stream = nullptr;
  cublasContext* blas = nullptr;
  float* scratch = nullptr;
  int64_t scratch_size = 0;
};

// floats [offset, offset + count) of e's scratch; an internal error naming `who` if the
// scratch is short (a layer's gpu_scratch() under-counted).
float* gpu_scratch_at(const GpuExec& e, int64_t offset, int64_t count, const std::string& who);

}  // namespace towers
