// loss.h — the graph's last node: the loss over a batch, from the last layer's output (the
// logits) and the labels; in training it also writes the gradient at the logits, which starts
// the backward pass. Towers call it through Graph::loss(); a new loss (label smoothing, say) is
// a subclass here, with its CPU and CUDA kernels.
#pragma once

#include <cstdint>
#include <string>

namespace towers {

struct GpuExec;  // core/gpu.h

struct LossArgs {
  int64_t n = 0;                  // examples
  int64_t classes = 0;
  const float* logits = nullptr;  // (n, classes)
  const int32_t* labels = nullptr;
  float grad_scale = 0.0f;        // d(sum of losses * grad_scale)/d(logits): 1/global batch
  float* dlogits = nullptr;       // (n, classes), overwritten; null: evaluation, no gradient
  // GPU only: per-example losses (n doubles) and hits (n int32) in device memory; the tower
  // copies them out and sums them on the host (kernels::sum_rows), in the CPU's order.
  double* row_loss = nullptr;
  int32_t* row_correct = nullptr;
};

struct LossSums {
  double loss_sum = 0.0;  // summed over the examples
  int64_t correct = 0;    // argmax(logits) == label
};

class Loss {
 public:
  virtual ~Loss() = default;
  virtual std::string kind() const = 0;
  virtual LossSums forward(const LossArgs& a) const = 0;
  // The GPU twin (CUDA builds), queued on exec.stream: fills row_loss and row_correct.
  virtual void forward_gpu(const GpuExec& exec, const LossArgs& a) const;
};

// Softmax cross-entropy, as the TF tutorial's loss (its weight-decay term is in the
// optimizer: ParamSpec::weight_decay).
// Label smoothing (Szegedy et al. 2016; airbench's 0.2) applies in training only: the target
// is (1 - smoothing) onehot + smoothing / classes. Evaluations (no dlogits) report the plain
// cross-entropy, so test losses compare across runs.
class SoftmaxCrossEntropy final : public Loss {
 public:
  explicit SoftmaxCrossEntropy(float label_smoothing = 0.0f) : smoothing_(label_smoothing) {}
  float label_smoothing() const { return smoothing_; }
  std::string kind() const override { return "softmax_xent"; }
  LossSums forward(const LossArgs& a) const override;
#if TOWERS_HAVE_CUDA
  void forward_gpu(const GpuExec& exec, const LossArgs& a) const override;
#endif

 private:
  float smoothing(const LossArgs& a) const { return a.dlogits != nullptr ? smoothing_ : 0.0f; }
  float smoothing_;
};

}  // namespace towers
