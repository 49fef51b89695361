// GPU twin of a residual block (conv -> batchnorm -> relu -> conv with the identity shortcut;
// layers/residual.h): the inner layers' GPU calls, the shortcut's sums and the error buffers in
// the saved area, against the CPU block on the same inputs and variables. The convolutions run
// through cuBLAS, so the comparison is float-close, not bitwise. Skips without a CUDA device.
#include <cstdint>
#include <cstdio>
#include <memory>
#include <vector>

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "core/gpu.h"
#include "gpu_test_util.h"
#include "layers/batchnorm.h"
#include "layers/conv2d.h"
#include "layers/relu.h"
#include "layers/residual.h"

namespace towers {
namespace {

using gputest::DeviceArray;
using gputest::max_rel_error;
using gputest::random_floats;
using gputest::Stream;

TEST(ResidualGpu, BasicBlockMatchesCpuTwin) {
  TOWERS_SKIP_WITHOUT_GPU();
  Stream st;
  const int64_t n = 16, c = 8;
  std::vector<std::unique_ptr<Layer>> inner;
  Conv2DConfig cc{c, 3, 1, kernels::Padding::Same, false, 0.2f, 0.0f, 0.0f};
  inner.push_back(std::make_unique<Conv2D>("c1", cc));
  inner.push_back(std::make_unique<BatchNorm>("bn", BatchNormConfig{}));
  inner.push_back(std::make_unique<Relu>("r"));
  inner.push_back(std::make_unique<Conv2D>("c2", cc));
  Residual block("block", std::move(inner));
  block.bind({c, 10, 10});
  const auto specs = block.params();
  const int64_t count = n * numel(block.in_shape()), sv = saved_floats(block, n);
  const std::vector<float> x = random_floats(count, 300), dy = random_floats(count, 301);
  std::vector<std::vector<float>> vars, grads;
  std::vector<std::unique_ptr<DeviceArray<float>>> vars_d, grads_d;
  for (size_t k = 0; k < specs.size(); ++k) {
    vars.push_back(random_floats(numel(specs[k].shape), 310 + k, -0.3f, 0.3f));
    if (specs[k].name == "bn/moving_variance") vars.back().assign(vars.back().size(), 1.0f);
    grads.emplace_back(vars.back().size());
    vars_d.push_back(std::make_unique<DeviceArray<float>>(vars.back()));
    grads_d.push_back(std::make_unique<DeviceArray<float>>(static_cast<int64_t>(vars.back().size())));
  }
  // CPU.
  std::vector<float> y(count), dx(count), saved(sv);
  ForwardArgs f;
  f.n = n, f.x = x.data(), f.y = y.data(), f.saved = saved.data();
  for (size_t k = 0; k < specs.size(); ++k) f.params[k] = vars[k].data();
  block.forward(f);
  BackwardArgs b;
  b.n = n, b.x = x.data(), b.y = y.data(), b.dy = dy.data(), b.dx = dx.data(), b.saved = saved.data();
  b.params = f.params;
  for (size_t k = 0; k < specs.size(); ++k) b.grads[k] = grads[k].data();
  block.backward(b);
  // GPU.
  DeviceArray<float> x_d(x), dy_d(dy), y_d(count), dx_d(count), saved_d(sv);
  DeviceArray<float> scratch_d(std::max<int64_t>(block.gpu_scratch(n), 1));
  cublasHandle_t blas = nullptr;
  ASSERT_EQ(cublasCreate(&blas), CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cublasSetStream(blas, st.s), CUBLAS_STATUS_SUCCESS);
  const GpuExec e{st.s, blas, scratch_d.get(), scratch_d.size()};
  ForwardArgs gf;
  gf.n = n, gf.x = x_d.get(), gf.y = y_d.get(), gf.saved = saved_d.get();
  for (size_t k = 0; k < specs.size(); ++k) gf.params[k] = vars_d[k]->get();
  block.forward_gpu(e, gf);
  BackwardArgs gb;
  gb.n = n, gb.x = x_d.get(), gb.y = y_d.get(), gb.dy = dy_d.get(), gb.dx = dx_d.get();
  gb.saved = saved_d.get();
  gb.params = gf.params;
  for (size_t k = 0; k < specs.size(); ++k) gb.grads[k] = grads_d[k]->get();
  block.backward_gpu(e, gb);
  const double ey = max_rel_error(y_d.download(), y), edx = max_rel_error(dx_d.download(), dx);
  cublasDestroy(blas);
  std::printf("  y %.3g, dx %.3g\n", ey, edx);
  // float32 sums in other orders (cuBLAS vs OpenBLAS), relative to max(|value|, 1e-3).
  EXPECT_LT(ey, 2e-3);
  EXPECT_LT(edx, 2e-3);
  for (size_t k = 0; k < specs.size(); ++k) {
    const double eg = max_rel_error(grads_d[k]->download(), grads[k]);
    std::printf("  %s %.3g\n", specs[k].name.c_str(), eg);
    EXPECT_LT(eg, 2e-3) << specs[k].name;
  }
}

}  // namespace
}  // namespace towers
