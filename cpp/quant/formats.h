// Byte layouts of the GGUF / ggml block formats. Field order and sizes are the file format, so
// these structs are read straight out of mapped weight files (all fields are byte-aligned).
#pragma once
#include <cstdint>
#include <cstring>

namespace ferrum::quant {

constexpr int kQK = 32;    // elements per block of the legacy formats (Q4_0 .. Q8_1)
constexpr int kQKK = 256;  // elements per super-block of the k-quants

// x = d * (q - 8), q in 0..15; element j in the low nibble of qs[j], j + 16 in the high one.
struct BlockQ4_0 {
  uint16_t d;  // f16
  uint8_t qs[kQK / 2];
};
// x = d * q + m, q in 0..15, nibble layout as Q4_0.
struct BlockQ4_1 {
  uint16_t d, m;  // f16
  uint8_t qs[kQK / 2];
};
// x = d * (q - 16), q in 0..31: low 4 bits as Q4_0, bit 4 of element j is bit j of qh.
struct BlockQ5_0 {
  uint16_t d;
  uint8_t qh[4];
  uint8_t qs[kQK / 2];
};
// x = d * q + m, q in 0..31, bit layout as Q5_0.
struct BlockQ5_1 {
  uint16_t d, m;
  uint8_t qh[4];
  uint8_t qs[kQK / 2];
};
// x = d * q.
struct BlockQ8_0 {
  uint16_t d;
  int8_t qs[kQK];
};
// x = d * q; s = d * sum(q) (kept for format compatibility; our kernels do not read it).
struct BlockQ8_1 {
  uint16_t d, s;
  int8_t qs[kQK];
};

// 16 sub-blocks of 16: x = d * (scales & 15) * q - dmin * (scales >> 4), q in 0..3.
struct BlockQ2_K {
  uint8_t scales[kQKK / 16];
  uint8_t qs[kQKK / 4];
  uint16_t d, dmin;
};
// 16 sub-blocks of 16: x = d * (scale - 32) * (q - 4), q in 0..7 (2 low bits in qs, bit 2 in
// hmask); the 6-bit scales are packed into 12 bytes.
struct BlockQ3_K {
  uint8_t hmask[kQKK / 8];
  uint8_t qs[kQKK / 4];
  uint8_t scales[12];
  uint16_t d;
};
// 8 sub-blocks of 32: x = d * scale * q - dmin * min, q in 0..15; 6-bit scales and mins packed
// into 12 bytes.
struct BlockQ4_K {
  uint16_t d, dmin;
  uint8_t scales[12];
  uint8_t qs[kQKK / 2];
};
// As Q4_K with a fifth bit per element in qh, q in 0..31.
struct BlockQ5_K {
  uint16_t d, dmin;
  uint8_t scales[12];
  uint8_t qh[kQKK / 8];
  uint8_t qs[kQKK / 2];
};
// 16 sub-blocks of 16: x = d * scale * (q - 32), q in 0..63 (4 low bits in ql, 2 high in qh).
struct BlockQ6_K {
  uint8_t ql[kQKK / 2];
  uint8_t qh[kQKK / 4];
  int8_t scales[kQKK / 16];
  uint16_t d;
};
// The i-quants' non-linear 4-bit levels.
inline constexpr int8_t kIq4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
// x = d * kIq4Values[q], q in 0..15; nibble layout as Q4_0.
struct BlockIQ4_NL {
  uint16_t d;
  uint8_t qs[kQK / 2];
};
// 8 sub-blocks of 32: x = d * (scale - 32) * kIq4Values[q]; the 6-bit scale j keeps its low 4
// bits in nibble j % 2 of scales_l[j / 2] and its top 2 in bits 2j, 2j + 1 of scales_h; sub-block
// j's quants are qs[16j..16j + 15] in IQ4_NL's nibble layout.
struct BlockIQ4_XS {
  uint16_t d, scales_h;
  uint8_t scales_l[kQKK / 64];
  uint8_t qs[kQKK / 2];
};
// Scale j of an IQ4_XS super-block, less 32.
inline int iq4xs_scale(const BlockIQ4_XS& b, int j) {
  return (((b.scales_l[j / 2] >> (4 * (j % 2))) & 15) | (((b.scales_h >> (2 * j)) & 3) << 4)) - 32;
}

// Activation format of the k-quant dot products: x = d * q; bsums[i] = sum of qs[16i..16i+15].
struct BlockQ8_K {
  float d;
  int8_t qs[kQKK];
  int16_t bsums[kQKK / 16];
};

static_assert(sizeof(BlockQ4_0) == 18 && sizeof(BlockQ4_1) == 20, "format size");
static_assert(sizeof(BlockQ5_0) == 22 && sizeof(BlockQ5_1) == 24, "format size");
static_assert(sizeof(BlockQ8_0) == 34 && sizeof(BlockQ8_1) == 36, "format size");
static_assert(sizeof(BlockQ2_K) == 84 && sizeof(BlockQ3_K) == 110, "format size");
static_assert(sizeof(BlockQ4_K) == 144 && sizeof(BlockQ5_K) == 176, "format size");
static_assert(sizeof(BlockQ6_K) == 210 && sizeof(BlockQ8_K) == 292, "format size");
static_assert(sizeof(BlockIQ4_NL) == 18 && sizeof(BlockIQ4_XS) == 136, "format size");

// The 6-bit scale and min of sub-block j (0..7) of a Q4_K / Q5_K super-block: j < 4 live in the
// low 6 bits of bytes j and j + 4; j >= 4 keep 4 bits in byte j + 4 and their top 2 bits in the
// spare top bits of bytes j - 4 and j.
inline void k4_scale_min(const uint8_t* packed, int j, int& scale, int& min) {
  if (j < 4) {
    scale = packed[j] & 63;
    min = packed[j + 4] & 63;
  } else {
    scale = (packed[j + 4] & 15) | ((packed[j - 4] >> 6) << 4);
    min = (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4);
  }
}

// All 8 scales (low 64 bits) and mins (high 64 bits) of a Q4_K / Q5_K super-block, one per byte,
// computed in registers: k4_scale_min for j = 0..7 at once, for the SIMD kernels. static: each
// kernel file keeps its own copy compiled for its ISA (an inline one could be shared across files
// built with different -m flags).
static inline void unpack_k4_scales(const uint8_t* packed, uint64_t& scales, uint64_t& mins) {
  uint32_t a0, a1, a2;
  std::memcpy(&a0, packed, 4);
  std::memcpy(&a1, packed + 4, 4);
  std::memcpy(&a2, packed + 8, 4);
  const uint32_t sc_hi = (a2 & 0x0f0f0f0f) | (((a0 >> 6) & 0x03030303) << 4);
  const uint32_t m_hi = ((a2 >> 4) & 0x0f0f0f0f) | (((a1 >> 6) & 0x03030303) << 4);
  scales = (a0 & 0x3f3f3f3f) | (uint64_t(sc_hi) << 32);
  mins = (a1 & 0x3f3f3f3f) | (uint64_t(m_hi) << 32);
}

// The 6-bit scale of Q3_K sub-block i (0..15), still offset by 32: low 4 bits are the low
// (i < 8) or high (i >= 8) nibble of byte i % 8; the top 2 bits come from byte 8 + i % 4.
inline int q3k_scale(const uint8_t* packed, int i) {
  int low = i < 8 ? (packed[i] & 15) : (packed[i - 8] >> 4);
  int high = (packed[8 + i % 4] >> (2 * (i / 4))) & 3;
  return low | (high << 4);
}

}  // namespace ferrum::quant
