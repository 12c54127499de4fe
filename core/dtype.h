// Element types and the bf16/f16 <-> f32 conversions used on load and in the CPU reference.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

namespace iris {

// u8: raw bytes (an image's RGB pixels), never converted to or from another type.
enum class DType : uint8_t { f32, bf16, f16, i32, i64, u8 };

size_t dtype_size(DType t);
const char* dtype_name(DType t);

// Round-to-nearest-even, as torch does when casting f32 to bf16; NaN stays NaN.
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Rounds through bf16 and back: the CPU reference uses it where a test wants bf16 cast points.
inline float round_bf16(float f) {
  return bf16_to_f32(f32_to_bf16(f));
}

float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);

// n elements of type `from` at src into type `to` at dst: floats round to nearest even, integers
// convert exactly (narrowing to i32 is range-checked), anything else goes through f32. Both
// backends' write()/read() use it, so model code sees the same conversions everywhere.
void convert_elements(void* dst, DType to, const void* src, DType from, int64_t n);

// The index of the first NaN or Inf among n floating-point elements of type `dtype` at `data`
// (unaligned is fine), or -1 when all are finite. Reads the raw bits on every thread.
int64_t first_non_finite(const void* data, DType dtype, int64_t n);

}  // namespace iris
