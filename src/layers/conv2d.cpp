#include "layers/conv2d.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include <fmt/format.h>

#include "core/check.h"
#include "core/parallel.h"
#include "kernels/gemm.h"
#include "kernels/reduce.h"
#include "layers/scratch.h"
#include "core/gpu.h"
#include "kernels/conv.h"
#if TOWERS_HAVE_CUDA
#include "core/cudnn_conv.h"
#include "kernels/activation.h"
#include "kernels/bias.h"
#endif

namespace towers {

namespace {
constexpr int64_t kChunk = 4;  // images per GEMM: big enough for an efficient GEMM (conv2:
                               // 64 x 576 x 1600), small enough that two towers' col buffers
                               // share the L3 cache

// The masked dy of L channels from c0 (d = dy where y > 0 with relu, else dy) for images
// [b0, b1), and each channel's bias gradient. Each channel's sum runs in double, in (image,
// pixel) order, exactly as one channel alone; the L sums are independent, so their adds
// overlap instead of waiting on one another's latency (one chain of dependent double adds
// cost 4% of a cifar10 step).
template <int L>
void mask_dy(const float* dy, const float* y, bool relu, int64_t c0, int64_t b0, int64_t b1,
             int64_t P, int64_t out_sz, float* g, int64_t c_stride, int64_t i_stride, float* db) {
  double sum[L] = {};
  for (int64_t i = b0; i < b1; ++i) {
    const int64_t at = i * out_sz + c0 * P;
    float* d = g + c0 * c_stride + (i - b0) * i_stride;
    for (int l = 0; l < L; ++l) {
      const float* dyl = dy + at + l * P;
      const float* yl = y + at + l * P;
      float* dl = d + l * c_stride;
      if (relu)
        for (int64_t p = 0; p < P; ++p) dl[p] = yl[p] > 0.0f ? dyl[p] : 0.0f;
      else
        std::memcpy(dl, dyl, sizeof(float) * P);
    }
    for (int64_t p = 0; p < P; ++p)
      for (int l = 0; l < L; ++l) sum[l] += d[l * c_stride + p];
  }
  for (int l = 0; l < L; ++l) db[c0 + l] = static_cast<float>(sum[l]);
}
}  // namespace

std::optional<ConvAlgorithm> conv_algorithm_named(std::string_view name) {
  for (ConvAlgorithm a : {ConvAlgorithm::Auto, ConvAlgorithm::Im2col, ConvAlgorithm::Winograd})
    if (name == conv_algorithm_name(a)) return a;
  return std::nullopt;
}

const char* conv_algorithm_name(ConvAlgorithm a) {
  switch (a) {
    case ConvAlgorithm::Auto: return "auto";
    case ConvAlgorithm::Im2col: return "im2col";
    case ConvAlgorithm::Winograd: return "winograd";
  }
  return "?";
}

Shape Conv2D::infer(const Shape& in) {
  TOWERS_CHECK(in.size() == 3, "{}: conv2d needs a (C, H, W) input, got {}", name(),
               to_string(in));
  auto& g = geo_;
  g.channels = in[0];
  g.height = in[1];
  g.width = in[2];
  g.rows = kernels::make_window(in[1], cfg_.kernel, cfg_.stride, cfg_.padding);
  g.cols = kernels::make_window(in[2], cfg_.kernel, cfg_.stride, cfg_.padding);
  const kernels::cpu::WinogradShape w =
      kernels::cpu::winograd_shape(cfg_.kernel, cfg_.stride, cfg_.padding, in[1], in[2]);
  wino_ = {};
  if (cfg_.algorithm == ConvAlgorithm::Winograd) {
    TOWERS_REQUIRE(w.m != 0, "{}: the winograd algorithm needs a 3x3 or 5x5 kernel with stride 1 "
                   "and SAME padding (this is {}x{}, stride {}, {})", name(), cfg_.kernel,
                   cfg_.kernel, cfg_.stride, cfg_.padding == kernels::Padding::Same ? "SAME" : "VALID");
    wino_ = w;
  } else if (cfg_.algorithm == ConvAlgorithm::Auto && w.m != 0 &&
             g.channels >= kWinogradMinChannels && cfg_.out_channels >= kWinogradMinChannels) {
    wino_ = w;
  }
  return {cfg_.out_channels, g.rows.out, g.cols.out};
}

std::vector<ParamSpec> Conv2D::params() const {
  return {{name() + "/weight", {cfg_.out_channels, geo_.channels, cfg_.kernel, cfg_.kernel},
           Init::truncated_normal(cfg_.weight_stddev), cfg_.weight_decay},
          {name() + "/bias", {cfg_.out_channels}, Init::constant(cfg_.bias_init), 0.0f}};
}

int64_t Conv2D::batch_chunk() const { return kChunk; }

int64_t Conv2D::flops_per_example() const {
  return 2 * cfg_.out_channels * geo_.patch() * geo_.out_pixels();
}

// Winograd (kernels/winograd.h) keeps the same chunks of images, and per chunk computes the
// transforms and one GEMM per tile position; its weights are transformed once per call, by
// the calling thread.
void Conv2D::forward(const ForwardArgs& a) const {
  const int64_t K = geo_.patch(), P = geo_.out_pixels(), co = cfg_.out_channels, ci = geo_.channels;
  const int64_t in_sz = numel(in_shape()), out_sz = co * P;
  float* u = nullptr;
  if (wino_.m != 0) {
    u = thread_scratch(ScratchSlot::Weights, wino_.positions() * co * ci);
    kernels::cpu::winograd_weights(wino_, co, ci, a.params[kWeight], false, u);
  }
  for_chunks(a.n, kChunk, [&](int64_t, int64_t b0, int64_t b1) {
    if (u != nullptr)
      return kernels::cpu::winograd_forward(wino_, co, ci, b1 - b0, u, a.x + b0 * in_sz,
                                            a.params[kBias], cfg_.relu, a.y + b0 * out_sz);
    const int64_t cols = (b1 - b0) * P;
    float* col = thread_scratch(ScratchSlot::Col, K * cols);  // (K, images * P)
    float* out = thread_scratch(ScratchSlot::Out, co * cols);  // (co, images * P)
    for (int64_t i = b0; i < b1; ++i)
      kernels::cpu::im2col(geo_, a.x + i * in_sz, col + (i - b0) * P, cols);
    kernels::cpu::gemm(false, false, co, cols, K, 1.0f, a.params[kWeight], K, col, cols, 0.0f, out, cols);
    // Scatter (co, images, P) to (images, co, P), adding the bias and the ReLU on the way.
    for (int64_t i = b0; i < b1; ++i)
      for (int64_t c = 0; c < co; ++c) {
        const float* s = out + c * cols + (i - b0) * P;
        float* d = a.y + i * out_sz + c * P;
        const float bias = a.params[kBias][c];
        if (cfg_.relu)
          for (int64_t p = 0; p < P; ++p) d[p] = std::max(s[p] + bias, 0.0f);
        else
          for (int64_t p = 0; p < P; ++p) d[p] = s[p] + bias;
      }
  });
}

void Conv2D::backward(const BackwardArgs& a) const {
  const int64_t K = geo_.patch(), P = geo_.out_pixels(), co = cfg_.out_channels, ci = geo_.channels;
  const int64_t in_sz = numel(in_shape()), out_sz = co * P;
  const int64_t chunks = ceil_div(a.n, kChunk), wsz = co * K;
  // One partial (dW, db) per chunk, tree-summed (kernels/reduce.h): deterministic for any
  // thread count, and the same tree whether the chunks sit in one tower or several. The first
  // partial is dW itself. The calling thread owns the Partial buffer; chunks use Col and Out.
  float* extra = thread_scratch(ScratchSlot::Partial, (chunks - 1) * wsz + chunks * co);
  std::vector<float*> dws(chunks), dbs(chunks);
  for (int64_t k = 0; k < chunks; ++k) {
    dws[k] = k == 0 ? a.grads[kWeight] : extra + (k - 1) * wsz;
    dbs[k] = k == 0 ? a.grads[kBias] : extra + (chunks - 1) * wsz + k * co;
  }
  float* ut = nullptr;  // Winograd's weights for dx: the flipped kernel's transform
  if (wino_.m != 0 && a.dx != nullptr) {
    ut = thread_scratch(ScratchSlot::Weights, wino_.positions() * co * ci);
    kernels::cpu::winograd_weights(wino_, co, ci, a.params[kWeight], true, ut);
  }
  for_chunks(a.n, kChunk, [&](int64_t k, int64_t b0, int64_t b1) {
    const int64_t cols = (b1 - b0) * P;
    // The masked dy: (co, images * P) for im2col's GEMMs, (images, co, P) for Winograd.
    float* g = thread_scratch(ScratchSlot::Out, co * cols);
    const int64_t c_stride = wino_.m != 0 ? P : cols, i_stride = wino_.m != 0 ? out_sz : P;
    int64_t c = 0;
    for (; c + 4 <= co; c += 4)
      mask_dy<4>(a.dy, a.y, cfg_.relu, c, b0, b1, P, out_sz, g, c_stride, i_stride, dbs[k]);
    for (; c < co; ++c)
      mask_dy<1>(a.dy, a.y, cfg_.relu, c, b0, b1, P, out_sz, g, c_stride, i_stride, dbs[k]);
    if (wino_.m != 0)
      return kernels::cpu::winograd_backward(wino_, co, ci, b1 - b0, ut, a.x + b0 * in_sz, g,
                                             dws[k], a.dx != nullptr ? a.dx + b0 * in_sz : nullptr);
    float* col = thread_scratch(ScratchSlot::Col, K * cols);
    for (int64_t i = b0; i < b1; ++i)
      kernels::cpu::im2col(geo_, a.x + i * in_sz, col + (i - b0) * P, cols);
    // dW_k (co, K) = g (co, cols) * col^T (cols, K)
    kernels::cpu::gemm(false, true, co, K, cols, 1.0f, g, cols, col, cols, 0.0f, dws[k], K);
    if (a.dx != nullptr) {
      // dcol (K, cols) = W^T (K, co) * g (co, cols), reusing the col buffer.
      kernels::cpu::gemm(true, false, K, cols, co, 1.0f, a.params[kWeight], K, g, cols, 0.0f, col, cols);
      for (int64_t i = b0; i < b1; ++i)
        kernels::cpu::col2im(geo_, col + (i - b0) * P, cols, a.dx + i * in_sz);
    }
  });
  if (chunks > 1) {
    for_chunks(wsz, 1 << 14, [&](int64_t, int64_t b, int64_t e) {
      kernels::cpu::tree_sum(dws.data(), chunks, b, e);
    });
    kernels::cpu::tree_sum(dbs.data(), chunks, 0, co);
  }
}

#if TOWERS_HAVE_CUDA
// ---- the GPU twin ----------------------------------------------------------------------------
namespace kc = kernels::cuda;

// GPU path, two ways. With the tower's cuDNN handle, where cuDNN's symmetric padding gives the
// layer's window and --conv is not im2col: cuDNN's forward into y, then one kernel adds the
// bias and applies the ReLU in place; the backward masks dy by the ReLU, sums the bias
// gradient, and runs cuDNN's backward-filter and backward-data on the masked dy. The
// algorithms are planned once per batch size (core/cudnn_conv.h), with the scratch im2col
// would use as their workspace. Otherwise the CPU path's arithmetic with the batch as one
// unit: one batched im2col, one cuBLAS GEMM over every pixel of the batch and one kernel that
// scatters to NCHW with the bias and ReLU; the backward is one masking kernel (with the bias
// gradient), one GEMM for dW over the whole batch, one for the columns of dx, and one col2im.
// All on the tower's stream.
bool Conv2D::gpu_uses_cudnn(const GpuExec& e) const {
  return e.dnn != nullptr && e.plans != nullptr && cfg_.algorithm != ConvAlgorithm::Im2col &&
         cudnn_window_fits(geo_.rows) && cudnn_window_fits(geo_.cols);
}

const CudnnConv& Conv2D::cudnn_plan(const GpuExec& e, int64_t n) const {
  return e.plans->get<CudnnConv>(this, n, [&] {
    const int64_t workspace = geo_.patch() * n * geo_.out_pixels();  // floats, as im2col's col
    auto plan = std::make_unique<CudnnConv>(e.dnn, CudnnConv::Shape{n, geo_, cfg_.out_channels},
                                            e.tf32, sizeof(float) * workspace, name(), e.cudnn);
    e.plans->note(fmt::format("{}, batch {}{}{}{}: {}", name(), n, e.tf32 ? ", TF32" : "",
                              e.cudnn.nondeterministic ? ", any algorithm" : "",
                              e.cudnn.gemm_only ? ", GEMM family" : "", plan->algorithms()));
    return plan;
  });
}

namespace {
// The col region, with room at its start for the bias gradient's segment sums (doubles; as
// many for (n, co, P) as for (1, co, n x P)), which are taken before the region is used.
int64_t col_floats(const kernels::ConvGeometry& g, int64_t co, int64_t n) {
  const int64_t cols = n * g.out_pixels();
  return std::max(g.patch() * cols, 2 * kc::bias_grad_partials(1, co, cols));
}
}  // namespace

int64_t Conv2D::gpu_scratch(int64_t n) const {
  const int64_t cols = n * geo_.out_pixels();
  // col + GEMM output / masked dy
  return col_floats(geo_, cfg_.out_channels, n) + cfg_.out_channels * cols;
}

// The weight-gradient branch's col region (its im2col, or cuDNN's workspace, and the bias
// gradient's segment sums).
int64_t Conv2D::gpu_lane_scratch(int64_t n) const {
  return col_floats(geo_, cfg_.out_channels, n);
}

void Conv2D::forward_gpu(const GpuExec& e, const ForwardArgs& a) const {
  const int64_t K = geo_.patch(), P = geo_.out_pixels(), co = cfg_.out_channels;
  const int64_t cols = a.n * P;
  if (gpu_uses_cudnn(e)) {
    const CudnnConv& plan = cudnn_plan(e, a.n);
    plan.forward(a.x, a.params[kWeight], a.y, gpu_scratch_at(e, 0, K * cols, name()));
    kc::bias_add(e.stream, a.n, co, P, a.params[kBias], a.y, cfg_.relu);
    return;
  }
  float* col = gpu_scratch_at(e, 0, K * cols, name());
  float* out = gpu_scratch_at(e, K * cols, co * cols, name());
  kc::im2col(e.stream, geo_, a.n, a.x, col);
  kc::gemm(e.blas, false, false, co, cols, K, 1.0f, a.params[kWeight], K, col, cols, 0.0f, out, cols);
  kc::conv_output(e.stream, a.n, co, P, out, a.params[kBias], cfg_.relu, a.y);
}

void Conv2D::backward_gpu(const GpuExec& e, const BackwardArgs& a) const {
  const int64_t K = geo_.patch(), P = geo_.out_pixels(), co = cfg_.out_channels;
  const int64_t cols = a.n * P;
  const int64_t col_size = col_floats(geo_, co, a.n);
  float* col = gpu_scratch_at(e, 0, col_size, name());
  float* g = gpu_scratch_at(e, col_size, co * cols, name());
  // The weight gradient (and the bias gradient, where it is not fused into the masking) is a
  // branch on the exec's lane, w, with a col region of its own, beside the input gradient on
  // the main stream; without a lane w is e, and the branch runs first on the one stream.
  if (gpu_uses_cudnn(e)) {
    const CudnnConv& plan = cudnn_plan(e, a.n);
    const float* d = a.dy;  // (n, co, P), masked by the ReLU into g
    if (cfg_.relu) {
      kc::relu_backward(e.stream, co * cols, a.y, a.dy, g);
      d = g;
    }
    const GpuExec w = fork_lane(e);
    float* wcol = gpu_scratch_at(w, 0, col_size, name());
    // The segment sums at the region's start (8-byte aligned), taken before it is workspace.
    kc::bias_grad(w.stream, a.n, co, P, d, a.grads[kBias], false, reinterpret_cast<double*>(wcol));
    plan.backward_filter(a.x, d, a.grads[kWeight], wcol, w.dnn);
    if (a.dx != nullptr) plan.backward_data(a.params[kWeight], d, a.dx, col);
    join_lane(e);
    return;
  }
  kc::conv_grad_output(e.stream, a.n, co, P, a.y, a.dy, cfg_.relu, g, a.grads[kBias],
                       reinterpret_cast<double*>(col));  // the scratch starts 8-byte aligned
  const GpuExec w = fork_lane(e);
  float* wcol = gpu_scratch_at(w, 0, K * cols, name());
  kc::im2col(w.stream, geo_, a.n, a.x, wcol);
  // dW (co, K) = g (co, cols) * col^T (cols, K)
  kc::gemm(w.blas, false, true, co, K, cols, 1.0f, g, cols, wcol, cols, 0.0f, a.grads[kWeight], K);
  if (a.dx != nullptr) {
    // dcol (K, cols) = W^T (K, co) * g (co, cols), into the main col buffer
    kc::gemm(e.blas, true, false, K, cols, co, 1.0f, a.params[kWeight], K, g, cols, 0.0f, col, cols);
    kc::col2im(e.stream, geo_, a.n, col, a.dx);
  }
  join_lane(e);
}
#endif  // TOWERS_HAVE_CUDA

}  // namespace towers
