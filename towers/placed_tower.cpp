#include "towers/placed_tower.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <mutex>

#include <oneapi/tbb/task_group.h>

#include "core/check.h"
#include "core/clock.h"
#include "core/parallel.h"
#include "core/relaxed.h"
#include "kernels/reduce.h"

#if TOWERS_HAVE_CUDA
#include <cuda_runtime.h>

#include "core/cuda_check.h"
#include "core/cuda_device.h"
#include "core/gpu.h"
#endif

namespace towers {

// One part: its layers, device, parameters, activations and gradient buffers. The buffers are
// declared after the devices, so they go back to them before they go.
struct PlacedTower::Part {
  PlacedPart spec;
  int pos = 0;             // index in the placement
  int64_t lo = 0, hi = 0;  // the span [lo, hi) of the flat layout its variables cover
  std::unique_ptr<CpuDevice> device;  // its threads (on a GPU part: its launches and waits)
#if TOWERS_HAVE_CUDA
  // A GPU part: its buffers live and its layers run there, on the GPU's compute stream.
  std::unique_ptr<CudaDevice> gpu;
  GpuPlans plans;
  GpuExec exec;
#endif
  Device* mem = nullptr;  // where its buffers live: device, or the GPU
  int memory = -1;        // -1: host memory; else the GPU's ordinal
  DeviceBuffer params;                   // [lo, hi) of the flat array
  // Per layer of the part: its outputs for max_batch examples, and its saved buffer, a slice
  // per micro-batch (PlacedTower::saved).
  std::vector<DeviceBuffer> act, saved;
  // The error at the part's output, from the next part's backward, max_batch examples (not in
  // the last part); errors between the part's own layers, one micro-batch.
  DeviceBuffer err, dact[2];
  std::vector<DeviceBuffer> micro_grads;  // [lo, hi) for micro-batches 1..M-1 (0: grads_)
  // Where the part before lives in other memory (or the part is on a GPU and first): its first
  // layer's input, copied in; and (not first) its first layer's error, which the part before
  // copies into its err. max_batch examples each.
  DeviceBuffer in, dx_out;
  // A GPU part: micro-batch 0's gradient span (copied to the tower's host gradient once summed),
  // the layers' scratch, and the last part's labels, per-example losses and hits, and the
  // step's noise.
  DeviceBuffer grads, scratch, labels, row_loss, row_correct, noise;
#if TOWERS_HAVE_CUDA
  // A GPU part's jobs of a step, on its stream: job j begins (start[j]) once the waits for the
  // jobs it needs are met and ends at end[j]. A part that needs job j waits for end[j] alone:
  // a GPU part on its own stream, a CPU part on the host; nothing waits for a whole stream or
  // device until the step's end. Timed: the part's busy time is the GPU's, start to end.
  std::vector<cudaEvent_t> start, end;
  ~Part() {
    for (cudaEvent_t e : start) cudaEventDestroy(e);
    for (cudaEvent_t e : end) cudaEventDestroy(e);
  }
#endif
  double busy = 0.0;  // seconds in this step's jobs
};

namespace {
// Copies floats between the memories of two parts (-1: host), ordered on the consumer's
// stream when it is a GPU part (stream: its compute stream), else before returning.
void copy_between(float* dst, int dst_memory, const float* src, int src_memory, int64_t count,
                  void* stream) {
  const size_t bytes = sizeof(float) * static_cast<size_t>(count);
  if (count == 0) return;
  if (dst_memory < 0 && src_memory < 0) {
    std::memcpy(dst, src, bytes);
    return;
  }
#if TOWERS_HAVE_CUDA
  // A CPU consumer copies on the GPU side's device (no context is made on another).
  if (stream == nullptr) CUDA_CHECK(cudaSetDevice(dst_memory >= 0 ? dst_memory : src_memory));
  const cudaMemcpyKind kind = dst_memory < 0   ? cudaMemcpyDeviceToHost
                              : src_memory < 0 ? cudaMemcpyHostToDevice
                              : dst_memory == src_memory ? cudaMemcpyDeviceToDevice
                                                         : cudaMemcpyDefault;
  if (stream != nullptr)
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, kind, static_cast<cudaStream_t>(stream)));
  else
    CUDA_CHECK(cudaMemcpy(dst, src, bytes, kind));
#else
  (void)stream;
  TOWERS_FAIL("a copy between GPU parts in a build without CUDA");
#endif
}
}  // namespace

nlohmann::json PipelineStats::to_json() const {
  nlohmann::json ps = nlohmann::json::array();
  for (size_t p = 0; p < parts.size(); ++p) {
    const double idle = std::max(step_seconds - parts[p].busy_seconds, 0.0);
    ps.push_back({{"part", p},
                  {"device", parts[p].device},
                  {"layers", parts[p].layers},
                  {"threads", parts[p].threads},
                  {"busy_seconds", parts[p].busy_seconds},
                  {"idle_seconds", idle},
                  {"idle_fraction", step_seconds > 0.0 ? idle / step_seconds : 0.0}});
  }
  return {{"micro_batches", micro_batches},
          {"steps", steps},
          {"step_seconds", step_seconds},
          {"parts", ps}};
}

// A GPU part's thread only launches and waits: it gets one, and the CPU parts share the rest.
std::vector<int> PlacedTower::part_threads(const Placement& placement, int threads) {
  int cpu_parts = 0;
  for (const PlacedPart& p : placement.parts) cpu_parts += p.kind == DeviceKind::Cpu;
  const int share = std::max(1, threads / std::max(1, cpu_parts));
  std::vector<int> out;
  for (const PlacedPart& p : placement.parts)
    out.push_back(p.threads > 0 ? p.threads : p.kind == DeviceKind::Cuda ? 1 : share);
  return out;
}

namespace {
int sum(const std::vector<int>& v) {
  int s = 0;
  for (int x : v) s += x;
  return s;
}
}  // namespace

PlacedTower::PlacedTower(const Graph& graph, int64_t max_batch, const Placement& placement,
                         int micro_batches, int threads, const CudnnRules& cudnn)
    : Tower(graph, max_batch),
      micro_batches_(micro_batches),
      total_threads_(sum(part_threads(placement, threads))),
      host_(total_threads_),
      driver_(std::max<int>(1, static_cast<int>(placement.parts.size()))) {
  TOWERS_CHECK(!placement.parts.empty(), "a placed tower needs at least one part");
  TOWERS_CHECK(micro_batches >= 1, "a placed tower needs at least one micro-batch, got {}",
               micro_batches);
  const auto& layers = graph.layers();
  grads_ = DeviceBuffer(host_, graph.layout().total());
  row_loss_.assign(max_batch, 0.0);
  row_correct_.assign(max_batch, 0);
  const int64_t micro = ceil_div(max_batch, micro_batches);  // the largest micro-batch
  micro_ = micro;
  const std::vector<int> th = part_threads(placement, threads);
  size_t next_layer = 0;
  int64_t prev_hi = 0;
  part_of_.assign(layers.size(), nullptr);
  for (size_t q = 0; q < placement.parts.size(); ++q) {
    const PlacedPart& spec = placement.parts[q];
    TOWERS_CHECK(spec.first == next_layer && spec.last > spec.first && spec.last <= layers.size(),
                 "part {} holds layers [{}, {}), expected a run from layer {}", q, spec.first,
                 spec.last, next_layer);
    next_layer = spec.last;
    auto part = std::make_unique<Part>();
    part->spec = spec;
    part->pos = static_cast<int>(q);
    part->device = std::make_unique<CpuDevice>(th[q]);
    part->mem = part->device.get();
    if (spec.kind == DeviceKind::Cuda) {
#if TOWERS_HAVE_CUDA
      const size_t have = list_gpus().gpus.size();
      TOWERS_REQUIRE(static_cast<size_t>(spec.index) < have,
                     "part {} is placed on cuda:{}, but this machine has {} GPU(s)", q + 1,
                     spec.index, have);
      static_assert(kMaxGpuPartMicroBatches <= kernels::cuda::kMaxTreeBlocks);
      TOWERS_REQUIRE(micro_batches <= kMaxGpuPartMicroBatches,
                     "part {} on cuda:{}: at most {} micro-batches, got {}", q + 1, spec.index,
                     kMaxGpuPartMicroBatches, micro_batches);
      part->gpu = std::make_unique<CudaDevice>(spec.index, false);
      part->mem = part->gpu.get();
      part->memory = spec.index;
#else
      TOWERS_BAD_INPUT("part {} is placed on cuda:{}: this towers was built without CUDA", q + 1,
                       spec.index);
#endif
    }
    Device& dev = *part->mem;
    // The span of its variables; parts own disjoint, increasing spans (the layout follows the
    // layers' order).
    int64_t lo = graph.layout().total(), hi = 0, widest = 0;
    for (size_t i = spec.first; i < spec.last; ++i) {
      for (const Variable* v : vars_[i]) {
        lo = std::min(lo, v->offset);
        hi = std::max(hi, v->offset + v->size);
      }
      part->act.emplace_back(dev, max_batch * numel(layers[i]->out_shape()));
      part->saved.emplace_back(dev, micro_batches * saved_floats(*layers[i], micro));
      widest = std::max(widest, numel(layers[i]->out_shape()));
      part_of_[i] = part.get();
    }
    if (lo >= hi) lo = hi = prev_hi;  // no variables
    TOWERS_CHECK(lo >= prev_hi, "part {}'s variables overlap the previous part's", q);
    prev_hi = hi;
    part->lo = lo;
    part->hi = hi;
    part->params = DeviceBuffer(dev, hi - lo);
    if (q + 1 < placement.parts.size())
      part->err = DeviceBuffer(dev, max_batch * numel(layers[spec.last - 1]->out_shape()));
    for (auto& d : part->dact) d = DeviceBuffer(dev, micro * widest);
    if (hi > lo)
      for (int m = 1; m < micro_batches; ++m) part->micro_grads.emplace_back(dev, hi - lo);
    const int64_t in_floats = max_batch * numel(layers[spec.first]->in_shape());
    const int before = q == 0 ? -1 : parts_[q - 1]->memory;
    if (before != part->memory) part->in = DeviceBuffer(dev, in_floats);
    if (q > 0 && before != part->memory) part->dx_out = DeviceBuffer(dev, in_floats);
#if TOWERS_HAVE_CUDA
    if (part->gpu) {
      int64_t scratch = 1;
      for (size_t i = spec.first; i < spec.last; ++i)
        scratch = std::max(scratch, layers[i]->gpu_scratch(micro));
      part->scratch = DeviceBuffer(dev, scratch);
      if (hi > lo) part->grads = DeviceBuffer(dev, hi - lo);
      if (q + 1 == placement.parts.size()) {
        part->labels = DeviceBuffer(dev, max_batch);           // int32 in float-sized slots
        part->row_loss = DeviceBuffer(dev, 2 * max_batch);     // doubles
        part->row_correct = DeviceBuffer(dev, max_batch);      // int32
      }
      static_assert(sizeof(kernels::StepNoise) % sizeof(float) == 0);
      part->noise = DeviceBuffer(dev, sizeof(kernels::StepNoise) / sizeof(float));
      CudaDevice& g = *part->gpu;
      part->exec = GpuExec{g.compute(), g.blas(), part->scratch.data(), part->scratch.size(),
                           g.dnn(), &part->plans, g.tf32(), nullptr, cudnn};
      g.activate();
      for (int j = 0; j < 2 * micro_batches; ++j) {  // a step's jobs: M forwards, M backwards
        part->start.push_back(nullptr);
        CUDA_CHECK(cudaEventCreateWithFlags(&part->start.back(), cudaEventDefault));
        part->end.push_back(nullptr);
        CUDA_CHECK(cudaEventCreateWithFlags(&part->end.back(), cudaEventDefault));
      }
    }
#endif
    stats_.parts.push_back({spec.device_name(), spec.layer_names(graph), th[q], 0.0});
    parts_.push_back(std::move(part));
  }
  TOWERS_CHECK(next_layer == layers.size(), "the parts cover {} of {} layers", next_layer,
               layers.size());
  stats_.micro_batches = micro_batches;
}

PlacedTower::~PlacedTower() = default;

std::vector<std::string> PlacedTower::plan_notes() const {
  std::vector<std::string> out;
#if TOWERS_HAVE_CUDA
  for (const auto& part : parts_)
    for (const std::string& n : part->plans.notes())
      out.push_back(part->spec.device_name() + ": " + n);
#endif
  return out;
}

const float* PlacedTower::part_params(int q) const { return parts_.at(q)->params.data(); }

std::pair<int64_t, int64_t> PlacedTower::update_span(int q) const {
  const size_t i = static_cast<size_t>(q);
  TOWERS_CHECK(i < parts_.size(), "part {} of a tower of {} parts", q, parts_.size());
  return {i == 0 ? 0 : parts_[i]->lo,
          i + 1 == parts_.size() ? graph().layout().total() : parts_[i + 1]->lo};
}

void PlacedTower::run_update(int64_t total, const std::function<void(int64_t, int64_t)>& f) {
  TOWERS_CHECK(total == graph().layout().total(),
               "an update of {} floats on a placed tower whose layout has {}", total,
               graph().layout().total());
  // The driver arena has a slot per part, so every part's span starts at once; each task
  // enters its part's arena, where the apply uses that part's threads.
  driver_.execute([&] {
    oneapi::tbb::task_group tg;
    for (int q = 0; q < parts(); ++q) {
      const auto [lo, hi] = update_span(q);
      if (lo == hi) continue;
      CpuDevice* threads = parts_[q]->device.get();
      tg.run([&f, threads, lo, hi] { threads->execute([&] { f(lo, hi); }); });
    }
    tg.wait();
  });
}

void PlacedTower::load_params(const float* host) {
  for (auto& p : parts_) p->mem->copy_in(p->params.data(), host + p->lo, p->hi - p->lo);
}

// A GPU part copies its span in as a GPU tower does (a DMA reading while others may write,
// which async modes accept).
void PlacedTower::load_params_shared(const float* host) {
  for (auto& p : parts_)
    if (p->memory < 0)
      load_relaxed(host + p->lo, p->params.data(), p->hi - p->lo);
    else
      p->mem->copy_in(p->params.data(), host + p->lo, p->hi - p->lo);
}

void* PlacedTower::stream_of(Part& part) {
#if TOWERS_HAVE_CUDA
  if (part.gpu) {
    part.gpu->activate();
    return part.gpu->compute();
  }
#endif
  (void)part;
  return nullptr;
}

const kernels::StepNoise* PlacedTower::stage_noise(Part& part, const kernels::StepNoise& nz) {
#if TOWERS_HAVE_CUDA
  if (part.gpu) {
    // From the caller's memory, before the call returns (a pageable source); the part's
    // previous job has finished with the device copy.
    CUDA_CHECK(cudaMemcpyAsync(part.noise.data(), &nz, sizeof(nz), cudaMemcpyHostToDevice,
                               part.gpu->compute()));
    return reinterpret_cast<const kernels::StepNoise*>(part.noise.data());
  }
#endif
  (void)part;
  return &nz;
}

// Before job j of `part` reads what job j of part `from` wrote (the part before, for a
// forward; the part after, for a backward): a GPU producer's end[j] is waited for, on the
// consumer's stream (a GPU part) or on the host (a CPU part, which reads or copies it at once).
// A CPU producer's job has returned before this job started.
void PlacedTower::await_job(Part& part, int from, int j) {
#if TOWERS_HAVE_CUDA
  if (from < 0 || from >= parts()) return;
  const Part& producer = *parts_[from];
  if (!producer.gpu) return;
  if (part.gpu)
    CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream_of(part)), producer.end[j], 0));
  else
    CUDA_CHECK(cudaEventSynchronize(producer.end[j]));
#else
  (void)part, (void)from, (void)j;
#endif
}

void PlacedTower::begin_job(Part& part, int j) {
#if TOWERS_HAVE_CUDA
  if (part.gpu)
    CUDA_CHECK(cudaEventRecord(part.start[j], static_cast<cudaStream_t>(stream_of(part))));
#endif
  (void)part, (void)j;
}

// A job's end: a GPU part marks it on its stream (end[j]) and goes on to its next job, whose
// work queues behind it.
void PlacedTower::end_job(Part& part, int j) {
#if TOWERS_HAVE_CUDA
  if (part.gpu)
    CUDA_CHECK(cudaEventRecord(part.end[j], static_cast<cudaStream_t>(stream_of(part))));
#endif
  (void)part, (void)j;
}

// The step's end: every GPU part's last job is done (so are its copies to the host, the
// gradient's and the losses'), and its busy time is its jobs' GPU time.
void PlacedTower::finish_step(int jobs) {
#if TOWERS_HAVE_CUDA
  for (auto& p : parts_) {
    if (!p->gpu) continue;
    CUDA_CHECK(cudaEventSynchronize(p->end[jobs - 1]));
    double ms_sum = 0.0;
    for (int j = 0; j < jobs; ++j) {
      float ms = 0.0f;
      CUDA_CHECK(cudaEventElapsedTime(&ms, p->start[j], p->end[j]));
      ms_sum += ms;
    }
    p->busy = ms_sum / 1e3;
  }
#else
  (void)jobs;
#endif
}

const float* PlacedTower::first_input(Part& part, int64_t b0, int64_t n, const float* images,
                                      bool pull) {
  const size_t first = part.spec.first;
  const int64_t f = numel(graph().layers()[first]->in_shape());
  const float* x = input(first, b0, images);
  if (part.in.data() == nullptr) return x;
  float* dst = part.in.data() + b0 * f;
  if (pull) {
    const int src = part.pos == 0 ? -1 : parts_[part.pos - 1]->memory;
    copy_between(dst, part.memory, x, src, n * f, stream_of(part));
  }
  return dst;
}

const float* PlacedTower::input(size_t i, int64_t b0, const float* images) const {
  if (i == 0) return images + b0 * numel(graph().input_shape());
  return output(i - 1, b0);
}

float* PlacedTower::output(size_t i, int64_t b0) const {
  const Part& p = *part_of_[i];
  return p.act[i - p.spec.first].data() + b0 * numel(graph().layers()[i]->out_shape());
}

float* PlacedTower::saved(size_t i, int m) const {
  const Part& p = *part_of_[i];
  return p.saved[i - p.spec.first].data() + m * saved_floats(*graph().layers()[i], micro_);
}

void PlacedTower::forward(Part& part, int m, int64_t b0, int64_t b1, const float* images,
                          bool training) {
  const auto& layers = graph().layers();
  // The micro-batch's examples keep their positions in the step: the masks of one device.
  const kernels::StepNoise nz{noise_.key, noise_.first_example + b0};
  stream_of(part);  // a GPU part's device, current
  const float* x0 = first_input(part, b0, b1 - b0, images, true);
  const kernels::StepNoise* noise = stage_noise(part, nz);
  for (size_t i = part.spec.first; i < part.spec.last; ++i) {
    ForwardArgs a;
    a.n = b1 - b0;
    a.x = i == part.spec.first ? x0 : input(i, b0, images);
    a.y = output(i, b0);
    bind_variables(i, part.params.data(), part.lo, a);
    a.saved = saved(i, m);
    a.training = training;
    a.noise = noise;
#if TOWERS_HAVE_CUDA
    if (part.gpu) {
      layers[i]->forward_gpu(part.exec, a);
      continue;
    }
#endif
    layers[i]->forward(a);
  }
}

// The loss of examples [b0, b1) on a GPU last part: the loss node's kernel over the rows, and
// their per-example losses and hits copied out, which run() sums on the host in example order.
void PlacedTower::loss_rows_gpu(Part& part, int64_t b0, int64_t b1, const int32_t* labels,
                                float grad_scale, float* dlogits) {
#if TOWERS_HAVE_CUDA
  const int64_t n = b1 - b0, k = graph().num_classes();
  auto s = static_cast<cudaStream_t>(stream_of(part));
  auto* lab = reinterpret_cast<int32_t*>(part.labels.data()) + b0;
  auto* loss = reinterpret_cast<double*>(part.row_loss.data()) + b0;
  auto* hits = reinterpret_cast<int32_t*>(part.row_correct.data()) + b0;
  CUDA_CHECK(cudaMemcpyAsync(lab, labels + b0, sizeof(int32_t) * n, cudaMemcpyHostToDevice, s));
  LossArgs la;
  la.n = n;
  la.classes = k;
  la.logits = output(graph().layers().size() - 1, b0);
  la.labels = lab;
  la.grad_scale = grad_scale;
  la.dlogits = dlogits;
  la.row_loss = loss;
  la.row_correct = hits;
  graph().loss().forward_gpu(part.exec, la);
  CUDA_CHECK(cudaMemcpyAsync(row_loss_.data() + b0, loss, sizeof(double) * n,
                             cudaMemcpyDeviceToHost, s));
  CUDA_CHECK(cudaMemcpyAsync(row_correct_.data() + b0, hits, sizeof(int32_t) * n,
                             cudaMemcpyDeviceToHost, s));
#else
  (void)part, (void)b0, (void)b1, (void)labels, (void)grad_scale, (void)dlogits;
#endif
}

// The loss of examples [b0, b1), one example per call: each example's loss is then exactly
// its term of the batch's sum, and run() adds them in example order, as the loss node does
// over a whole batch.
void PlacedTower::loss_rows(int64_t b0, int64_t b1, const int32_t* labels, float grad_scale,
                            float* dlogits) {
  const int64_t k = graph().num_classes();
  const float* logits = output(graph().layers().size() - 1, 0);
  for (int64_t e = b0; e < b1; ++e) {
    LossArgs la;
    la.n = 1;
    la.classes = k;
    la.logits = logits + e * k;
    la.labels = labels + e;
    la.grad_scale = grad_scale;
    la.dlogits = dlogits != nullptr ? dlogits + (e - b0) * k : nullptr;
    const LossSums r = graph().loss().forward(la);
    row_loss_[e] = r.loss_sum;
    row_correct_[e] = static_cast<int32_t>(r.correct);
  }
}

void PlacedTower::backward(Part& part, int m, int64_t b0, int64_t b1, const float* images,
                           const int32_t* labels, float grad_scale) {
  const auto& layers = graph().layers();
  const bool last_part = part.pos + 1 == parts();
  const bool on_gpu = part.memory >= 0;
  const kernels::StepNoise nz{noise_.key, noise_.first_example + b0};
  void* stream = stream_of(part);
  const kernels::StepNoise* noise = stage_noise(part, nz);
  // Micro-batch 0 writes the part's span of the tower's gradient (a GPU part: its own device
  // span), the others buffers of their own; the sum comes after the part's last backward.
  float* g = part.hi == part.lo ? nullptr
             : m > 0            ? part.micro_grads[m - 1].data()
             : on_gpu           ? part.grads.data()
                                : grads_.data() + part.lo;
  const float* dy = nullptr;
  int buf = 0;
  if (last_part) {
    if (on_gpu)
      loss_rows_gpu(part, b0, b1, labels, grad_scale, part.dact[0].data());
    else
      loss_rows(b0, b1, labels, grad_scale, part.dact[0].data());
    dy = part.dact[0].data();
    buf = 1;
  } else {
    const int64_t f = numel(layers[part.spec.last - 1]->out_shape());
    float* err = part.err.data() + b0 * f;
    const Part& next = *parts_[part.pos + 1];
    // The part after lives elsewhere: its error for us is in its dx_out.
    if (next.memory != part.memory)
      copy_between(err, part.memory, next.dx_out.data() + b0 * f, next.memory, (b1 - b0) * f,
                   stream);
    dy = err;
  }
  const float* x0 = first_input(part, b0, b1 - b0, images, false);
  for (size_t i = part.spec.last; i-- > part.spec.first;) {
    BackwardArgs a;
    a.n = b1 - b0;
    a.x = i == part.spec.first ? x0 : input(i, b0, images);
    a.y = output(i, b0);
    a.dy = dy;
    if (i > part.spec.first) {
      a.dx = part.dact[buf].data();
      buf = 1 - buf;
    } else if (part.pos > 0) {
      // The error crosses to the part before: its slice of that part's err buffer, or of our
      // dx_out when that part lives elsewhere (it copies it in).
      const int64_t f = numel(layers[i]->in_shape());
      const Part& before = *parts_[part.pos - 1];
      a.dx = before.memory == part.memory ? before.err.data() + b0 * f : part.dx_out.data() + b0 * f;
    }
    bind_variables(i, part.params.data(), g, part.lo, a);
    a.state_weight = static_cast<float>(b1 - b0) * grad_scale;
    a.saved = saved(i, m);
    a.noise = noise;
#if TOWERS_HAVE_CUDA
    if (on_gpu) {
      layers[i]->backward_gpu(part.exec, a);
      dy = a.dx;
      continue;
    }
#endif
    layers[i]->backward(a);
    dy = a.dx;
  }
}

// After a part's last backward (micro-batch 0): its micro-batches' gradients tree-summed in
// micro-batch order, and a GPU part's span copied to the tower's host gradient.
void PlacedTower::sum_gradient(Part& part, int mbs) {
  if (part.hi == part.lo) return;
#if TOWERS_HAVE_CUDA
  if (part.gpu) {
    auto s = static_cast<cudaStream_t>(stream_of(part));
    if (mbs > 1) {
      std::vector<float*> blocks{part.grads.data()};
      for (int k = 1; k < mbs; ++k) blocks.push_back(part.micro_grads[k - 1].data());
      kernels::cuda::tree_sum(s, blocks.data(), mbs, part.hi - part.lo);
    }
    CUDA_CHECK(cudaMemcpyAsync(grads_.data() + part.lo, part.grads.data(),
                               sizeof(float) * (part.hi - part.lo), cudaMemcpyDeviceToHost, s));
    return;
  }
#endif
  if (mbs > 1) {
    std::vector<float*> blocks{grads_.data() + part.lo};
    for (int k = 1; k < mbs; ++k) blocks.push_back(part.micro_grads[k - 1].data());
    for_chunks(part.hi - part.lo, 1 << 14, [&](int64_t, int64_t b, int64_t e) {
      kernels::cpu::tree_sum(blocks.data(), mbs, b, e);
    });
  }
}

StepStats PlacedTower::run(const float* images, const int32_t* labels, int64_t n, float grad_scale,
                           bool training) {
  check_batch(n);
  const int mbs = static_cast<int>(std::min<int64_t>(micro_batches_, n));
  std::vector<int64_t> at(mbs + 1);  // micro-batch m is examples [at[m], at[m + 1])
  for (int m = 0; m <= mbs; ++m) at[m] = m * n / mbs;
  const int P = parts();
  // Part q's jobs in order: the forwards of micro-batches 0..mbs-1, then (training) the
  // backwards of mbs-1..0. Job j of part q waits for job j of part q-1 (a forward) or of part
  // q+1 (a backward): the same index, since every part runs the same schedule.
  const int jobs = training ? 2 * mbs : mbs;
  std::mutex mu;
  std::vector<int> done(P, 0);  // jobs finished, per part
  std::vector<char> running(P, 0);
  auto ready = [&](int q) {  // under mu
    const int j = done[q];
    if (running[q] || j == jobs) return false;
    if (j < mbs) return q == 0 || done[q - 1] > j;
    return q + 1 == P || done[q + 1] > j;
  };
  for (auto& p : parts_) p->busy = 0.0;

  oneapi::tbb::task_group tasks;
  std::function<void(int, int)> job;
  auto start_ready = [&](int from, int to) {  // parts [from, to], clamped
    std::vector<std::pair<int, int>> go;
    {
      std::lock_guard<std::mutex> l(mu);
      for (int q = std::max(from, 0); q <= std::min(to, P - 1); ++q)
        if (ready(q)) {
          running[q] = 1;
          go.emplace_back(q, done[q]);
        }
    }
    for (const auto& [q, j] : go) tasks.run([&job, q = q, j = j] { job(q, j); });
  };
  job = [&](int q, int j) {
    Part& part = *parts_[q];
    part.device->execute([&] {
      const auto t0 = Clock::now();
      await_job(part, j < mbs ? q - 1 : q + 1, j);
      begin_job(part, j);
      if (j < mbs) {
        forward(part, j, at[j], at[j + 1], images, training);
        if (!training && q + 1 == P) {
          if (part.memory >= 0)
            loss_rows_gpu(part, at[j], at[j + 1], labels, 0.0f, nullptr);
          else
            loss_rows(at[j], at[j + 1], labels, 0.0f, nullptr);
        }
      } else {
        const int m = jobs - 1 - j;
        backward(part, m, at[m], at[m + 1], images, labels, grad_scale);
        if (m == 0) sum_gradient(part, mbs);
      }
      end_job(part, j);
      if (part.memory < 0) part.busy += seconds_since(t0);  // a GPU part's: finish_step
    });
    {
      std::lock_guard<std::mutex> l(mu);
      running[q] = 0;
      ++done[q];
    }
    start_ready(q - 1, q + 1);
  };
  driver_.execute([&] {
    start_ready(0, P - 1);
    tasks.wait();
  });
  TOWERS_CHECK(std::all_of(done.begin(), done.end(), [&](int d) { return d == jobs; }),
               "a placed tower's step ended with jobs not run");
  finish_step(jobs);

  StepStats r;
  r.examples = n;
  for (int64_t e = 0; e < n; ++e) {
    r.loss_sum += row_loss_[e];
    r.correct += row_correct_[e];
  }
  return r;
}

StepStats PlacedTower::compute_gradients(const float* images, const int32_t* labels, int64_t n,
                                         float grad_scale) {
  const auto t0 = Clock::now();
  const StepStats r = run(images, labels, n, grad_scale, true);
  stats_.steps += 1;
  stats_.step_seconds += seconds_since(t0);
  for (size_t p = 0; p < parts_.size(); ++p) stats_.parts[p].busy_seconds += parts_[p]->busy;
  return r;
}

void PlacedTower::copy_logits(float* out, int64_t n) {
  check_batch(n);
  copy_between(out, -1, output(graph().layers().size() - 1, 0), parts_.back()->memory,
               n * graph().num_classes(), nullptr);
}

StepStats PlacedTower::evaluate(const float* images, const int32_t* labels, int64_t n) {
  return run(images, labels, n, 0.0f, false);
}

}  // namespace towers
