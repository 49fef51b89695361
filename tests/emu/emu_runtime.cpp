// emu_runtime.cpp — the CUDA runtime, cuBLAS handle and NCCL calls towers makes, on the host.
// See emu_runtime.h for what the emulator is and is not. Beyond executing, it checks the
// rules a real GPU enforces and towers must respect: copies stay inside live allocations,
// nothing synchronises or allocates while a stream is being captured, captured copies touch
// only page-locked host memory, and a capture ends on the stream that began it.
//
// Streams run late and out of order: an operation is queued on its stream and runs only when
// something needs it done (a synchronisation of its stream or of the device, a copy to pageable
// memory, a free), in its stream's order and after the operations of other streams its stream
// waits for (cudaStreamWaitEvent); among the operations that may run, the one issued last runs
// first (run_until). Every such order is one a GPU may take, and this one breaks the work that
// lacks a wait: a consumer runs before the producer it did not wait for, a writer overwrites
// a buffer before the reader it did not wait for, the host's next writes to a buffer land
// before a queued copy of it. TOWERS_EMU_STREAMS=issue runs every operation when it is issued
// instead (the order of issue, a valid order that hides missing waits).
#include "tests/emu/emu_runtime.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include <nccl.h>

namespace {
// One stream's queue. An operation is work, or a wait for another queue to have run its first
// `seq` operations (cudaStreamWaitEvent, recorded when it was issued).
struct Queue;
struct Op {
  std::function<void()> work;
  std::shared_ptr<Queue> after;
  int64_t after_seq = 0;
  int64_t id = 0;  // the order of issue over every stream
};
struct Queue {
  std::deque<Op> ops;
  int64_t issued = 0, done = 0;
  bool busy = false;      // a thread is running its front operation
  bool blocking = false;  // a blocking stream's: the legacy default stream waits for it
};
// A captured operation: work queued on a stream of the capture, or an event recorded or waited
// on one. Streams and events are kept as names only: a replay maps each captured stream to a
// queue of its own.
struct Node {
  enum Kind { Work, Record, Wait } kind = Work;
  const void* stream = nullptr;
  std::function<void()> work;
  const void* event = nullptr;
};
}  // namespace

struct CUstream_st {
  int device = 0;
  std::shared_ptr<Queue> q = std::make_shared<Queue>();
};
struct CUevent_st {
  std::shared_ptr<Queue> q;  // recorded on (null: never recorded)
  int64_t seq = 0;           // complete once q has run this many operations
  bool timing = true;        // not cudaEventDisableTiming
  // A timed event's last record: the host's steady clock (ns) when its stream reached it, -1
  // until then (each record gets a stamp of its own).
  std::shared_ptr<std::atomic<int64_t>> stamp;
};
struct CUgraph_st {
  std::vector<Node> nodes;
};
struct CUgraphExec_st {
  std::shared_ptr<const std::vector<Node>> nodes;
};
struct cublasContext {
  cudaStream_t stream = nullptr;
  bool tf32 = false;
};
struct ncclComm {
  int rank = 0, size = 1;
};

namespace {

std::mutex mu;                          // guards the tables below
std::map<const char*, size_t> device_;  // device allocation -> bytes
std::map<const char*, size_t> pinned_;  // page-locked host range -> bytes
thread_local int current_device = 0;
thread_local cudaError_t last_error = cudaSuccess;
thread_local CUgraph_st* capture = nullptr;  // the graph this thread is recording
thread_local cudaStream_t capture_origin = nullptr;

// The lazy streams (see the top): every live queue, and the lock and signal of their state.
std::mutex run_mu;
std::condition_variable run_cv;
std::vector<std::weak_ptr<Queue>> queues;
int64_t issued_ops = 0;

bool issue_order() {
  static const bool on = [] {
    const char* env = std::getenv("TOWERS_EMU_STREAMS");
    return env != nullptr && std::string(env) == "issue";
  }();
  return on;
}

// Runs operations until q has run `seq` of them. Each step runs one operation that may run now
// (the front of a queue that no thread is running, whose wait, if it is one, is met), and of
// those the one issued last, whatever its stream: so a stream runs ahead of the work its
// missing wait would have waited for, and a write that lacks a wait on an earlier reader runs
// before that reader. Operations run outside the lock, one at a time per queue, on whichever
// thread needs them.
// Under run_mu: the queues still alive (of blocking streams only, if asked).
std::vector<std::shared_ptr<Queue>> live_queues_locked(bool blocking_only = false) {
  std::erase_if(queues, [](const std::weak_ptr<Queue>& w) { return w.expired(); });
  std::vector<std::shared_ptr<Queue>> live;
  for (const auto& w : queues)
    if (auto q = w.lock(); q && (q->blocking || !blocking_only)) live.push_back(q);
  return live;
}

void run_until(const std::shared_ptr<Queue>& q, int64_t seq) {
  std::unique_lock<std::mutex> l(run_mu);
  while (q->done < seq) {
    const std::vector<std::shared_ptr<Queue>> live = live_queues_locked();
    Queue* best = nullptr;
    for (const auto& r : live) {
      if (r->busy || r->ops.empty()) continue;
      const Op& f = r->ops.front();
      if (f.after && f.after->done < f.after_seq) continue;
      if (best == nullptr || f.id > best->ops.front().id) best = r.get();
    }
    if (best == nullptr) {  // what is left waits for operations other threads are running
      run_cv.wait(l);
      continue;
    }
    Op op = std::move(best->ops.front());
    best->ops.pop_front();
    best->busy = true;
    l.unlock();
    std::exception_ptr failed;
    try {
      if (op.work) op.work();
    } catch (...) {
      failed = std::current_exception();
    }
    l.lock();
    best->busy = false;
    ++best->done;
    run_cv.notify_all();
    if (failed) std::rethrow_exception(failed);
  }
}

// Under run_mu: op at the end of q.
void push_locked(Queue& q, Op op) {
  op.id = ++issued_ops;
  q.ops.push_back(std::move(op));
  ++q.issued;
}

void run_all_of(const std::shared_ptr<Queue>& q) {
  int64_t issued;
  {
    std::lock_guard<std::mutex> l(run_mu);
    issued = q->issued;
  }
  run_until(q, issued);
}

// Everything issued on every stream (cudaDeviceSynchronize, and what implies it), or on the
// blocking ones (what the legacy default stream waits for: its own work, synchronous copies).
void run_everything(bool blocking_only = false) {
  std::vector<std::shared_ptr<Queue>> live;
  {
    std::lock_guard<std::mutex> l(run_mu);
    live = live_queues_locked(blocking_only);
  }
  for (const auto& q : live) run_all_of(q);
}
void run_blocking() { run_everything(true); }

void enqueue(cudaStream_t s, Op op) {
  {
    std::lock_guard<std::mutex> l(run_mu);
    push_locked(*s->q, std::move(op));
  }
  if (issue_order()) run_all_of(s->q);
}

int device_count() {
  const char* env = std::getenv("TOWERS_EMU_GPUS");
  const int n = env ? std::atoi(env) : 1;
  return std::clamp(n, 0, 16);
}

cudaError_t fail(cudaError_t e) {
  last_error = e;
  return e;
}

// [p, p + bytes) inside one table entry?
bool inside(const std::map<const char*, size_t>& table, const void* p, size_t bytes) {
  const char* c = static_cast<const char*>(p);
  auto it = table.upper_bound(c);
  if (it == table.begin()) return false;
  --it;
  return c >= it->first && c + bytes <= it->first + it->second;
}

bool overlaps(const std::map<const char*, size_t>& table, const void* p, size_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (const auto& [q, n] : table)
    if (c < q + n && q < c + bytes) return true;
  return false;
}

// The checks of one copy: device sides inside a live allocation; while capturing, host sides
// page-locked (a graph cannot hold a copy to or from pageable memory).
cudaError_t check_copy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  std::lock_guard<std::mutex> l(mu);
  const bool dst_dev = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
  const bool src_dev = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
  if (kind == cudaMemcpyDefault || kind == cudaMemcpyHostToHost) return cudaSuccess;
  if (dst_dev && !inside(device_, dst, bytes)) return cudaErrorInvalidValue;
  if (src_dev && !inside(device_, src, bytes)) return cudaErrorInvalidValue;
  if (capture != nullptr) {
    if (!dst_dev && !inside(pinned_, dst, bytes)) return cudaErrorStreamCaptureUnsupported;
    if (!src_dev && !inside(pinned_, src, bytes)) return cudaErrorStreamCaptureUnsupported;
  }
  return cudaSuccess;
}

}  // namespace

namespace towers::emu {

void submit(cudaStream_t s, std::function<void()> work) {
  if (capture != nullptr) {
    capture->nodes.push_back({Node::Work, s, std::move(work), nullptr});
  } else if (s == nullptr) {
    // The legacy default stream: after the work of the blocking streams (towers never issues
    // here; its streams are non-blocking).
    run_blocking();
    work();
  } else {
    enqueue(s, Op{std::move(work), nullptr, 0});
  }
}

cudaStream_t stream_of(cublasHandle_t h) { return h->stream; }
bool tf32(cublasHandle_t h) { return h->tf32; }
bool capturing() { return capture != nullptr; }
bool on_device(const void* p, size_t bytes) {
  std::lock_guard<std::mutex> l(mu);
  return inside(device_, p, bytes);
}

}  // namespace towers::emu

// ---- devices ---------------------------------------------------------------------------------
cudaError_t cudaGetDeviceCount(int* count) {
  *count = device_count();
  return *count > 0 ? cudaSuccess : fail(cudaErrorNoDevice);
}
cudaError_t cudaGetDevice(int* device) {
  *device = current_device;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= device_count()) return fail(cudaErrorInvalidDevice);
  current_device = device;
  return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (device < 0 || device >= device_count()) return fail(cudaErrorInvalidDevice);
  *prop = cudaDeviceProp{};
  std::snprintf(prop->name, sizeof(prop->name), "towers CUDA emulator (host)");
  prop->totalGlobalMem = size_t{8} << 30;
  prop->major = 9;
  prop->minor = 0;
  prop->multiProcessorCount = 1;
  return cudaSuccess;
}
cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total) {
  *total = size_t{8} << 30;
  *free_bytes = *total;
  return cudaSuccess;
}
cudaError_t cudaDriverGetVersion(int* v) {
  *v = CUDART_VERSION;
  return cudaSuccess;
}
cudaError_t cudaRuntimeGetVersion(int* v) {
  *v = CUDART_VERSION;
  return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize() {
  if (capture) return fail(cudaErrorStreamCaptureUnsupported);
  run_everything();
  return cudaSuccess;
}
cudaError_t cudaGetLastError() {
  cudaError_t e = last_error;
  last_error = cudaSuccess;
  return e;
}
const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorStreamCaptureUnsupported: return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureUnmatched: return "capture was not initiated in this stream";
    case cudaErrorStreamCaptureUnjoined: return "capturing stream has unjoined work";
    case cudaErrorHostMemoryAlreadyRegistered: return "part or all of the requested memory range is already mapped";
    default: return "emulated CUDA error";
  }
}
const char* cudaGetErrorName(cudaError_t e) {
  return e == cudaSuccess ? "cudaSuccess" : "cudaErrorEmulated";
}

// ---- memory ----------------------------------------------------------------------------------
cudaError_t cudaMalloc(void** p, size_t bytes) {
  if (capture) return fail(cudaErrorStreamCaptureUnsupported);
  void* q = std::aligned_alloc(256, (std::max<size_t>(bytes, 1) + 255) / 256 * 256);
  if (q == nullptr) return fail(cudaErrorMemoryAllocation);
  std::memset(q, 0xA5, bytes);  // never zero by accident: towers must clear what it reads
  std::lock_guard<std::mutex> l(mu);
  device_[static_cast<const char*>(q)] = bytes;
  *p = q;
  return cudaSuccess;
}
cudaError_t cudaFree(void* p) {
  if (capture) return fail(cudaErrorStreamCaptureUnsupported);
  if (p == nullptr) return cudaSuccess;
  run_everything();  // cudaFree synchronises the device
  std::lock_guard<std::mutex> l(mu);
  auto it = device_.find(static_cast<const char*>(p));
  if (it == device_.end()) return fail(cudaErrorInvalidValue);
  device_.erase(it);
  std::free(p);
  return cudaSuccess;
}
cudaError_t cudaMallocHost(void** p, size_t bytes) {
  void* q = std::aligned_alloc(4096, (std::max<size_t>(bytes, 1) + 4095) / 4096 * 4096);
  if (q == nullptr) return fail(cudaErrorMemoryAllocation);
  std::lock_guard<std::mutex> l(mu);
  pinned_[static_cast<const char*>(q)] = bytes;
  *p = q;
  return cudaSuccess;
}
cudaError_t cudaFreeHost(void* p) {
  run_everything();  // as cudaFree
  std::lock_guard<std::mutex> l(mu);
  pinned_.erase(static_cast<const char*>(p));
  std::free(p);
  return cudaSuccess;
}
cudaError_t cudaHostRegister(void* p, size_t bytes, unsigned int) {
  std::lock_guard<std::mutex> l(mu);
  if (overlaps(pinned_, p, bytes)) return fail(cudaErrorHostMemoryAlreadyRegistered);
  pinned_[static_cast<const char*>(p)] = bytes;
  return cudaSuccess;
}
cudaError_t cudaHostUnregister(void* p) {
  run_everything();  // queued copies may still name the range
  std::lock_guard<std::mutex> l(mu);
  return pinned_.erase(static_cast<const char*>(p)) ? cudaSuccess : fail(cudaErrorInvalidValue);
}
// What memory a pointer is in: a device allocation (on the current device: the emulated
// devices share one table), a page-locked host range, or ordinary host memory.
cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* attr, const void* p) {
  std::lock_guard<std::mutex> l(mu);
  *attr = cudaPointerAttributes{};
  attr->device = current_device;
  if (inside(device_, p, 1)) {
    attr->type = cudaMemoryTypeDevice;
    attr->devicePointer = const_cast<void*>(p);
  } else if (inside(pinned_, p, 1)) {
    attr->type = cudaMemoryTypeHost;
    attr->hostPointer = const_cast<void*>(p);
    attr->devicePointer = const_cast<void*>(p);
  } else {
    attr->type = cudaMemoryTypeUnregistered;
    attr->device = -2;
  }
  return cudaSuccess;
}
cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  if (capture) return fail(cudaErrorStreamCaptureUnsupported);
  if (cudaError_t e = check_copy(dst, src, bytes, kind)) return fail(e);
  run_blocking();  // on the legacy default stream
  if (bytes > 0) std::memcpy(dst, src, bytes);  // a 0-byte copy may name null pointers
  return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t s) {
  if (cudaError_t e = check_copy(dst, src, bytes, kind)) return fail(e);
  if (bytes == 0) return cudaSuccess;
  const bool host_src = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyHostToHost;
  const bool host_dst = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyHostToHost;
  bool pageable_src, pageable_dst;
  {
    std::lock_guard<std::mutex> l(mu);
    pageable_src = host_src && !inside(pinned_, src, bytes);
    pageable_dst = host_dst && !inside(pinned_, dst, bytes);
  }
  if (capture == nullptr && s != nullptr && pageable_dst) {
    // CUDA: a copy to pageable memory returns once it is done, after the stream's earlier work.
    run_all_of(s->q);
    std::memcpy(dst, src, bytes);
  } else if (capture == nullptr && pageable_src) {
    // CUDA stages pageable source memory before the call returns: the caller may reuse it.
    auto staged = std::make_shared<std::vector<char>>(static_cast<const char*>(src),
                                                      static_cast<const char*>(src) + bytes);
    towers::emu::submit(s, [=] { std::memcpy(dst, staged->data(), bytes); });
  } else {
    towers::emu::submit(s, [=] { std::memcpy(dst, src, bytes); });
  }
  return cudaSuccess;
}
cudaError_t cudaMemset(void* p, int value, size_t bytes) {
  if (capture) return fail(cudaErrorStreamCaptureUnsupported);
  {
    std::lock_guard<std::mutex> l(mu);
    if (!inside(device_, p, bytes)) return fail(cudaErrorInvalidValue);
  }
  run_blocking();  // on the legacy default stream
  std::memset(p, value, bytes);
  return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t s) {
  {
    std::lock_guard<std::mutex> l(mu);
    if (!inside(device_, p, bytes)) return fail(cudaErrorInvalidValue);
  }
  towers::emu::submit(s, [=] { std::memset(p, value, bytes); });
  return cudaSuccess;
}

// ---- streams, events, graphs -----------------------------------------------------------------
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned int flags) {
  *s = new CUstream_st{current_device};
  (*s)->q->blocking = (flags & cudaStreamNonBlocking) == 0;
  std::lock_guard<std::mutex> l(run_mu);
  queues.push_back((*s)->q);
  return cudaSuccess;
}
cudaError_t cudaStreamCreate(cudaStream_t* s) {
  return cudaStreamCreateWithFlags(s, cudaStreamDefault);
}
cudaError_t cudaStreamDestroy(cudaStream_t s) {
  run_all_of(s->q);  // CUDA finishes a destroyed stream's work
  delete s;
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  // A synchronisation inside a capture is an error on a GPU.
  if (capture) return fail(cudaErrorStreamCaptureUnsupported);
  if (s == nullptr) run_blocking();
  else run_all_of(s->q);
  return cudaSuccess;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned int flags) {
  *e = new CUevent_st{};
  (*e)->timing = (flags & cudaEventDisableTiming) == 0;
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t e) {
  delete e;
  return cudaSuccess;
}
// Inside a capture, records and waits become nodes of the graph (its dependencies at replay).
// On the legacy default stream (0), a record is complete once the blocking streams have run,
// and a wait is the host's.
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  if (e == nullptr) return fail(cudaErrorInvalidValue);
  if (capture) {
    capture->nodes.push_back({Node::Record, s, nullptr, e});
    return cudaSuccess;
  }
  if (s == nullptr) run_blocking();
  std::shared_ptr<std::atomic<int64_t>> stamp;
  if (e->timing) {
    // The time the stream reaches the record: an operation of the stream that stamps it.
    stamp = std::make_shared<std::atomic<int64_t>>(-1);
    auto now = [stamp] {
      stamp->store(std::chrono::duration_cast<std::chrono::nanoseconds>(
                       std::chrono::steady_clock::now().time_since_epoch())
                       .count());
    };
    if (s == nullptr) now();
    else towers::emu::submit(s, now);
  }
  std::lock_guard<std::mutex> l(run_mu);
  e->q = s == nullptr ? nullptr : s->q;
  e->seq = s == nullptr ? 0 : s->q->issued;
  e->stamp = std::move(stamp);
  return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  if (e == nullptr) return fail(cudaErrorInvalidValue);
  if (capture) return fail(cudaErrorStreamCaptureUnsupported);
  std::shared_ptr<Queue> after;
  int64_t seq;
  {
    std::lock_guard<std::mutex> l(run_mu);
    after = e->q;
    seq = e->seq;
  }
  if (after != nullptr) run_until(after, seq);
  return cudaSuccess;
}
// Milliseconds between two completed records of timed events (the host's clock when each
// stream reached them); cudaErrorNotReady while either is pending, as on a GPU.
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  if (ms == nullptr || start == nullptr || end == nullptr) return fail(cudaErrorInvalidValue);
  std::shared_ptr<std::atomic<int64_t>> a, b;
  {
    std::lock_guard<std::mutex> l(run_mu);
    a = start->stamp;
    b = end->stamp;
  }
  if (!start->timing || !end->timing || a == nullptr || b == nullptr)
    return fail(cudaErrorInvalidResourceHandle);
  if (a->load() < 0 || b->load() < 0) return fail(cudaErrorNotReady);
  *ms = static_cast<float>(static_cast<double>(b->load() - a->load()) / 1e6);
  return cudaSuccess;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned int) {
  if (e == nullptr) return fail(cudaErrorInvalidValue);
  if (capture) {
    capture->nodes.push_back({Node::Wait, s, nullptr, e});
    return cudaSuccess;
  }
  std::shared_ptr<Queue> after;
  int64_t seq;
  {
    std::lock_guard<std::mutex> l(run_mu);
    after = e->q;
    seq = e->seq;
  }
  if (after == nullptr) return cudaSuccess;  // never recorded, or complete: nothing to wait for
  if (s == nullptr) run_until(after, seq);
  else if (after != s->q) enqueue(s, Op{nullptr, after, seq});
  return cudaSuccess;
}
cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode) {
  if (capture) return fail(cudaErrorStreamCaptureUnsupported);
  capture = new CUgraph_st{};
  capture_origin = s;
  return cudaSuccess;
}
namespace {
// Whether every stream with work in the capture is joined back into its origin: its last node
// is a record of an event that the origin, or a stream joined itself, waits for later (CUDA
// refuses to end a capture otherwise, with cudaErrorStreamCaptureUnjoined).
bool all_joined(const std::vector<Node>& nodes, const void* origin) {
  std::map<const void*, size_t> last;  // each stream's last node
  for (size_t i = 0; i < nodes.size(); ++i) last[nodes[i].stream] = i;
  std::set<const void*> joined{origin};
  auto joins = [&](size_t i) {  // node i, a record, is waited for by a joined stream
    for (size_t j = i + 1; j < nodes.size(); ++j) {
      if (nodes[j].event != nodes[i].event) continue;
      if (nodes[j].kind == Node::Record) return false;  // recorded again: later waits see that
      if (nodes[j].kind == Node::Wait && joined.count(nodes[j].stream) > 0) return true;
    }
    return false;
  };
  for (bool changed = true; changed;) {
    changed = false;
    for (const auto& [stream, at] : last) {
      if (joined.count(stream) > 0) continue;
      // Its records after which it has no work or wait of its own.
      for (size_t i = at + 1; i-- > 0;) {
        if (nodes[i].stream != stream) continue;
        if (nodes[i].kind != Node::Record) break;
        if (joins(i)) {
          joined.insert(stream);
          changed = true;
          break;
        }
      }
    }
  }
  for (const auto& [stream, at] : last)
    if (joined.count(stream) == 0) return false;
  return true;
}
}  // namespace

cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t* g) {
  if (!capture || s != capture_origin) return fail(cudaErrorStreamCaptureUnmatched);
  const bool joined = all_joined(capture->nodes, capture_origin);
  *g = joined ? capture : nullptr;
  if (!joined) delete capture;
  capture = nullptr;
  capture_origin = nullptr;
  return joined ? cudaSuccess : fail(cudaErrorStreamCaptureUnjoined);
}
cudaError_t cudaStreamIsCapturing(cudaStream_t s, cudaStreamCaptureStatus* status) {
  bool in = capture != nullptr && s == capture_origin;
  if (capture != nullptr)
    for (const Node& n : capture->nodes) in = in || n.stream == s;
  *status = in ? cudaStreamCaptureStatusActive : cudaStreamCaptureStatusNone;
  return cudaSuccess;
}
cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t g, unsigned long long) {
  if (g == nullptr) return fail(cudaErrorInvalidValue);
  *exec = new CUgraphExec_st{std::make_shared<const std::vector<Node>>(g->nodes)};
  return cudaSuccess;
}
cudaError_t cudaGraphDestroy(cudaGraph_t g) {
  delete g;
  return cudaSuccess;
}
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t e) {
  delete e;
  return cudaSuccess;
}
cudaError_t cudaGraphLaunch(cudaGraphExec_t e, cudaStream_t s) {
  if (e == nullptr) return fail(cudaErrorInvalidValue);
  if (capture) return fail(cudaErrorStreamCaptureUnsupported);  // towers never nests graphs
  // Each captured stream replays on a queue of its own, which starts after s's work so far;
  // the captured records and waits are the dependencies between them, and s goes on once
  // every queue of the graph has run: the graph's nodes run in any order its edges allow.
  std::shared_ptr<Queue> sq = s->q;
  {
    std::lock_guard<std::mutex> l(run_mu);
    const int64_t start = sq->issued;
    std::map<const void*, std::shared_ptr<Queue>> lanes;
    std::map<const void*, std::pair<std::shared_ptr<Queue>, int64_t>> recorded;
    auto lane = [&](const void* stream) -> Queue& {
      std::shared_ptr<Queue>& q = lanes[stream];
      if (!q) {
        q = std::make_shared<Queue>();
        queues.push_back(q);
        push_locked(*q, Op{nullptr, sq, start});
      }
      return *q;
    };
    for (const Node& n : *e->nodes) {
      Queue& q = lane(n.stream);
      if (n.kind == Node::Work) {
        push_locked(q, Op{n.work, nullptr, 0});
      } else if (n.kind == Node::Record) {
        recorded[n.event] = {lanes[n.stream], q.issued};
      } else if (auto it = recorded.find(n.event); it != recorded.end() && it->second.first.get() != &q) {
        push_locked(q, Op{nullptr, it->second.first, it->second.second});
      }
    }
    for (const auto& [stream, q] : lanes) push_locked(*sq, Op{nullptr, q, q->issued});
  }
  if (issue_order()) run_all_of(sq);
  return cudaSuccess;
}

// ---- cuBLAS handles (the GEMM itself is in emu_kernels.cpp) ----------------------------------
cublasStatus_t cublasCreate_v2(cublasHandle_t* h) {
  *h = new cublasContext{};
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasDestroy_v2(cublasHandle_t h) {
  delete h;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetStream_v2(cublasHandle_t h, cudaStream_t s) {
  h->stream = s;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetWorkspace_v2(cublasHandle_t, void* p, size_t bytes) {
  std::lock_guard<std::mutex> l(mu);
  return inside(device_, p, bytes) ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_INVALID_VALUE;
}
cublasStatus_t cublasSetMathMode(cublasHandle_t h, cublasMath_t mode) {
  h->tf32 = mode == CUBLAS_TF32_TENSOR_OP_MATH;
  return CUBLAS_STATUS_SUCCESS;
}
const char* cublasGetStatusString(cublasStatus_t s) {
  return s == CUBLAS_STATUS_SUCCESS ? "CUBLAS_STATUS_SUCCESS" : "CUBLAS_STATUS_EMULATED_ERROR";
}

// ---- NCCL: a single-process all-reduce over the emulated devices -----------------------------
namespace {
struct PendingReduce {
  const float* send;
  float* recv;
  size_t count;
  int rank;
};
std::vector<PendingReduce> group;
int group_depth = 0;

void run_group() {
  // Ranks summed in rank order, the same sum written to every rank.
  std::sort(group.begin(), group.end(),
            [](const PendingReduce& a, const PendingReduce& b) { return a.rank < b.rank; });
  if (group.empty()) return;
  const size_t n = group[0].count;
  std::vector<float> sum(group[0].send, group[0].send + n);
  for (size_t r = 1; r < group.size(); ++r)
    for (size_t i = 0; i < n; ++i) sum[i] += group[r].send[i];
  for (const auto& p : group) std::memcpy(p.recv, sum.data(), n * sizeof(float));
  group.clear();
}
}  // namespace

ncclResult_t ncclCommInitAll(ncclComm_t* comms, int ndev, const int* devlist) {
  for (int i = 0; i < ndev; ++i) {
    for (int j = 0; j < i; ++j)
      if (devlist[i] == devlist[j]) return ncclInvalidUsage;  // as NCCL: one rank per GPU
    if (devlist[i] < 0 || devlist[i] >= device_count()) return ncclInvalidArgument;
    comms[i] = new ncclComm{i, ndev};
  }
  return ncclSuccess;
}
ncclResult_t ncclCommFinalize(ncclComm_t) { return ncclSuccess; }
ncclResult_t ncclCommDestroy(ncclComm_t c) {
  delete c;
  return ncclSuccess;
}
const char* ncclGetErrorString(ncclResult_t r) {
  return r == ncclSuccess ? "no error" : "emulated NCCL error";
}
ncclResult_t ncclGroupStart() {
  ++group_depth;
  return ncclSuccess;
}
ncclResult_t ncclGroupEnd() {
  if (--group_depth == 0) run_group();
  return ncclSuccess;
}
// The all-reduce runs once its group is complete, each rank after its stream's earlier work
// (run here): later work on the streams sees the sums.
ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count, ncclDataType_t type,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t s) {
  if (type != ncclFloat || op != ncclSum) return ncclInvalidArgument;
  if (s != nullptr && !capture) run_all_of(s->q);
  group.push_back({static_cast<const float*>(send), static_cast<float*>(recv), count, comm->rank});
  if (group_depth == 0) run_group();
  return ncclSuccess;
}
