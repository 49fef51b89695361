// launch.cuh — launch arithmetic in one place: block sizes, grid sizes, and for_each_index, the
// one launcher of every element-wise kernel.
//
// for_each_index(stream, n, f) calls f(i) for every i in [0, n) on the stream: f is a small
// struct (the kernel's pointers and scalars) with a TOWERS_HD operator()(I i). Its operator()
// passes the pointers on to a static body() whose parameters are __restrict__: nvcc ignores
// __restrict__ on struct members, but honours it on the parameters of an inlined function, and
// then loads the read-only buffers through the non-coherent cache as a kernel with __restrict__
// parameters does (ld.global.nc). Compiled by nvcc
// it is one grid-stride kernel per functor type; compiled by the host compiler (the CUDA
// emulator of tests/emu, which builds the .cu launchers as host code) it hands a host loop over
// the same functor to launch_host_loop, the one function the emulator implements. Either way the
// launcher's checks, its index width and the per-element code are those of the .cu file.
//
// The kernels that are not one thread per element (CUB block reductions) are written out in
// their .cu files, under __CUDACC__ where the file also has element-wise launchers (the
// emulator compiles those files); the emulator has its own version of each
// (tests/emu/emu_kernels.cpp).
#pragma once

#include <cstdint>
#include <functional>

#include <cuda_runtime.h>

#include "core/cuda_check.h"
#include "kernels/hd.h"

namespace towers::kernels::cuda {

constexpr int kBlock = 256;

// Enough blocks to cover n with a grid-stride loop, capped so huge n does not over-launch.
inline unsigned grid_for(int64_t n, int block = kBlock) {
  int64_t blocks = (n + block - 1) / block;
  if (blocks > 65535 * 8) blocks = 65535 * 8;
  return static_cast<unsigned>(blocks < 1 ? 1 : blocks);
}

#if defined(__CUDACC__)

#define TOWERS_GRID_STRIDE(i, n)                                                        \
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); \
       i += static_cast<int64_t>(blockDim.x) * gridDim.x)

// The loop counter is 64-bit whatever I is, so the stride cannot overflow; f sees i as an I.
template <class I, class F>
__global__ void __launch_bounds__(kBlock) for_each_index_kernel(I n, F f) {
  TOWERS_GRID_STRIDE(i, static_cast<int64_t>(n)) { f(static_cast<I>(i)); }
}

// block: threads per block, at most kBlock (fewer spread a short index range over more
// multiprocessors, for threads that each do much work).
template <class I, class F>
void for_each_index(CUstream_st* stream, I n, const F& f, int block = kBlock) {
  if (n <= 0) return;
  for_each_index_kernel<I, F><<<grid_for(n, block), block, 0, stream>>>(n, f);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)  // names the kernel: its signature carries the functor's type
    TOWERS_SYSTEM_FAIL("CUDA launch of {} failed: {} ({})", __PRETTY_FUNCTION__,
                       cudaGetErrorString(e), cudaGetErrorName(e));
}

#else

// Implemented by the CUDA emulator: runs `loop` on the stream, at once or at graph replay. The
// loop takes the indices in order where the GPU takes them in parallel; that makes no
// difference, since each index writes its own elements from inputs no other index writes.
void launch_host_loop(CUstream_st* stream, std::function<void()> loop);

template <class I, class F>
void for_each_index(CUstream_st* stream, I n, const F& f, int /*block*/ = kBlock) {
  if (n <= 0) return;
  launch_host_loop(stream, [n, f] {
    for (I i = 0; i < n; ++i) f(i);
  });
}

#endif

// for_each_index over count indices with the functor make(I{}) builds: I = int32_t when narrow
// (fits_int32_indices of every index the functor forms), else int64_t.
template <class Make>
void launch_narrow_or_wide(CUstream_st* stream, int64_t count, bool narrow, Make make) {
  if (narrow)
    for_each_index(stream, static_cast<int32_t>(count), make(int32_t{}));
  else
    for_each_index(stream, count, make(int64_t{}));
}

}  // namespace towers::kernels::cuda
