// device.h — where a tower computes. The CPU device is first-class (DESIGN.md, decision 4):
// its memory is aligned host memory and its threads are a oneTBB task arena of its own, so
// towers on one machine never oversubscribe the cores they were given. The CUDA device
// implements the same interface in the GPU issue.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <oneapi/tbb/task_arena.h>

namespace towers {

enum class DeviceKind { Cpu, Cuda };

class Device {
 public:
  virtual ~Device() = default;
  virtual DeviceKind kind() const = 0;
  virtual std::string name() const = 0;
  virtual float* allocate(int64_t count) = 0;  // zeroed
  virtual void deallocate(float* p) = 0;
  virtual void copy_in(float* dst, const float* host_src, int64_t count) = 0;
  virtual void copy_out(float* host_dst, const float* src, int64_t count) = 0;
  virtual void synchronize() = 0;
};

class CpuDevice final : public Device {
 public:
  explicit CpuDevice(int threads);
  DeviceKind kind() const override { return DeviceKind::Cpu; }
  std::string name() const override;
  float* allocate(int64_t count) override;
  void deallocate(float* p) override;
  void copy_in(float* dst, const float* host_src, int64_t count) override;
  void copy_out(float* host_dst, const float* src, int64_t count) override;
  void synchronize() override {}

  int threads() const { return threads_; }
  // Runs fn on this device's threads; every parallel_for inside uses only them.
  template <class F>
  auto execute(F&& fn) {
    return arena_.execute(std::forward<F>(fn));
  }

 private:
  int threads_;
  oneapi::tbb::task_arena arena_;
};

// Memory owned on a device, released on destruction.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(Device& d, int64_t count) : dev_(&d), data_(d.allocate(count)), size_(count) {}
  DeviceBuffer(DeviceBuffer&& o) noexcept { *this = std::move(o); }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(dev_, o.dev_), std::swap(data_, o.data_), std::swap(size_, o.size_);
    return *this;
  }
  ~DeviceBuffer() {
    if (data_ != nullptr) dev_->deallocate(data_);
  }
  float* data() const { return data_; }
  int64_t size() const { return size_; }

 private:
  Device* dev_ = nullptr;
  float* data_ = nullptr;
  int64_t size_ = 0;
};

int hardware_threads();  // cores available to this process

}  // namespace towers
