// tensor.h — shapes, non-owning float views, and an owning aligned host buffer.
// towers is float32 NCHW throughout. A Shape is per-example unless it says otherwise.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace towers {

using Shape = std::vector<int64_t>;

inline int64_t numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}
std::string to_string(const Shape& s);  // "[64, 3, 5, 5]"

// 64-byte aligned host floats, zero-initialised. Movable, not copyable.
class HostBuffer {
 public:
  HostBuffer() = default;
  explicit HostBuffer(int64_t count);
  HostBuffer(HostBuffer&&) noexcept = default;
  HostBuffer& operator=(HostBuffer&&) noexcept = default;

  float* data() { return data_.get(); }
  const float* data() const { return data_.get(); }
  int64_t size() const { return size_; }
  float& operator[](int64_t i) { return data_.get()[i]; }
  const float& operator[](int64_t i) const { return data_.get()[i]; }
  void resize(int64_t count);  // contents are zeroed
  void zero();

 private:
  struct Free {
    void operator()(float* p) const;
  };
  std::unique_ptr<float, Free> data_;
  int64_t size_ = 0;
};

}  // namespace towers
