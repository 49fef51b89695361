// GPU twin of batch normalization (kernels/cuda/batchnorm.cu, through the layer's
// forward_gpu/backward_gpu) against the CPU twin: training forward, evaluation forward and
// backward (dx, dgamma, dbeta and the running statistics' deltas). Both take every channel sum
// in the same lanes in double and add the lanes in order, without FMA contraction
// (kernels/batchnorm_rules.h), so they agree bitwise. Skips without a CUDA device.
#include <cstdint>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "core/gpu.h"
#include "gpu_test_util.h"
#include "layers/batchnorm.h"
#include "towers/tower_exchange.h"

namespace towers {
namespace {

using gputest::DeviceArray;
using gputest::random_floats;
using gputest::Stream;

struct BnCase {
  std::string name;
  int64_t n;
  Shape in;
};

// Shapes with fewer and with many more elements per channel than the 256 lanes, planes smaller
// and larger than the lanes, a dense (C) input, and the production shape of a 3x3 convolution's
// output at batch 128.
const std::vector<BnCase> kCases = {
    {"3x4x5x5", 3, {4, 5, 5}},           {"16x7", 16, {7}},
    {"9x5x13x11", 9, {5, 13, 11}},       {"4x3x28x28", 4, {3, 28, 28}},
    {"128x64x16x16", 128, {64, 16, 16}},
};

int64_t count_diff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  int64_t d = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    d += !(a[i] == b[i] || (a[i] != a[i] && b[i] != b[i]));
  return d;
}

TEST(BatchNormGpu, ForwardAndBackwardMatchCpuTwinBitwise) {
  TOWERS_SKIP_WITHOUT_GPU();
  Stream st;
  uint64_t seed = 120;
  for (const BnCase& k : kCases) {
    SCOPED_TRACE(k.name);
    BatchNorm layer("bn", {});
    layer.bind(k.in);
    const int64_t c = k.in[0], count = k.n * numel(k.in);
    const std::vector<float> x = random_floats(count, ++seed, -2.0f, 5.0f);
    const std::vector<float> dy = random_floats(count, ++seed);
    const std::vector<float> gamma = random_floats(c, ++seed, 0.5f, 2.0f);
    const std::vector<float> beta = random_floats(c, ++seed);
    const std::vector<float> rmean = random_floats(c, ++seed);
    const std::vector<float> rvar = random_floats(c, ++seed, 0.5f, 3.0f);
    const float weight = 0.5f;

    // CPU: training forward, backward, evaluation forward.
    std::vector<float> y(count), yeval(count), dx(count), dg(c), db(c), dm(c), dv(c);
    std::vector<float> saved(saved_floats(layer, k.n), NAN);
    ForwardArgs f;
    f.n = k.n, f.x = x.data(), f.y = y.data(), f.saved = saved.data();
    f.params = {gamma.data(), beta.data(), rmean.data(), rvar.data()};
    layer.forward(f);
    BackwardArgs b;
    b.n = k.n, b.x = x.data(), b.y = y.data(), b.dy = dy.data(), b.dx = dx.data();
    b.params = f.params, b.saved = saved.data();
    b.grads = {dg.data(), db.data(), dm.data(), dv.data()};
    b.state_weight = weight;
    layer.backward(b);
    ForwardArgs fe = f;
    fe.y = yeval.data(), fe.training = false;
    layer.forward(fe);

    // GPU: the same calls on device arrays (NaN-filled outputs: a missed write shows).
    DeviceArray<float> x_d(x), dy_d(dy), g_d(gamma), b_d(beta), m_d(rmean), v_d(rvar);
    DeviceArray<float> y_d(count), ye_d(count), dx_d(count), dg_d(c), db_d(c), dm_d(c), dv_d(c);
    DeviceArray<float> scratch(layer.gpu_scratch(k.n));  // as a tower gives a layer
    DeviceArray<float> saved_d(saved_floats(layer, k.n));
    GpuExec e;
    e.stream = st.s;
    e.scratch = scratch.get();
    e.scratch_size = scratch.size();
    ForwardArgs gf;
    gf.n = k.n, gf.x = x_d.get(), gf.y = y_d.get(), gf.saved = saved_d.get();
    gf.params = {g_d.get(), b_d.get(), m_d.get(), v_d.get()};
    layer.forward_gpu(e, gf);
    BackwardArgs gb;
    gb.n = k.n, gb.x = x_d.get(), gb.y = y_d.get(), gb.dy = dy_d.get(), gb.dx = dx_d.get();
    gb.params = gf.params, gb.saved = saved_d.get();
    gb.grads = {dg_d.get(), db_d.get(), dm_d.get(), dv_d.get()};
    gb.state_weight = weight;
    layer.backward_gpu(e, gb);
    ForwardArgs gfe = gf;
    gfe.y = ye_d.get(), gfe.training = false;
    layer.forward_gpu(e, gfe);

    const int64_t d_y = count_diff(y_d.download(), y), d_ye = count_diff(ye_d.download(), yeval);
    const int64_t d_dx = count_diff(dx_d.download(), dx);
    const int64_t d_c = count_diff(dg_d.download(), dg) + count_diff(db_d.download(), db) +
                        count_diff(dm_d.download(), dm) + count_diff(dv_d.download(), dv);
    std::printf("  %s: differing y %lld, eval y %lld, dx %lld of %lld; per-channel %lld of %lld\n",
                k.name.c_str(), static_cast<long long>(d_y), static_cast<long long>(d_ye),
                static_cast<long long>(d_dx), static_cast<long long>(count),
                static_cast<long long>(d_c), static_cast<long long>(4 * c));
    EXPECT_EQ(d_y, 0);
    EXPECT_EQ(d_ye, 0);
    EXPECT_EQ(d_dx, 0);
    EXPECT_EQ(d_c, 0);
  }
}

// --sync-bn on GPU towers: the device path (channel sums on the GPU, added through the
// exchange on the host) against the CPU path, each as two towers on two threads with uneven
// shares of a batch. Both take the same lanes and the same host arithmetic, so every tower's
// y, dx, gradients and state deltas agree bitwise; with one tower the sync path is the plain
// GPU path, bitwise.
TEST(BatchNormGpu, ItsSyncBnPathIsTheCpuTwinsBitwise) {
  TOWERS_SKIP_WITHOUT_GPU();
  const std::vector<BnCase> cases = {{"9x5x13x11", 9, {5, 13, 11}}, {"24x7", 24, {7}},
                                     {"128x64x16x16", 128, {64, 16, 16}}};
  uint64_t seed = 300;
  for (const BnCase& k : cases) {
    SCOPED_TRACE(k.name);
    BatchNorm layer("bn", {});
    layer.bind(k.in);
    const int64_t c = k.in[0], per = numel(k.in), count = k.n * per;
    const std::vector<float> x = random_floats(count, ++seed, -2.0f, 5.0f);
    const std::vector<float> dy = random_floats(count, ++seed);
    const std::vector<float> gamma = random_floats(c, ++seed, 0.5f, 2.0f);
    const std::vector<float> beta = random_floats(c, ++seed);
    const std::vector<float> rmean = random_floats(c, ++seed);
    const std::vector<float> rvar = random_floats(c, ++seed, 0.5f, 3.0f);
    struct Out {
      std::vector<float> y, dx, grads;  // grads: dgamma, dbeta, dmean, dvar
    };
    // Examples [e0, e0 + n) as one tower of an exchange, on the CPU or the GPU.
    auto cpu = [&](int64_t e0, int64_t n, TowerExchange* ex, float weight) {
      Out o{std::vector<float>(n * per), std::vector<float>(n * per), std::vector<float>(4 * c)};
      std::vector<float> saved(saved_floats(layer, n), NAN);
      ForwardArgs f;
      f.n = n, f.x = x.data() + e0 * per, f.y = o.y.data(), f.exchange = ex, f.saved = saved.data();
      f.params = {gamma.data(), beta.data(), rmean.data(), rvar.data()};
      layer.forward(f);
      BackwardArgs b;
      b.n = n, b.x = f.x, b.y = o.y.data(), b.dy = dy.data() + e0 * per, b.dx = o.dx.data();
      b.exchange = ex, b.params = f.params, b.state_weight = weight, b.saved = saved.data();
      for (int q = 0; q < 4; ++q) b.grads[q] = o.grads.data() + q * c;
      layer.backward(b);
      return o;
    };
    auto gpu = [&](int64_t e0, int64_t n, TowerExchange* ex, float weight) {
      Stream st;
      const std::vector<float> xs(x.begin() + e0 * per, x.begin() + (e0 + n) * per);
      const std::vector<float> dys(dy.begin() + e0 * per, dy.begin() + (e0 + n) * per);
      DeviceArray<float> x_d(xs), dy_d(dys), g_d(gamma), b_d(beta), m_d(rmean), v_d(rvar);
      DeviceArray<float> y_d(n * per), dx_d(n * per), grads_d(4 * c);
      DeviceArray<float> scratch(layer.gpu_scratch(n)), saved_d(saved_floats(layer, n));
      GpuExec e;
      e.stream = st.s;
      e.scratch = scratch.get();
      e.scratch_size = scratch.size();
      ForwardArgs f;
      f.n = n, f.x = x_d.get(), f.y = y_d.get(), f.exchange = ex, f.saved = saved_d.get();
      f.params = {g_d.get(), b_d.get(), m_d.get(), v_d.get()};
      layer.forward_gpu(e, f);
      BackwardArgs b;
      b.n = n, b.x = x_d.get(), b.y = y_d.get(), b.dy = dy_d.get(), b.dx = dx_d.get();
      b.exchange = ex, b.params = f.params, b.state_weight = weight, b.saved = saved_d.get();
      for (int q = 0; q < 4; ++q) b.grads[q] = grads_d.get() + q * c;
      layer.backward_gpu(e, b);
      return Out{y_d.download(), dx_d.download(), grads_d.download()};
    };
    auto expect_same = [&](const Out& a, const Out& b, const char* what) {
      EXPECT_EQ(count_diff(a.y, b.y), 0) << what << ": y";
      EXPECT_EQ(count_diff(a.dx, b.dx), 0) << what << ": dx";
      EXPECT_EQ(count_diff(a.grads, b.grads), 0) << what << ": gradients";
    };
    // Two towers, 4 and n - 4 examples (weights as the sync update gives them: n_i / n).
    const int64_t n0 = 4, n1 = k.n - n0;
    const float w0 = static_cast<float>(n0) / k.n, w1 = static_cast<float>(n1) / k.n;
    TowerExchangeGroup cpu_ex(2), gpu_ex(2);
    Out c0, c1, g0, g1;
    std::thread t1([&] { c1 = cpu(n0, n1, &cpu_ex.member(1), w1); });
    c0 = cpu(0, n0, &cpu_ex.member(0), w0);
    t1.join();
    std::thread t2([&] { g1 = gpu(n0, n1, &gpu_ex.member(1), w1); });
    g0 = gpu(0, n0, &gpu_ex.member(0), w0);
    t2.join();
    expect_same(g0, c0, "tower 0");
    expect_same(g1, c1, "tower 1");
    // The towers' statistics are the global batch's: the towers' y differ from what each
    // would compute over its own examples.
    const Out alone = gpu(0, n0, nullptr, w0);
    EXPECT_GT(count_diff(alone.y, g0.y), 0);
    // One tower: the sync path is the plain path.
    TowerExchangeGroup one(1);
    expect_same(gpu(0, k.n, &one.member(0), 1.0f), gpu(0, k.n, nullptr, 1.0f), "one tower");
  }
}

}  // namespace
}  // namespace towers
