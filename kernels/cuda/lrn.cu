// lrn.cu — local response normalisation on the GPU. For radii up to kLrnMaxRadius (the CIFAR-10
// net's 4), one thread per (image, chunk of kLrnChunk channels, pixel) reads its channels and
// their window margins once into registers; otherwise one thread per element sums its own
// channel window. Both compute the same floats; 32-bit indices where they fit, divided by
// multiply and shift (kernels/divisor.h). Rules in kernels/cuda/lrn_rules.h.
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/lrn_rules.h"
#include "kernels/lrn.h"

namespace towers::kernels::cuda {

namespace {

// kChunked: thread i is a chunk of channels of one pixel (lrn_forward_chunk), else element i.
template <class I, bool kChunked>
struct LrnForward {
  LrnParams p;
  LrnShape<I> s;
  const float* x;
  float *y, *scale;
  TOWERS_HD void operator()(I i) const { body(p, s, x, y, scale, i); }
  static TOWERS_HD void body(const LrnParams& p, const LrnShape<I>& s, const float* __restrict__ x,
                             float* __restrict__ y, float* __restrict__ scale, I i) {
    if constexpr (kChunked) {
      lrn_forward_chunk<I>(p, s, x, y, scale, i);
    } else {
      float yv, sv;
      lrn_forward_at<I>(p, s, x, i, yv, sv);
      y[i] = yv;
      scale[i] = sv;
    }
  }
};

template <class I, bool kChunked>
struct LrnBackward {
  LrnParams p;
  LrnShape<I> s;
  const float *x, *y, *scale, *dy;
  float* dx;
  TOWERS_HD void operator()(I i) const { body(p, s, x, y, scale, dy, dx, i); }
  static TOWERS_HD void body(const LrnParams& p, const LrnShape<I>& s, const float* __restrict__ x,
                             const float* __restrict__ y, const float* __restrict__ scale,
                             const float* __restrict__ dy, float* __restrict__ dx, I i) {
    if constexpr (kChunked)
      lrn_backward_chunk<I>(p, s, x, y, scale, dy, dx, i);
    else
      dx[i] = lrn_backward_at<I>(p, s, x, y, scale, dy, i);
  }
};

}  // namespace

// The chunked kernels when they take the radius, else the per-element ones; both index in 32
// bits when every element's index fits.
template <template <class, bool> class Kernel, class... Args>
void launch_lrn(CUstream_st* s, const LrnParams& p, int64_t n, int64_t c, int64_t hw,
                Args... args) {
  const int64_t count = n * c * hw;
  const bool narrow = fits_int32_indices(count);
  if (lrn_chunked(p)) {
    launch_narrow_or_wide(s, LrnShape<int64_t>::chunk_threads(n, c, hw), narrow, [&](auto i) {
      using I = decltype(i);
      return Kernel<I, true>{p, LrnShape<I>(p, c, hw), args...};
    });
  } else {
    launch_narrow_or_wide(s, count, narrow, [&](auto i) {
      using I = decltype(i);
      return Kernel<I, false>{p, LrnShape<I>(p, c, hw), args...};
    });
  }
}

void lrn_forward(CUstream_st* s, const LrnParams& p, int64_t n, int64_t c, int64_t hw,
                 const float* x, float* y, float* scale) {
  launch_lrn<LrnForward>(s, p, n, c, hw, x, y, scale);
}

void lrn_backward(CUstream_st* s, const LrnParams& p, int64_t n, int64_t c, int64_t hw,
                  const float* x, const float* y, const float* scale, const float* dy, float* dx) {
  launch_lrn<LrnBackward>(s, p, n, c, hw, x, y, scale, dy, dx);
}

}  // namespace towers::kernels::cuda
