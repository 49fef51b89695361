#include "core/tensor.h"

#include <cstdlib>
#include <cstring>
#include <new>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace towers {

std::string to_string(const Shape& s) { return fmt::format("[{}]", fmt::join(s, ", ")); }

void HostBuffer::Free::operator()(float* p) const { std::free(p); }

HostBuffer::HostBuffer(int64_t count) { resize(count); }

void HostBuffer::resize(int64_t count) {
  size_ = count;
  if (count == 0) {
    data_.reset();
    return;
  }
  size_t bytes = (static_cast<size_t>(count) * sizeof(float) + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, bytes);
  if (p == nullptr) throw std::bad_alloc();
  std::memset(p, 0, bytes);
  data_.reset(static_cast<float*>(p));
}

void HostBuffer::zero() {
  if (size_ > 0) std::memset(data_.get(), 0, static_cast<size_t>(size_) * sizeof(float));
}

}  // namespace towers
