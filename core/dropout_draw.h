// The dropout op's random draw (core/backend_ops.inc), shared by the CPU backend and the CUDA
// kernel so that both drop the same elements.
#pragma once

#include <cstdint>

namespace iris {

// The draw of element `index` in [0, 2^32): SplitMix64's finalizer over the seed, the call's
// stream and the index.
#if defined(__CUDACC__)
__host__ __device__
#endif
    inline uint32_t
    dropout_draw(uint64_t seed, uint64_t stream, uint64_t index) {
  uint64_t z = seed + stream * 0x9E3779B97F4A7C15ULL + (index + 1) * 0xD1B54A32D192ED03ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return static_cast<uint32_t>((z ^ (z >> 31)) >> 32);
}

}  // namespace iris
