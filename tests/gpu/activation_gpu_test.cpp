// GPU twin of the ReLU kernels against the CPU twin on fresh random inputs. Skips, with the
// reason, where no CUDA device is usable; a skip is reported as such, never as a pass.
#include <cmath>
#include <vector>

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "core/cuda_check.h"
#include "core/rng.h"
#include "gpu_test_util.h"
#include "kernels/activation.h"

namespace towers {
namespace {

TEST(ReluGpu, MatchesCpuTwin) {
  TOWERS_SKIP_WITHOUT_GPU();
  const int64_t n = 1 << 20 | 7;
  Rng rng(11);
  std::vector<float> x(n), dy(n);
  for (auto& v : x) v = rng.uniform(-1, 1);
  for (auto& v : dy) v = rng.uniform(-1, 1);
  std::vector<float> y_ref(n), dx_ref(n), y(n), dx(n);
  kernels::cpu::relu_forward(n, x.data(), y_ref.data());
  kernels::cpu::relu_backward(n, y_ref.data(), dy.data(), dx_ref.data());
  float *dx_d, *x_d, *y_d, *dy_d;
  for (float** p : {&x_d, &y_d, &dy_d, &dx_d}) CUDA_CHECK(cudaMalloc(p, n * sizeof(float)));
  cudaStream_t s;
  CUDA_CHECK(cudaStreamCreate(&s));
  CUDA_CHECK(cudaMemcpyAsync(x_d, x.data(), n * 4, cudaMemcpyHostToDevice, s));
  CUDA_CHECK(cudaMemcpyAsync(dy_d, dy.data(), n * 4, cudaMemcpyHostToDevice, s));
  kernels::cuda::relu_forward(s, n, x_d, y_d);
  kernels::cuda::relu_backward(s, n, y_d, dy_d, dx_d);
  CUDA_CHECK(cudaMemcpyAsync(y.data(), y_d, n * 4, cudaMemcpyDeviceToHost, s));
  CUDA_CHECK(cudaMemcpyAsync(dx.data(), dx_d, n * 4, cudaMemcpyDeviceToHost, s));
  CUDA_CHECK(cudaStreamSynchronize(s));
  EXPECT_EQ(y, y_ref);  // exact: a select, no arithmetic
  EXPECT_EQ(dx, dx_ref);
  for (float* p : {x_d, y_d, dy_d, dx_d}) CUDA_CHECK(cudaFree(p));
  CUDA_CHECK(cudaStreamDestroy(s));
}

}  // namespace
}  // namespace towers
