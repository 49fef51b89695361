// hd.h — TOWERS_HD marks a small function that runs on both sides: compiled by nvcc it is a
// __host__ __device__ inline, compiled by the host compiler a plain inline. The per-element
// rules of the CUDA kernels are written this way, so the CPU test suite (which runs without a
// GPU) executes the very index arithmetic and formulas the GPU kernels execute (their rounding
// can differ where nvcc contracts a multiply-add into an FMA or uses its device math library).
#pragma once

#if defined(__CUDACC__)
#define TOWERS_HD __host__ __device__ __forceinline__
#define TOWERS_UNROLL _Pragma("unroll")  // a loop with fixed bounds: unrolled by nvcc
#else
#define TOWERS_HD inline
#define TOWERS_UNROLL
#endif

// The CUDA types host code may name without including CUDA headers.
struct CUstream_st;    // cudaStream_t
struct CUevent_st;     // cudaEvent_t
struct cublasContext;  // cublasHandle_t
struct cudnnContext;   // cudnnHandle_t

#include <cstdint>

namespace towers::kernels::cuda {
// Whether a kernel call whose largest tensor has `largest` elements can index in 32 bits, with
// room for the rules' intermediate products (64-bit integer division costs a GPU several times
// the 32-bit one).
constexpr bool fits_int32_indices(int64_t largest) { return largest < (int64_t{1} << 30); }
}  // namespace towers::kernels::cuda
