// conv2d.h — 2-D convolution (+ bias, + optional fused ReLU) as im2col + GEMM, on the CPU also
// by Winograd's minimal filtering (kernels/winograd.h), on the GPU also through cuDNN.
// Weight [out, in, kh, kw]; TF SAME/VALID padding. The batch is cut into fixed chunks of
// images; each chunk is one GEMM over all its pixels (or one per Winograd position), and
// chunks run on oneTBB threads.
#pragma once

#include <optional>
#include <string_view>

#include "kernels/conv.h"
#include "kernels/winograd.h"
#include "layers/layer.h"

namespace towers {

class CudnnConv;  // core/cudnn_conv.h

// How a convolution is computed.
//   auto      CPU: Winograd where it applies and pays: a 3x3 or 5x5 kernel, stride 1, SAME
//             padding, at least kWinogradMinChannels input and output channels; else im2col.
//             GPU: cuDNN where its symmetric padding gives the layer's window; else im2col
//   im2col    CPU: im2col + one GEMM per chunk of images; GPU: im2col + one cuBLAS GEMM
//   winograd  CPU: Winograd (F(2x2, 5x5) or F(4x4, 3x3)); an error where it does not apply.
//             GPU: as auto (cuDNN ranks its own Winograd kernels among the others)
enum class ConvAlgorithm { Auto, Im2col, Winograd };
inline constexpr int64_t kWinogradMinChannels = 16;
// "auto", "im2col", "winograd" (nullopt for any other name), and back.
std::optional<ConvAlgorithm> conv_algorithm_named(std::string_view name);
const char* conv_algorithm_name(ConvAlgorithm a);

struct Conv2DConfig {
  int64_t out_channels = 0, kernel = 0, stride = 1;
  kernels::Padding padding = kernels::Padding::Same;
  bool relu = true;
  float weight_stddev = 5e-2f, bias_init = 0.0f, weight_decay = 0.0f;
  ConvAlgorithm algorithm = ConvAlgorithm::Auto;
};

class Conv2D : public Layer {
 public:
  static constexpr int kWeight = 0, kBias = 1;  // params(): "<name>/weight", "<name>/bias"
  Conv2D(std::string name, Conv2DConfig cfg) : Layer(std::move(name)), cfg_(cfg) {}
  std::string kind() const override { return "conv2d"; }
  // What the CPU path computes with, once the input shape is known: Im2col or Winograd.
  ConvAlgorithm cpu_algorithm() const { return wino_.m != 0 ? ConvAlgorithm::Winograd : ConvAlgorithm::Im2col; }
  std::vector<ParamSpec> params() const override;
  int64_t flops_per_example() const override;
  int64_t batch_chunk() const override;
  void forward(const ForwardArgs& a) const override;
  void backward(const BackwardArgs& a) const override;
#if TOWERS_HAVE_CUDA
  int64_t gpu_scratch(int64_t n) const override;
  int64_t gpu_lane_scratch(int64_t n) const override;
  void forward_gpu(const GpuExec& exec, const ForwardArgs& a) const override;
  void backward_gpu(const GpuExec& exec, const BackwardArgs& a) const override;
  // Whether calls on exec go through cuDNN (else im2col + cuBLAS); see conv2d.cpp.
  bool gpu_uses_cudnn(const GpuExec& exec) const;
#endif

 protected:
  Shape infer(const Shape& in) override;

 private:
  Conv2DConfig cfg_;
  kernels::ConvGeometry geo_;  // set by infer (bind happens once, before any call)
  kernels::cpu::WinogradShape wino_;  // m = 0: im2col
#if TOWERS_HAVE_CUDA
  const CudnnConv& cudnn_plan(const GpuExec& e, int64_t n) const;
#endif
};

}  // namespace towers
