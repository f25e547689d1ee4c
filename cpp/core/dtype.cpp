#include "core/dtype.h"

#include <cmath>
#include <cstring>

#include "core/error.h"

namespace ferrum {

namespace {
const DTypeInfo kInfo[] = {
    {"f32", 1, 4, false},    {"f16", 1, 2, false},    {"bf16", 1, 2, false},
    {"i32", 1, 4, false},    {"i8", 1, 1, false},     {"q4_0", 32, 18, true},
    {"q4_1", 32, 20, true},  {"q5_0", 32, 22, true},  {"q5_1", 32, 24, true},
    {"q8_0", 32, 34, true},  {"q8_1", 32, 36, true},  {"q2_k", 256, 84, true},
    {"q3_k", 256, 110, true}, {"q4_k", 256, 144, true}, {"q5_k", 256, 176, true},
    {"q6_k", 256, 210, true}, {"q8_k", 256, 292, true},
    {"iq4_nl", 32, 18, true}, {"iq4_xs", 256, 136, true},
    {"i64", 1, 8, false},
};
static_assert(sizeof(kInfo) / sizeof(kInfo[0]) == size_t(kLastType) + 1, "one entry per DType");
}  // namespace

const DTypeInfo& dtype_info(DType t) { return kInfo[static_cast<int>(t)]; }

size_t dtype_bytes(DType t, int64_t n) {
  const DTypeInfo& i = dtype_info(t);
  return size_t(n / i.block_elems) * size_t(i.block_bytes);
}

DType dtype_from_name(const std::string& name) {
  for (int i = 0; i <= int(kLastType); ++i)
    if (name == kInfo[i].name) return static_cast<DType>(i);
  throw ValueError("unknown dtype '" + name + "'");
}

float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: renormalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400) == 0) {
        mant <<= 1;
        --exp;
      }
      bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t f32_to_f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000;
  uint32_t absx = x & 0x7fffffff;
  if (absx >= 0x7f800000) return uint16_t(sign | 0x7c00 | (absx > 0x7f800000 ? 0x200 : 0));
  if (absx >= 0x477ff000) return uint16_t(sign | 0x7c00);  // overflow to inf
  if (absx < 0x38800000) {  // subnormal or zero in half: round via float arithmetic
    float a;
    std::memcpy(&a, &absx, 4);
    return uint16_t(sign | uint32_t(std::nearbyint(a * 16777216.0f)));  // a / 2^-24
  }
  uint32_t mant_odd = (absx >> 13) & 1;
  absx += 0xc8000fff + mant_odd;  // rebias exponent (-112 << 23) and round to nearest even
  return uint16_t(sign | (absx >> 13));
}

uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffff) > 0x7f800000) return uint16_t((u >> 16) | 64);  // quiet NaN
  u += 0x7fff + ((u >> 16) & 1);
  return uint16_t(u >> 16);
}

}  // namespace ferrum
