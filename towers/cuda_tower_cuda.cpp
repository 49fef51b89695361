#include "towers/cuda_tower.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <string_view>
#include <vector>

#include "core/check.h"
#include "core/cuda_check.h"
#include "data/augment.h"
#include "kernels/augment.h"
#include "kernels/debug.h"
#include "kernels/softmax_xent.h"

namespace towers {

CudaTower::CudaTower(const Graph& graph, int64_t max_batch, const TowerPlacement& p)
    : Tower(graph, max_batch), placement_(p), dev_(p.gpu, p.tf32), host_(std::max(1, p.threads)) {
  dev_.activate();
  const ParameterLayout& layout = graph.layout();
  const int64_t total = layout.total();
  params_d_ = DeviceBuffer(dev_, total);
  grads_d_ = DeviceBuffer(dev_, total);
  const int64_t in = numel(graph.input_shape());
  images_d_ = DeviceBuffer(dev_, max_batch * in);
  labels_d_ = DeviceBuffer(dev_, max_batch);             // int32 in float-sized slots
  row_loss_d_ = DeviceBuffer(dev_, 2 * max_batch);       // doubles
  row_correct_d_ = DeviceBuffer(dev_, max_batch);        // int32
  static_assert(sizeof(kernels::StepNoise) % sizeof(float) == 0);
  noise_d_ = DeviceBuffer(dev_, sizeof(kernels::StepNoise) / sizeof(float));
  noise_arg_ = reinterpret_cast<const kernels::StepNoise*>(noise_d_.data());
  allocate_activations(dev_);
  int64_t scratch = 0;
  for (const auto& l : graph.layers()) scratch = std::max(scratch, l->gpu_scratch(max_batch));
  scratch_ = DeviceBuffer(dev_, std::max<int64_t>(scratch, 1));
  grads_host_ = PinnedBuffer(sizeof(float) * total);
  images_pin_ = PinnedBuffer(sizeof(float) * max_batch * in);
  labels_pin_ = PinnedBuffer(sizeof(int32_t) * max_batch);
  row_loss_h_ = PinnedBuffer(sizeof(double) * max_batch);
  row_correct_h_ = PinnedBuffer(sizeof(int32_t) * max_batch);
  noise_pin_ = PinnedBuffer(sizeof(kernels::StepNoise));
  exec_ = GpuExec{dev_.compute(), dev_.blas(), scratch_.data(), scratch_.size(), dev_.dnn(),
                  &plans_, dev_.tf32(), nullptr, p.cudnn};
  if (p.backward_branches) {
    dev_.make_lane();
    int64_t lane_scratch = 0;
    for (const auto& l : graph.layers())
      lane_scratch = std::max(lane_scratch, l->gpu_lane_scratch(max_batch));
    lane_scratch_ = DeviceBuffer(dev_, std::max<int64_t>(lane_scratch, 1));
    lane_.exec = GpuExec{dev_.lane(), dev_.lane_blas(), lane_scratch_.data(),
                         lane_scratch_.size(), dev_.lane_dnn(), &plans_, dev_.tf32(), nullptr,
                         p.cudnn};
    lane_.test_delay_ns = p.test_backward_delay_ns;
    CUDA_CHECK(cudaEventCreateWithFlags(&lane_.fork, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&lane_.join, cudaEventDisableTiming));
    exec_.lane = &lane_;
  }
  CUDA_CHECK(cudaEventCreateWithFlags(&inputs_ready_, cudaEventDisableTiming));
  CUDA_CHECK(cudaEventCreateWithFlags(&copies_done_, cudaEventDisableTiming));
  layer_done_.resize(graph.layers().size(), nullptr);
  for (size_t i = 0; i < layer_done_.size(); ++i)
    if (has_grads(i)) CUDA_CHECK(cudaEventCreateWithFlags(&layer_done_[i], cudaEventDisableTiming));
}

CudaTower::~CudaTower() {
  cudaSetDevice(dev_.ordinal());
  cudaStreamSynchronize(dev_.compute());
  cudaStreamSynchronize(dev_.copy());
  // The lane, before its scratch goes back to the pool.
  if (lane_.exec.stream != nullptr) cudaStreamSynchronize(lane_.exec.stream);
  drop_graph();
  release_activations();
  for (cudaEvent_t e : layer_done_)
    if (e) cudaEventDestroy(e);
  if (lane_.fork) cudaEventDestroy(lane_.fork);
  if (lane_.join) cudaEventDestroy(lane_.join);
  if (inputs_ready_) cudaEventDestroy(inputs_ready_);
  if (copies_done_) cudaEventDestroy(copies_done_);
}

void CudaTower::drop_graph() {
  if (graph_ != nullptr) cudaGraphExecDestroy(graph_);
  graph_ = nullptr;
  graph_n_ = -1;
}

void CudaTower::load_params(const float* host) {
  dev_.activate();
  CUDA_CHECK(cudaMemcpyAsync(params_d_.data(), host, sizeof(float) * graph().layout().total(),
                             cudaMemcpyHostToDevice, dev_.copy()));
}

void CudaTower::stage_inputs(const float* images, const int32_t* labels, int64_t n) {
  const int64_t in = numel(graph().input_shape());
  // Through pinned staging, so that the H2D is a true asynchronous DMA. The previous step's
  // copies out of the staging have finished: every step waits for its stream before returning.
  std::memcpy(images_pin_.as<float>(), images, sizeof(float) * n * in);
  CUDA_CHECK(cudaMemcpyAsync(images_d_.data(), images_pin_.as<float>(), sizeof(float) * n * in,
                             cudaMemcpyHostToDevice, dev_.copy()));
  stage_labels_and_noise(labels, n);
}

void CudaTower::stage_plans(const kernels::ExamplePlan* plans, const int32_t* labels, int64_t n) {
  // Validated here, where the plans meet the set they index: a kernel would read out of bounds.
  for (int64_t i = 0; i < n; ++i)
    TOWERS_CHECK(plans[i].index >= 0 && plans[i].index < train_held_size_,
                 "--input device: example {} of the batch plans index {} of a training set of {}",
                 i, plans[i].index, train_held_size_);
  std::memcpy(plans_pin_.as<kernels::ExamplePlan>(), plans, sizeof(kernels::ExamplePlan) * n);
  CUDA_CHECK(cudaMemcpyAsync(plans_d_.data(), plans_pin_.as<kernels::ExamplePlan>(),
                             sizeof(kernels::ExamplePlan) * n, cudaMemcpyHostToDevice, dev_.copy()));
  stage_labels_and_noise(labels, n);
  // The batch, made on the compute stream once the plans are in (inputs_ready_).
  kernels::cuda::augment(dev_.compute(), static_cast<const uint8_t*>(train_d_.get()), shape_,
                         reinterpret_cast<const kernels::ExamplePlan*>(plans_d_.data()), n,
                         images_d_.data());
}

void CudaTower::stage_labels_and_noise(const int32_t* labels, int64_t n) {
  std::memcpy(labels_pin_.as<int32_t>(), labels, sizeof(int32_t) * n);
  CUDA_CHECK(cudaMemcpyAsync(labels_d_.data(), labels_pin_.as<int32_t>(), sizeof(int32_t) * n,
                             cudaMemcpyHostToDevice, dev_.copy()));
  // The step's noise goes in with its batch, outside any captured graph, which reads it.
  *noise_pin_.as<kernels::StepNoise>() = noise_;
  CUDA_CHECK(cudaMemcpyAsync(noise_d_.data(), noise_pin_.as<kernels::StepNoise>(), sizeof(noise_),
                             cudaMemcpyHostToDevice, dev_.copy()));
  // Covers the parameter copy too: the copy stream runs in order.
  CUDA_CHECK(cudaEventRecord(inputs_ready_, dev_.copy()));
  CUDA_CHECK(cudaStreamWaitEvent(dev_.compute(), inputs_ready_, 0));
}

void CudaTower::enqueue_forward(int64_t n, bool training) {
  const auto& layers = graph().layers();
  const float* x = images_d_.data();
  for (size_t i = 0; i < layers.size(); ++i) {
    ForwardArgs a = forward_args(i, n, x, params_d_.data(), training);
    layers[i]->forward_gpu(exec_, a);
    x = a.y;
  }
}

LossArgs CudaTower::loss_args(int64_t n, float grad_scale, float* dlogits) {
  LossArgs la;
  la.n = n;
  la.classes = graph().num_classes();
  la.logits = act_.back().data();
  la.labels = reinterpret_cast<const int32_t*>(labels_d_.data());
  la.grad_scale = grad_scale;
  la.dlogits = dlogits;
  la.row_loss = reinterpret_cast<double*>(row_loss_d_.data());
  la.row_correct = reinterpret_cast<int32_t*>(row_correct_d_.data());
  return la;
}

void CudaTower::enqueue_step(int64_t n, float grad_scale) {
  cudaStream_t c = dev_.compute(), k = dev_.copy();
  enqueue_forward(n, true);
  const auto& layers = graph().layers();
  graph().loss().forward_gpu(exec_, loss_args(n, grad_scale, dact_[0].data()));
  int cur = 0;
  for (size_t i = layers.size(); i-- > 0;) {
    kernels::cuda::spin_delay(c, placement_.test_backward_delay_ns);
    layers[i]->backward_gpu(exec_,
                            backward_args(i, n, images_d_.data(), cur, params_d_.data(),
                                          grads_d_.data(), grad_scale));
    cur = 1 - cur;
    if (grads_to_host_ && has_grads(i)) {
      // The layer's variables, with the layout's alignment padding between them.
      const auto [lo, hi] = grad_span_[i];
      CUDA_CHECK(cudaEventRecord(layer_done_[i], c));
      CUDA_CHECK(cudaStreamWaitEvent(k, layer_done_[i], 0));
      CUDA_CHECK(cudaMemcpyAsync(grads_host_.as<float>() + lo, grads_d_.data() + lo,
                                 sizeof(float) * (hi - lo), cudaMemcpyDeviceToHost, k));
    }
  }
  if (epilogue_) epilogue_(c, reinterpret_cast<const double*>(row_loss_d_.data()), n);
  CUDA_CHECK(cudaMemcpyAsync(row_loss_h_.as<double>(), row_loss_d_.data(), sizeof(double) * n,
                             cudaMemcpyDeviceToHost, c));
  CUDA_CHECK(cudaMemcpyAsync(row_correct_h_.as<int32_t>(), row_correct_d_.data(),
                             sizeof(int32_t) * n, cudaMemcpyDeviceToHost, c));
  if (grads_to_host_) {
    // Join: the compute stream (and so the step) ends after the last gradient copy.
    CUDA_CHECK(cudaEventRecord(copies_done_, k));
    CUDA_CHECK(cudaStreamWaitEvent(c, copies_done_, 0));
  }
}

StepStats CudaTower::finish(int64_t n) {
  CUDA_CHECK(cudaStreamSynchronize(dev_.compute()));
  auto r = kernels::sum_rows(n, row_loss_h_.as<double>(), row_correct_h_.as<int32_t>());
  return StepStats{r.loss_sum, r.correct, n};
}

StepStats CudaTower::compute_gradients(const float* images, const int32_t* labels, int64_t n,
                                       float grad_scale) {
  check_batch(n);
  if (before_step_) before_step_();
  dev_.activate();
  stage_inputs(images, labels, n);
  return run_step(n, grad_scale);
}

namespace {
// --input device: one copy of a training set per GPU, shared by the towers on it (they only
// read it), keyed by the GPU, the set's buffer and size, and a hash of its bytes (another set
// may come to live at a freed one's address). The last tower that lets go gives it back to
// the GPU's pool.
struct HeldSet {
  int ordinal;
  const uint8_t* bytes;
  size_t size;
  size_t digest;
  std::weak_ptr<void> copy;
};
std::mutex held_mu;
std::vector<HeldSet> held_sets;

std::shared_ptr<void> train_copy_on(CudaDevice& dev, const data::Dataset& train) {
  const size_t bytes = train.images.size();
  const int ordinal = dev.ordinal();
  const size_t digest = std::hash<std::string_view>{}(
      std::string_view(reinterpret_cast<const char*>(train.images.data()), bytes));
  std::lock_guard<std::mutex> l(held_mu);
  std::erase_if(held_sets, [](const HeldSet& h) { return h.copy.expired(); });
  for (const HeldSet& h : held_sets)
    if (h.ordinal == ordinal && h.bytes == train.images.data() && h.size == bytes &&
        h.digest == digest)
      if (std::shared_ptr<void> p = h.copy.lock()) return p;
  CudaMemoryPool& pool = CudaMemoryPool::of(ordinal);
  void* p = nullptr;
  try {
    p = pool.allocate(std::max<size_t>(bytes, 1));
  } catch (const std::exception& e) {
    TOWERS_BAD_INPUT("--input device: the training set '{}' ({:.0f} MB) does not fit on GPU {}: "
                     "{}; use --input host", train.name, bytes / 1e6, ordinal, e.what());
  }
  std::shared_ptr<void> copy(p, [ordinal](void* q) { CudaMemoryPool::of(ordinal).release(q); });
  CUDA_CHECK(cudaMemcpyAsync(p, train.images.data(), bytes, cudaMemcpyHostToDevice, dev.copy()));
  CUDA_CHECK(cudaStreamSynchronize(dev.copy()));
  held_sets.push_back({ordinal, train.images.data(), bytes, digest, copy});
  return copy;
}
}  // namespace

void CudaTower::hold_train_data(const data::Dataset& train, const data::AugmentConfig& config) {
  const kernels::AugmentShape shape = data::augment_shape(config, train);
  const bool same_shape = shape.channels == shape_.channels && shape.height == shape_.height &&
                          shape.width == shape_.width && shape.out_h == shape_.out_h &&
                          shape.out_w == shape_.out_w && shape.brightness == shape_.brightness &&
                          shape.contrast == shape_.contrast && shape.standardize == shape_.standardize;
  // Held already: the same set (object, buffer and size) and the same transform. A set
  // changed in place under the same buffer is not seen: the set must not change while held.
  if (train_held_ == &train && train_held_bytes_ == train.images.data() &&
      train_held_size_ == train.size() && same_shape)
    return;
  train.validate();
  data::validate(config, train);
  TOWERS_REQUIRE(data::example_shape(config, train) == graph().input_shape(),
                 "--input device: the examples of '{}' are {} after the transform, but the "
                 "model's input is {}", train.name, to_string(data::example_shape(config, train)),
                 to_string(graph().input_shape()));
  dev_.activate();
  train_held_ = nullptr;
  train_d_.reset();
  train_d_ = train_copy_on(dev_, train);
  if (plans_d_.data() == nullptr) {
    static_assert(sizeof(kernels::ExamplePlan) % sizeof(float) == 0);
    plans_d_ = DeviceBuffer(dev_, max_batch() * static_cast<int64_t>(sizeof(kernels::ExamplePlan) / sizeof(float)));
    plans_pin_ = PinnedBuffer(sizeof(kernels::ExamplePlan) * max_batch());
  }
  train_held_ = &train;
  train_held_bytes_ = train.images.data();
  train_held_size_ = train.size();
  shape_ = shape;
}

StepStats CudaTower::compute_gradients_planned(const kernels::ExamplePlan* plans,
                                               const int32_t* labels, int64_t n, float grad_scale) {
  check_batch(n);
  TOWERS_CHECK(train_held_ != nullptr, "compute_gradients_planned before hold_train_data");
  if (before_step_) before_step_();
  dev_.activate();
  stage_plans(plans, labels, n);
  ++planned_steps_;
  return run_step(n, grad_scale);
}

StepStats CudaTower::run_step(int64_t n, float grad_scale) {
  // --sync-bn: the step waits on the host for the other towers' channel sums, inside the
  // BatchNorm layers, which no CUDA graph can hold; it runs eagerly.
  if (!placement_.cuda_graphs || exchange_ != nullptr) {
    enqueue_step(n, grad_scale);
    return finish(n);
  }
  if (graph_n_ != n || graph_scale_ != grad_scale || graph_to_host_ != grads_to_host_) {
    // A new (batch, scale): this step runs eagerly, so that cuBLAS and the driver do their
    // first-call set-up outside any capture; the next step with the same key is captured.
    // The key is set once the eager step has gone through, so a step that failed (a layer's
    // set-up, say) is run eagerly again, never captured first.
    drop_graph();
    enqueue_step(n, grad_scale);
    const StepStats s = finish(n);
    graph_n_ = n;
    graph_scale_ = grad_scale;
    graph_to_host_ = grads_to_host_;
    return s;
  }
  if (graph_ == nullptr) capture(n, grad_scale);
  CUDA_CHECK(cudaGraphLaunch(graph_, dev_.compute()));
  ++replays_;
  return finish(n);
}

void CudaTower::capture(int64_t n, float grad_scale) {
  cudaStream_t c = dev_.compute(), k = dev_.copy();
  // Capture records the work without running it; the replay runs it. Thread-local mode: other
  // towers' threads may capture or launch at the same time.
  cudaGraph_t g = nullptr;
  CUDA_CHECK(cudaStreamBeginCapture(c, cudaStreamCaptureModeThreadLocal));
  try {
    enqueue_step(n, grad_scale);
  } catch (...) {
    // Rejoin the copy stream and the lane (either may have joined the capture; a layer that
    // threw between its fork and its join left the lane in it) before ending the capture, so
    // that every stream is usable again; the capture itself is discarded.
    cudaEventRecord(copies_done_, k);
    cudaStreamWaitEvent(c, copies_done_, 0);
    cudaStreamCaptureStatus lane_status = cudaStreamCaptureStatusNone;
    if (exec_.lane != nullptr &&
        cudaStreamIsCapturing(lane_.exec.stream, &lane_status) == cudaSuccess &&
        lane_status == cudaStreamCaptureStatusActive) {
      cudaEventRecord(lane_.join, lane_.exec.stream);
      cudaStreamWaitEvent(c, lane_.join, 0);
    }
    cudaStreamEndCapture(c, &g);
    if (g != nullptr) cudaGraphDestroy(g);
    cudaGetLastError();
    throw;
  }
  CUDA_CHECK(cudaStreamEndCapture(c, &g));
  cudaGraphExec_t exec = nullptr;
  const cudaError_t e = cudaGraphInstantiate(&exec, g, 0);
  cudaGraphDestroy(g);
  CUDA_CHECK(e);
  graph_ = exec;
  ++captures_;
}

void CudaTower::copy_logits(float* out, int64_t n) {
  check_batch(n);
  dev_.activate();
  cudaStream_t c = dev_.compute();
  CUDA_CHECK(cudaMemcpyAsync(out, act_.back().data(), sizeof(float) * n * graph().num_classes(),
                             cudaMemcpyDeviceToHost, c));
  CUDA_CHECK(cudaStreamSynchronize(c));
}

StepStats CudaTower::evaluate(const float* images, const int32_t* labels, int64_t n) {
  check_batch(n);
  dev_.activate();
  stage_inputs(images, labels, n);
  enqueue_forward(n, false);
  cudaStream_t c = dev_.compute();
  graph().loss().forward_gpu(exec_, loss_args(n, 0.0f, nullptr));
  CUDA_CHECK(cudaMemcpyAsync(row_loss_h_.as<double>(), row_loss_d_.data(), sizeof(double) * n,
                             cudaMemcpyDeviceToHost, c));
  CUDA_CHECK(cudaMemcpyAsync(row_correct_h_.as<int32_t>(), row_correct_d_.data(),
                             sizeof(int32_t) * n, cudaMemcpyDeviceToHost, c));
  return finish(n);
}

}  // namespace towers
