#include "core/dtype.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/error.h"

namespace iris {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32:
      return 4;
    case DType::bf16:
      return 2;
    case DType::f16:
      return 2;
    case DType::i32:
      return 4;
    case DType::i64:
      return 8;
    case DType::u8:
      return 1;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32:
      return "f32";
    case DType::bf16:
      return "bf16";
    case DType::f16:
      return "f16";
    case DType::i32:
      return "i32";
    case DType::i64:
      return "i64";
    case DType::u8:
      return "u8";
  }
  return "?";
}

float f16_to_f32(uint16_t h) {
  const uint32_t sign = (h >> 15) & 1u, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  float v;
  if (exp == 0) {
    v = std::ldexp(static_cast<float>(mant), -24);
  } else if (exp == 31) {
    v = mant ? NAN : INFINITY;
  } else {
    v = std::ldexp(static_cast<float>(mant | 0x400u), static_cast<int>(exp) - 25);
  }
  return sign ? -v : v;
}

uint16_t f32_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const float a = std::fabs(f);
  if (std::isnan(f)) return static_cast<uint16_t>(sign | 0x7e00u);
  if (a >= 65520.0f) return static_cast<uint16_t>(sign | 0x7c00u);
  if (a < 6.103515625e-05f) {  // subnormal: scale into the 10-bit mantissa, round to even
    const float m = std::nearbyint(a * 16777216.0f);
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(m));
  }
  int e;
  const float fr = std::frexp(a, &e);  // a = fr * 2^e, fr in [0.5, 1)
  uint32_t mant = static_cast<uint32_t>(std::nearbyint((fr * 2.0f - 1.0f) * 1024.0f));
  uint32_t exp = static_cast<uint32_t>(e - 1 + 15);
  if (mant == 1024) {
    mant = 0;
    ++exp;
  }
  return static_cast<uint16_t>(sign | (exp << 10) | mant);
}

namespace {

float load_as_f32(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::f32:
      return static_cast<const float*>(p)[i];
    case DType::bf16:
      return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
    case DType::f16:
      return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
    case DType::i32:
      return static_cast<float>(static_cast<const int32_t*>(p)[i]);
    case DType::i64:
      return static_cast<float>(static_cast<const int64_t*>(p)[i]);
    case DType::u8:
      break;
  }
  return 0.0f;
}

}  // namespace

void convert_elements(void* dst, DType dt, const void* src, DType st, int64_t n) {
  // An empty tensor (a pipeline stage's empty optimizer table) may come with null pointers, which
  // memcpy must not be given even for zero bytes.
  if (n <= 0) return;
  if (dt == st) {
    std::memcpy(dst, src, static_cast<size_t>(n) * dtype_size(dt));
    return;
  }
  IRIS_CHECK(dt != DType::u8 && st != DType::u8, "u8 data converts only to u8, not ",
             dtype_name(dt == DType::u8 ? st : dt));
  const bool src_int = st == DType::i32 || st == DType::i64;
  const bool dst_int = dt == DType::i32 || dt == DType::i64;
  for (int64_t i = 0; i < n; ++i) {
    if (src_int && dst_int) {
      const int64_t v = st == DType::i32 ? static_cast<const int32_t*>(src)[i]
                                         : static_cast<const int64_t*>(src)[i];
      if (dt == DType::i32) {
        IRIS_CHECK(
            v >= std::numeric_limits<int32_t>::min() && v <= std::numeric_limits<int32_t>::max(),
            "integer ", v, " does not fit in i32");
        static_cast<int32_t*>(dst)[i] = static_cast<int32_t>(v);
      } else {
        static_cast<int64_t*>(dst)[i] = v;
      }
      continue;
    }
    const float v = load_as_f32(src, st, i);
    switch (dt) {
      case DType::f32:
        static_cast<float*>(dst)[i] = v;
        break;
      case DType::bf16:
        static_cast<uint16_t*>(dst)[i] = f32_to_bf16(v);
        break;
      case DType::f16:
        static_cast<uint16_t*>(dst)[i] = f32_to_f16(v);
        break;
      case DType::i32:
        static_cast<int32_t*>(dst)[i] = static_cast<int32_t>(v);
        break;
      case DType::i64:
        static_cast<int64_t*>(dst)[i] = static_cast<int64_t>(v);
        break;
      case DType::u8:
        break;
    }
  }
}

namespace {
// The element's exponent bits all set: Inf or NaN, whatever the mantissa. Each run of elements is
// first ORed without a branch (the loop vectorises, so a checkpoint is checked at the speed of
// memory), and scanned for the index only where it holds one.
template <typename Bits>
int64_t first_all_ones(const unsigned char* s, int64_t n, Bits exponent) {
  constexpr int64_t kRun = 4096;
  const int64_t runs = (n + kRun - 1) / kRun;
  int64_t first = n;
#pragma omp parallel for schedule(static) reduction(min : first) if (n > (int64_t(1) << 20))
  for (int64_t r = 0; r < runs; ++r) {
    const int64_t begin = r * kRun, end = std::min(n, begin + kRun);
    unsigned hit = 0;
    for (int64_t i = begin; i < end; ++i) {
      Bits v;
      std::memcpy(&v, s + i * int64_t(sizeof(Bits)), sizeof(Bits));
      hit |= static_cast<unsigned>((v & exponent) == exponent);
    }
    if (hit == 0) continue;
    for (int64_t i = begin; i < end; ++i) {
      Bits v;
      std::memcpy(&v, s + i * int64_t(sizeof(Bits)), sizeof(Bits));
      if ((v & exponent) == exponent) {
        first = std::min(first, i);
        break;
      }
    }
  }
  return first == n ? -1 : first;
}
}  // namespace

int64_t first_non_finite(const void* data, DType dtype, int64_t n) {
  const auto* s = static_cast<const unsigned char*>(data);
  switch (dtype) {
    case DType::f32:
      return first_all_ones<uint32_t>(s, n, 0x7F800000u);
    case DType::bf16:
      return first_all_ones<uint16_t>(s, n, uint16_t{0x7F80});
    case DType::f16:
      return first_all_ones<uint16_t>(s, n, uint16_t{0x7C00});
    default:
      IRIS_FAIL("first_non_finite: ", dtype_name(dtype), " is not a floating-point dtype");
  }
}

}  // namespace iris
