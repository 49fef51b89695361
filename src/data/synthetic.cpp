#include "data/synthetic.h"

#include <algorithm>
#include <cmath>

#include "core/check.h"
#include "core/parallel.h"
#include "core/rng.h"

namespace towers::data {
namespace {

constexpr int64_t kGrid = 4;           // prototype detail: a (kGrid+1)^2 lattice per channel
constexpr double kNoiseStddev = 40.0;  // per pixel, on the 0..255 scale
constexpr double kSqrt3 = 1.7320508075688772;           // a sum of 4 U(0,1) has variance 1/3
constexpr uint64_t kPrototypeStream = 0x70726f746fULL;  // "proto"
constexpr uint64_t kTrainStream = 1, kTestStream = 2;

// A random lattice, bilinearly interpolated to height x width: low-frequency content.
std::vector<float> make_prototype(int64_t c, int64_t h, int64_t w, Rng& rng) {
  std::vector<float> out(static_cast<size_t>(c * h * w));
  std::vector<float> lattice((kGrid + 1) * (kGrid + 1));
  for (int64_t ch = 0; ch < c; ++ch) {
    for (float& v : lattice) v = rng.uniform(16.0f, 240.0f);
    for (int64_t y = 0; y < h; ++y) {
      const double gy = h > 1 ? static_cast<double>(y) * kGrid / (h - 1) : 0.0;
      const int64_t y0 = std::min<int64_t>(static_cast<int64_t>(gy), kGrid - 1);
      const double fy = gy - y0;
      for (int64_t x = 0; x < w; ++x) {
        const double gx = w > 1 ? static_cast<double>(x) * kGrid / (w - 1) : 0.0;
        const int64_t x0 = std::min<int64_t>(static_cast<int64_t>(gx), kGrid - 1);
        const double fx = gx - x0;
        auto at = [&](int64_t yy, int64_t xx) { return lattice[yy * (kGrid + 1) + xx]; };
        const double top = at(y0, x0) * (1 - fx) + at(y0, x0 + 1) * fx;
        const double bottom = at(y0 + 1, x0) * (1 - fx) + at(y0 + 1, x0 + 1) * fx;
        out[(ch * h + y) * w + x] = static_cast<float>(top * (1 - fy) + bottom * fy);
      }
    }
  }
  return out;
}

Dataset make_split(const std::vector<std::vector<float>>& prototypes, int64_t c, int64_t h,
                   int64_t w, int64_t n, uint64_t seed, uint64_t stream, const char* name) {
  Dataset d;
  d.name = name;
  d.channels = c;
  d.height = h;
  d.width = w;
  d.num_classes = static_cast<int>(prototypes.size());
  d.images.resize(static_cast<size_t>(n * c * h * w));
  d.labels.resize(static_cast<size_t>(n));
  const int64_t m = c * h * w;
  // Each example draws from its own Rng, so the chunking cannot change the bytes.
  for_chunks(n, 256, [&](int64_t, int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      Rng rng(seed, stream, static_cast<uint64_t>(i));
      const int label = static_cast<int>(rng.below(prototypes.size()));
      d.labels[i] = label;
      const float* proto = prototypes[label].data();
      uint8_t* img = d.images.data() + i * m;
      for (int64_t k = 0; k < m; ++k) {
        // Irwin-Hall: four 16-bit uniforms from one draw, near-Gaussian and ~10x cheaper
        // than Box-Muller, which matters at 150M pixels for a CIFAR-sized set.
        const uint64_t r = rng.next_u64();
        const double u4 = static_cast<double>((r & 0xffff) + ((r >> 16) & 0xffff) +
                                              ((r >> 32) & 0xffff) + (r >> 48)) /
                          65536.0;
        const double v = proto[k] + kNoiseStddev * kSqrt3 * (u4 - 2.0);
        img[k] = static_cast<uint8_t>(std::clamp(v + 0.5, 0.0, 255.0));
      }
    }
  });
  return d;
}

}  // namespace

DataSplit make_synthetic(int64_t channels, int64_t height, int64_t width, int num_classes,
                         int64_t train_size, int64_t test_size, uint64_t seed) {
  TOWERS_REQUIRE(channels > 0 && height > 0 && width > 0,
                 "synthetic data: image shape {}x{}x{} must be positive", channels, height, width);
  TOWERS_REQUIRE(num_classes > 0, "synthetic data: num_classes {} must be positive", num_classes);
  TOWERS_REQUIRE(train_size > 0 && test_size > 0,
                 "synthetic data: train size {} and test size {} must be positive", train_size,
                 test_size);
  std::vector<std::vector<float>> prototypes;
  for (int k = 0; k < num_classes; ++k) {
    Rng rng(seed, kPrototypeStream, static_cast<uint64_t>(k));
    prototypes.push_back(make_prototype(channels, height, width, rng));
  }
  DataSplit split;
  split.train = make_split(prototypes, channels, height, width, train_size, seed, kTrainStream,
                           "synthetic/train");
  split.test = make_split(prototypes, channels, height, width, test_size, seed, kTestStream,
                          "synthetic/test");
  return split;
}

}  // namespace towers::data
