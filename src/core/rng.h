// rng.h — counter-based random numbers, so every draw is a pure function of its coordinates.
// Example order is f(seed, epoch); augmentation of an example is f(seed, epoch, position);
// initial weights are f(seed, variable). Nothing depends on thread scheduling, which is what
// makes sync runs bitwise reproducible and resume exact.
#pragma once

#include <cmath>
#include <cstdint>
#include <string_view>

namespace towers {

// splitmix64 finaliser: a strong 64-bit mixer (Steele, Lea, Flood 2014).
constexpr uint64_t mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

constexpr uint64_t hash_combine(uint64_t a, uint64_t b) { return mix64(a ^ mix64(b)); }

// FNV-1a: a stable string hash (std::hash may differ between standard libraries).
constexpr uint64_t hash_string(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (char c : s) h = (h ^ static_cast<unsigned char>(c)) * 0x100000001b3ULL;
  return h;
}

// A small sequential generator seeded from hashed coordinates.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(mix64(seed)) {}
  Rng(uint64_t seed, uint64_t a) : Rng(hash_combine(seed, a)) {}
  Rng(uint64_t seed, uint64_t a, uint64_t b) : Rng(hash_combine(hash_combine(seed, a), b)) {}

  uint64_t next_u64() {
    state_ += 0x9e3779b97f4a7c15ULL;
    uint64_t z = state_;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  // Uniform in [0, 1) with 24 random bits (exactly representable in float).
  float uniform() { return static_cast<float>(next_u64() >> 40) * (1.0f / 16777216.0f); }
  float uniform(float lo, float hi) { return lo + (hi - lo) * uniform(); }
  // Uniform integer in [0, n), n > 0 (Lemire's multiply-shift; bias < 2^-32 for our n).
  uint64_t below(uint64_t n) {
    return static_cast<uint64_t>((static_cast<unsigned __int128>(next_u64()) * n) >> 64);
  }
  // Standard normal (Box–Muller, double precision internally).
  double normal() {
    double u1 = (static_cast<double>(next_u64() >> 11) + 0.5) * (1.0 / 9007199254740992.0);
    double u2 = static_cast<double>(next_u64() >> 11) * (1.0 / 9007199254740992.0);
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
  // tf.truncated_normal: normal draws more than 2 stddev from the mean are redrawn.
  double truncated_normal(double stddev) {
    for (;;) {
      double z = normal();
      if (z > -2.0 && z < 2.0) return z * stddev;
    }
  }

 private:
  uint64_t state_;
};

}  // namespace towers
