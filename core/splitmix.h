// SplitMix64: a generator whose stream is fixed by its definition, for everything that must replay
// bit for bit on any platform (data order, synthetic scenes, random initialisation); the standard
// library's distributions are implementation-defined.
#pragma once

#include <cmath>
#include <cstdint>

namespace iris {

class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}

  uint64_t next() { return finalize(state_ += kGamma); }
  // The state only ever advances by kGamma, so draw k of any stream can be computed without the
  // k before it: a parallel fill gives the bits of the sequential one.
  void skip(uint64_t draws) { state_ += draws * kGamma; }
  // Uniform in [0, n) by rejection (no modulo bias).
  uint64_t below(uint64_t n) {
    const uint64_t limit = ~uint64_t{0} - (~uint64_t{0} % n);
    for (;;) {
      const uint64_t r = next();
      if (r < limit) return r % n;
    }
  }
  // Uniform in [lo, hi], both inclusive.
  int uniform_int(int lo, int hi) {
    return lo + static_cast<int>(below(static_cast<uint64_t>(hi - lo) + 1));
  }
  double uniform01() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }  // [0, 1)
  double normal() {                                                             // Box-Muller
    const double u1 = 1.0 - uniform01(), u2 = uniform01();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
  // Folds a value into the state (seed derivation).
  void mix(uint64_t v) { state_ ^= v; }
  // normal() draws exactly two values (no rejection), so normal number k of a stream is at draw
  // 2k; normal_draws says how far a stream of n normals advances.
  static constexpr uint64_t normal_draws(uint64_t n) { return 2 * n; }

 private:
  static constexpr uint64_t kGamma = 0x9E3779B97F4A7C15ull;
  static uint64_t finalize(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  uint64_t state_;
};

}  // namespace iris
