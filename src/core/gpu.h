// gpu.h — what host code may know about GPUs without CUDA headers: the GPUs found, and the
// execution context a layer's GPU path runs in. Works in every build; in a build without CUDA
// list_gpus() finds none and says why.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/cudnn_rules.h"
#include "kernels/hd.h"  // CUstream_st, cublasContext

namespace towers {

struct GpuInfo {
  int ordinal = 0;
  std::string name;
  int64_t total_bytes = 0, free_bytes = 0;
  int cc_major = 0, cc_minor = 0;
  int multiprocessors = 0;
};

struct GpuList {
  std::vector<GpuInfo> gpus;
  std::string why_none;  // set when gpus is empty: built without CUDA, no driver, no device
  int driver_version = 0, runtime_version = 0;  // CUDA's encoding: 13000 = 13.0
  int cudnn_version = 0;  // of the libcudnn loaded, cuDNN's encoding: 91900 = 9.19.0
};
// with_free_memory also reads each GPU's free memory, which creates a CUDA context on every
// GPU (hundreds of MiB each, for the life of the process): for `towers devices` only.
GpuList list_gpus(bool with_free_memory = false);

// Pins existing host memory for every GPU (cudaHostRegister) until the handle is released.
// Pinning only makes copies faster: when it is not possible (a build without CUDA, memory
// already pinned by the caller, a locked-memory limit) the handle is null and *why (if given)
// says why; copies from the memory remain correct.
std::shared_ptr<void> pin_host_memory(void* p, size_t bytes, std::string* why = nullptr);

// What a layer plans once per batch size on one tower's GPU (the cuDNN descriptors and
// algorithms of a convolution, core/cudnn_conv.h), kept by the tower for its life. A plan is
// made by the first call that needs it; a tower's first step of a batch size runs eagerly,
// before any CUDA graph capture, so making a plan never happens inside a capture. One tower's
// calls come from one thread at a time, so there is no lock.
class GpuPlans {
 public:
  // The plan owner made for calls on n examples; make() (returning std::unique_ptr<T>) makes it
  // on first use.
  template <class T, class Make>
  T& get(const void* owner, int64_t n, Make make) {
    const std::pair<const void*, int64_t> key{owner, n};
    auto it = plans_.find(key);
    // Made before it is stored: a make() that throws leaves no entry.
    if (it == plans_.end()) it = plans_.emplace(key, std::shared_ptr<T>(make())).first;
    return *static_cast<T*>(it->second.get());
  }
  size_t size() const { return plans_.size(); }
  // What each plan chose, in the order they were made ("conv1, batch 128: forward ..."), for
  // gpu_bench's log and the tests.
  void note(std::string what) { notes_.push_back(std::move(what)); }
  const std::vector<std::string>& notes() const { return notes_; }

 private:
  std::map<std::pair<const void*, int64_t>, std::shared_ptr<void>> plans_;
  std::vector<std::string> notes_;
};

// Everything a layer's GPU path needs: the tower's compute stream and cuBLAS handle (bound to
// that stream), device scratch of scratch_size floats that the call may overwrite, and, on a
// tower, its cuDNN handle (bound to the same stream), its plans and its precision. Without a
// cuDNN handle (a bare exec in a test) convolutions run as im2col + cuBLAS. With a lane, a
// layer's backward may branch onto it (fork_lane, join_lane).
struct GpuLane;
struct GpuExec {
  CUstream_st* stream = nullptr;
  cublasContext* blas = nullptr;
  float* scratch = nullptr;
  int64_t scratch_size = 0;
  cudnnContext* dnn = nullptr;
  GpuPlans* plans = nullptr;
  bool tf32 = false;
  const GpuLane* lane = nullptr;
  CudnnRules cudnn;  // TowerPlacement::cudnn
};

// A tower's second lane on its GPU (--backward-branches): an exec of its own (a stream with
// cuBLAS and cuDNN handles bound to it, device scratch of its own, the tower's plans and
// precision) and the two events of a fork and a join. A layer's backward forks the lane after
// the work both branches read (the error, masked by the ReLU), computes its weight and bias
// gradients there while the input gradient runs on the main stream, and joins the lane before
// it returns: in a CUDA graph, two parallel branches. Nothing outside the layer sees the
// branch, so the lane's scratch is the layer's alone between its fork and its join
// (Layer::gpu_lane_scratch).
struct GpuLane {
  GpuExec exec;  // its own lane: none
  CUevent_st* fork = nullptr;
  CUevent_st* join = nullptr;
  // Tests only: a spin kernel of this many ns at the start of each branch, so that work which
  // does not wait for the branch's end reads unfinished gradients.
  int64_t test_delay_ns = 0;
  // Branches forked (queued, not replayed: a captured step counts once), for tests.
  mutable int64_t forks = 0;
};

// CUDA builds (core/cuda_device_cuda.cpp). fork_lane: an exec on e's lane (its stream, handles
// and scratch), whose work follows everything queued on e.stream so far; e itself when e has
// no lane, so a layer's code is the same either way (one stream then runs both branches in
// turn). join_lane: e.stream waits for everything queued on e's lane (nothing without a lane).
GpuExec fork_lane(const GpuExec& e);
void join_lane(const GpuExec& e);

// floats [offset, offset + count) of e's scratch; an internal error naming `who` if the
// scratch is short (a layer's gpu_scratch() under-counted).
float* gpu_scratch_at(const GpuExec& e, int64_t offset, int64_t count, const std::string& who);

}  // namespace towers
