#include "core/device.h"

#include <cstdlib>
#include <cstring>
#include <new>

#include <fmt/format.h>
#include <oneapi/tbb/info.h>

#include "core/check.h"
#include "kernels/gemm.h"

namespace towers {

CpuDevice::CpuDevice(int threads) : threads_(threads), arena_(threads) {
  TOWERS_CHECK(threads > 0, "a CPU device needs at least one thread, got {}", threads);
  kernels::cpu::gemm_init_single_threaded();
}

std::string CpuDevice::name() const { return fmt::format("cpu ({} threads)", threads_); }

float* CpuDevice::allocate(int64_t count) {
  size_t bytes = (static_cast<size_t>(count) * sizeof(float) + 63) / 64 * 64;
  if (bytes == 0) bytes = 64;
  void* p = std::aligned_alloc(64, bytes);
  if (p == nullptr) throw std::bad_alloc();
  std::memset(p, 0, bytes);
  return static_cast<float*>(p);
}

void CpuDevice::deallocate(float* p) { std::free(p); }

void CpuDevice::copy_in(float* dst, const float* src, int64_t count) {
  std::memcpy(dst, src, sizeof(float) * count);
}

void CpuDevice::copy_out(float* dst, const float* src, int64_t count) {
  std::memcpy(dst, src, sizeof(float) * count);
}

int hardware_threads() { return oneapi::tbb::info::default_concurrency(); }

}  // namespace towers
