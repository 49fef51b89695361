// layers_cuda.cpp — the GPU paths of the layers: the CPU paths' arithmetic with the batch as
// one unit. Convolution is one batched im2col, one cuBLAS GEMM over every pixel of the batch
// and one kernel that scatters to NCHW with the bias and ReLU; its backward is one masking
// kernel (with the bias gradient), one GEMM for dW over the whole batch, one for the columns
// of dx, and one col2im. All work is queued on the tower's compute stream.
#include <cuda_runtime.h>

#include "core/check.h"
#include "core/cuda_check.h"
#include "core/gpu.h"
#include "kernels/activation.h"
#include "kernels/bias.h"
#include "kernels/conv.h"
#include "kernels/gemm.h"
#include "kernels/lrn.h"
#include "kernels/pool.h"
#include "layers/conv2d.h"
#include "layers/dense.h"
#include "layers/lrn.h"
#include "layers/maxpool.h"

namespace towers {

namespace kc = kernels::cuda;

namespace {
float* scratch_at(const GpuExec& e, int64_t offset, int64_t count, const std::string& who) {
  TOWERS_CHECK(offset + count <= e.scratch_size, "{}: GPU scratch of {} floats is short of {}",
               who, e.scratch_size, offset + count);
  return e.scratch + offset;
}
}  // namespace

// ---- conv2d --------------------------------------------------------------------------------
int64_t Conv2D::gpu_scratch(int64_t n) const {
  const int64_t cols = n * geo_.out_pixels();
  return geo_.patch() * cols + cfg_.out_channels * cols;  // col + GEMM output / masked dy
}

void Conv2D::forward_gpu(const GpuExec& e, const ForwardArgs& a) const {
  const int64_t K = geo_.patch(), P = geo_.out_pixels(), co = cfg_.out_channels;
  const int64_t cols = a.n * P;
  float* col = scratch_at(e, 0, K * cols, name());
  float* out = scratch_at(e, K * cols, co * cols, name());
  kc::im2col(e.stream, geo_, a.n, a.x, col);
  kc::gemm(e.blas, false, false, co, cols, K, 1.0f, a.w, K, col, cols, 0.0f, out, cols);
  kc::conv_output(e.stream, a.n, co, P, out, a.b, cfg_.relu, a.y);
}

void Conv2D::backward_gpu(const GpuExec& e, const BackwardArgs& a) const {
  const int64_t K = geo_.patch(), P = geo_.out_pixels(), co = cfg_.out_channels;
  const int64_t cols = a.n * P;
  float* col = scratch_at(e, 0, K * cols, name());
  float* g = scratch_at(e, K * cols, co * cols, name());
  kc::conv_grad_output(e.stream, a.n, co, P, a.y, a.dy, cfg_.relu, g, a.db);
  kc::im2col(e.stream, geo_, a.n, a.x, col);
  // dW (co, K) = g (co, cols) * col^T (cols, K)
  kc::gemm(e.blas, false, true, co, K, cols, 1.0f, g, cols, col, cols, 0.0f, a.dw, K);
  if (a.dx != nullptr) {
    // dcol (K, cols) = W^T (K, co) * g (co, cols), into the col buffer
    kc::gemm(e.blas, true, false, K, cols, co, 1.0f, a.w, K, g, cols, 0.0f, col, cols);
    kc::col2im(e.stream, geo_, a.n, col, a.dx);
  }
}

// ---- dense ---------------------------------------------------------------------------------
int64_t Dense::gpu_scratch(int64_t n) const { return n * cfg_.out; }  // the masked dy

void Dense::forward_gpu(const GpuExec& e, const ForwardArgs& a) const {
  const int64_t o = cfg_.out;
  // y (n, o) = x (n, in) * W^T (in, o), then + b and the ReLU in place
  kc::gemm(e.blas, false, true, a.n, o, in_, 1.0f, a.x, in_, a.w, in_, 0.0f, a.y, o);
  kc::bias_add(e.stream, a.n, o, 1, a.b, a.y, cfg_.relu);
}

void Dense::backward_gpu(const GpuExec& e, const BackwardArgs& a) const {
  const int64_t o = cfg_.out, n = a.n;
  const float* g = a.dy;
  if (cfg_.relu) {
    float* masked = scratch_at(e, 0, n * o, name());
    kc::relu_backward(e.stream, n * o, a.y, a.dy, masked);
    g = masked;
  }
  kc::bias_grad(e.stream, n, o, 1, g, a.db, false);
  // dW (o, in) = g^T (o, n) * x (n, in)
  kc::gemm(e.blas, true, false, o, in_, n, 1.0f, g, o, a.x, in_, 0.0f, a.dw, in_);
  // dx (n, in) = g (n, o) * W (o, in)
  if (a.dx != nullptr)
    kc::gemm(e.blas, false, false, n, in_, o, 1.0f, g, o, a.w, in_, 0.0f, a.dx, in_);
}

// ---- maxpool -------------------------------------------------------------------------------
int64_t MaxPool::gpu_scratch(int64_t n) const { return n * numel(out_shape()); }

void MaxPool::forward_gpu(const GpuExec& e, const ForwardArgs& a) const {
  const int64_t c = in_shape()[0], h = in_shape()[1], w = in_shape()[2];
  // Evaluation keeps no argmax; the kernel still writes one, to scratch.
  float* argmax = a.training ? a.saved : scratch_at(e, 0, a.n * numel(out_shape()), name());
  kc::maxpool_forward(e.stream, a.n * c, h, w, rows_, cols_, a.x, a.y, argmax);
}

void MaxPool::backward_gpu(const GpuExec& e, const BackwardArgs& a) const {
  if (a.dx == nullptr) return;
  const int64_t c = in_shape()[0], h = in_shape()[1], w = in_shape()[2];
  kc::maxpool_backward(e.stream, a.n * c, h, w, rows_, cols_, a.saved, a.dy, a.dx);
}

// ---- lrn -----------------------------------------------------------------------------------
int64_t Lrn::gpu_scratch(int64_t n) const { return n * numel(in_shape()); }

void Lrn::forward_gpu(const GpuExec& e, const ForwardArgs& a) const {
  const int64_t c = in_shape()[0], hw = in_shape()[1] * in_shape()[2];
  float* scale = a.training ? a.saved : scratch_at(e, 0, a.n * c * hw, name());
  kc::lrn_forward(e.stream, p_, a.n, c, hw, a.x, a.y, scale);
}

void Lrn::backward_gpu(const GpuExec& e, const BackwardArgs& a) const {
  if (a.dx == nullptr) return;
  const int64_t c = in_shape()[0], hw = in_shape()[1] * in_shape()[2];
  kc::lrn_backward(e.stream, p_, a.n, c, hw, a.x, a.y, a.saved, a.dy, a.dx);
}

}  // namespace towers
