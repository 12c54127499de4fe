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

  uint64_t next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
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

 private:
  uint64_t state_;
};

}  // namespace iris
