// cuda_check.h — CUDA_CHECK / CUDA_CHECK_LAUNCH: throw towers::Error naming the failing call,
// file:line and CUDA's own error text. Included only by code compiled with the CUDA toolkit.
#pragma once

#include <cuda_runtime.h>

#include "core/check.h"

#define CUDA_CHECK(call)                                                                 \
  do {                                                                                   \
    cudaError_t towers_err_ = (call);                                                    \
    if (towers_err_ != cudaSuccess)                                                      \
      TOWERS_SYSTEM_FAIL("CUDA call {} failed: {} ({})", #call, cudaGetErrorString(towers_err_), \
                  cudaGetErrorName(towers_err_));                                        \
  } while (0)

// After every kernel launch: catches bad launch configurations at the launch site.
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())
