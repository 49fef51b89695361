// gpu_test_util.h — what every GPU test shares: the skip when no CUDA device is usable (a skip
// is reported as Skipped, never as passed), device arrays, and the comparison with a CPU twin.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "core/cuda_check.h"
#include "core/gpu.h"
#include "core/rng.h"
#include "kernels/debug.h"
#include "layers/layer.h"
#include "target/target.h"

namespace towers::gputest {

// Empty when a device is usable, else the reason (CUDA's own words).
inline std::string no_gpu_reason() {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) return std::string("no usable CUDA device: ") + cudaGetErrorString(e);
  if (count == 0) return "no CUDA device: 0 devices";
  // A GPU this build has no code for (built for sm_90, run on an older GPU, say).
  if (const std::string why = kernels::cuda::device_code_missing(); !why.empty())
    return "no GPU code for device 0 in this build (" TOWERS_CUDA_ARCHITECTURES "): " + why;
  return {};
}

// TOWERS_REQUIRE_GPU=1 (bench/run-gpu.sh sets it) turns every GPU-test skip into a failure, so
// that a broken driver, a missing libcuda or an architecture mismatch cannot pass as a suite of
// skips on a machine that is meant to have a GPU.
inline bool gpu_required() {
  const char* v = std::getenv("TOWERS_REQUIRE_GPU");
  return v != nullptr && std::string(v) == "1";
}

// Skips the GPU test with the reason, or fails it under TOWERS_REQUIRE_GPU=1. Use it for every
// reason a GPU test cannot run on a machine meant to run it (no device, a broken driver, no code
// for the GPU, a test that needs a real GPU).
#define TOWERS_GPU_SKIP(reason)                                                   \
  do {                                                                            \
    if (::towers::gputest::gpu_required())                                        \
      GTEST_FAIL() << "TOWERS_REQUIRE_GPU=1, but this GPU test cannot run: " << reason; \
    else                                                                          \
      GTEST_SKIP() << reason;                                                     \
  } while (0)

// Skips a test that needs more GPUs than the machine has, under TOWERS_REQUIRE_GPU=1 too: no
// setup can fix that on a one-GPU machine. The reason starts with "needs more GPUs:", so
// bench/run-gpu.sh counts these skips apart from every other skip.
#define TOWERS_SKIP_FOR_GPU_COUNT(needed, have)                                               \
  GTEST_SKIP() << "needs more GPUs: this test needs " << (needed) << " GPUs; this machine has " \
               << (have)

// Use as the first statement of a GPU test.
#define TOWERS_SKIP_WITHOUT_GPU()                                        \
  do {                                                                   \
    std::string towers_reason_ = ::towers::gputest::no_gpu_reason();     \
    if (!towers_reason_.empty()) TOWERS_GPU_SKIP(towers_reason_);        \
  } while (0)

// A test of the CUDA emulator's own fault injection (an extra workspace its cuDNN asks for, a
// timed search whose trials all fail), which a real GPU cannot be made to take: it is registered
// in the emulated test executable only, so that a GPU run has no skip for it. (Its factory
// returns a plain testing::Test, as TEST's does, so that it may share a suite with TESTs.) Use
// as TEST:
//   TOWERS_EMULATOR_TEST(Suite, Name) { ... }
#define TOWERS_EMULATOR_TEST(suite, name)                                                      \
  class suite##_##name##_OnTheEmulator : public ::testing::Test {                              \
   public:                                                                                     \
    void TestBody() override;                                                                  \
  };                                                                                           \
  [[maybe_unused]] const bool suite##_##name##_registered =                                    \
      ::towers::testutil::emulated_gpu() &&                                                    \
      ::testing::RegisterTest(                                                                 \
          #suite, #name, nullptr, nullptr, __FILE__, __LINE__,                                 \
          []() -> ::testing::Test* { return new suite##_##name##_OnTheEmulator; }) != nullptr; \
  void suite##_##name##_OnTheEmulator::TestBody()

// Empty when cuBLAS's TF32 mode takes effect on device 0, else why not: tensor cores with TF32
// arrive with compute capability 8.0 (Ampere), and NVIDIA_TF32_OVERRIDE=0 turns TF32 off
// everywhere. A TF32 test skips then (the hardware or the environment lacks it; not a setup
// failure, so TOWERS_REQUIRE_GPU does not fail it).
inline std::string no_tf32_reason() {
  const char* o = std::getenv("NVIDIA_TF32_OVERRIDE");
  if (o != nullptr && std::string(o) == "0") return "NVIDIA_TF32_OVERRIDE=0 disables TF32";
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return "cannot read the GPU's properties";
  if (prop.major < 8)
    return "TF32 needs compute capability 8.0 or later; this GPU is " + std::to_string(prop.major) +
           "." + std::to_string(prop.minor);
  return {};
}

// A device array of T with host round trips (synchronous: tests favour clarity).
template <class T>
class DeviceArray {
 public:
  explicit DeviceArray(int64_t n) : n_(n) {
    CUDA_CHECK(cudaMalloc(&p_, sizeof(T) * std::max<int64_t>(n, 1)));
    CUDA_CHECK(cudaMemset(p_, 0xff, sizeof(T) * std::max<int64_t>(n, 1)));  // NaN for floats
  }
  explicit DeviceArray(const std::vector<T>& h) : DeviceArray(static_cast<int64_t>(h.size())) {
    upload(h);
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  ~DeviceArray() { cudaFree(p_); }
  T* get() const { return p_; }
  int64_t size() const { return n_; }
  void upload(const std::vector<T>& h) {
    CUDA_CHECK(cudaMemcpy(p_, h.data(), sizeof(T) * h.size(), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> h(n_);
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(cudaMemcpy(h.data(), p_, sizeof(T) * n_, cudaMemcpyDeviceToHost));
    return h;
  }

 private:
  T* p_ = nullptr;
  int64_t n_ = 0;
};

// A stream of its own for a test, destroyed with it.
struct Stream {
  cudaStream_t s = nullptr;
  Stream() { CUDA_CHECK(cudaStreamCreate(&s)); }
  ~Stream() { cudaStreamDestroy(s); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
};

inline std::vector<float> random_floats(int64_t n, uint64_t seed, float lo = -1.0f,
                                        float hi = 1.0f) {
  Rng rng(seed);
  std::vector<float> v(n);
  for (auto& x : v) x = rng.uniform(lo, hi);
  return v;
}

// A layer without variables, bound to its input shape, run forward and backward on the CPU
// and through its GPU twin on the same x (n examples) and dy.
struct LayerTwins {
  std::vector<float> y_cpu, dx_cpu, y_gpu, dx_gpu;
};
inline LayerTwins run_layer_twins(const Layer& layer, int64_t n, const std::vector<float>& x,
                                  const std::vector<float>& dy, cudaStream_t s) {
  const int64_t in = n * numel(layer.in_shape()), out = n * numel(layer.out_shape());
  LayerTwins r;
  r.y_cpu.resize(out), r.dx_cpu.resize(in);
  ForwardArgs f;
  f.n = n, f.x = x.data(), f.y = r.y_cpu.data();
  layer.forward(f);
  BackwardArgs b;
  b.n = n, b.x = x.data(), b.y = r.y_cpu.data(), b.dy = dy.data(), b.dx = r.dx_cpu.data();
  layer.backward(b);
  DeviceArray<float> x_d(x), y_d(out), dy_d(dy), dx_d(in);
  GpuExec e;
  e.stream = s;
  f.x = x_d.get(), f.y = y_d.get();
  layer.forward_gpu(e, f);
  b.x = x_d.get(), b.y = y_d.get(), b.dy = dy_d.get(), b.dx = dx_d.get();
  layer.backward_gpu(e, b);
  r.y_gpu = y_d.download();
  r.dx_gpu = dx_d.download();
  return r;
}


// Largest |got - want| / max(|want|, floor) over the arrays; floor keeps values near zero from
// dominating (they are compared absolutely against floor * tolerance).
inline double max_rel_error(const std::vector<float>& got, const std::vector<float>& want,
                            double floor = 1e-3) {
  EXPECT_EQ(got.size(), want.size());
  double worst = 0.0;
  for (size_t i = 0; i < std::min(got.size(), want.size()); ++i) {
    if (std::isnan(got[i]) != std::isnan(want[i])) return INFINITY;
    double d = std::fabs(static_cast<double>(got[i]) - want[i]);
    worst = std::max(worst, d / std::max(std::fabs(static_cast<double>(want[i])), floor));
  }
  return worst;
}

}  // namespace towers::gputest
