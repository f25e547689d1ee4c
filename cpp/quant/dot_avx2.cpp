// AVX2 + FMA + F16C dot kernels. Every function carries the target attribute (and CMake builds
// this file with -mno-avx512f), so this is genuine AVX2 code that runs on AVX2-only CPUs.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <type_traits>

#include "quant/formats.h"
#include "quant/kernels.h"

#define FERRUM_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace ferrum::quant::detail {

namespace {

FERRUM_AVX2 inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

FERRUM_AVX2 inline float h2f(uint16_t h) { return _cvtsh_ss(h); }

// ---- float weights against f32 activations: 4 independent accumulators hide FMA latency ----

FERRUM_AVX2 inline __m256 load8_f32(const float* p) { return _mm256_loadu_ps(p); }
FERRUM_AVX2 inline __m256 load8_f16(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
FERRUM_AVX2 inline __m256 load8_bf16(const uint16_t* p) {  // bf16 is the top half of an f32
  __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline float scalar_f32(const float* p) { return *p; }
inline float scalar_f16(const uint16_t* p) { return f16_to_f32(*p); }
inline float scalar_bf16(const uint16_t* p) { return bf16_to_f32(*p); }

template <class T, __m256 (*Load8)(const T*), float (*Scalar)(const T*)>
FERRUM_AVX2 float dot_float(int64_t n, const void* w, const void* act) {
  const T* x = static_cast<const T*>(w);
  const float* a = static_cast<const float*>(act);
  __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    acc0 = _mm256_fmadd_ps(Load8(x + i), _mm256_loadu_ps(a + i), acc0);
    acc1 = _mm256_fmadd_ps(Load8(x + i + 8), _mm256_loadu_ps(a + i + 8), acc1);
    acc2 = _mm256_fmadd_ps(Load8(x + i + 16), _mm256_loadu_ps(a + i + 16), acc2);
    acc3 = _mm256_fmadd_ps(Load8(x + i + 24), _mm256_loadu_ps(a + i + 24), acc3);
  }
  for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(Load8(x + i), _mm256_loadu_ps(a + i), acc0);
  float sum = hsum(_mm256_add_ps(_mm256_add_ps(acc0, acc1), _mm256_add_ps(acc2, acc3)));
  for (; i < n; ++i) sum += Scalar(x + i) * a[i];
  return sum;
}

// ---- legacy formats against Q8_0 ----

// 16 bytes of nibbles -> 32 bytes: element j (low nibble of byte j) then j + 16 (high nibble).
FERRUM_AVX2 inline __m256i unpack_nibbles(const uint8_t* qs) {
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(x, 4), x), _mm256_set1_epi8(15));
}

// 32 bits -> 32 bytes, 0x10 where bit j of `bits` is set (the fifth bit of element j).
FERRUM_AVX2 inline __m256i fifth_bits(const uint8_t* qh) {
  uint32_t bits;
  std::memcpy(&bits, qh, 4);
  // Byte j gets byte j / 8 of `bits`; then each byte keeps only its own bit j % 8.
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(int(bits)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
  const __m256i select = _mm256_set1_epi64x(int64_t(0x8040201008040201ull));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

template <class Block, int kBits>
FERRUM_AVX2 inline __m256i unsigned_quants(const Block& b) {
  __m256i q = unpack_nibbles(b.qs);
  if constexpr (kBits == 5) q = _mm256_or_si256(q, fifth_bits(b.qh));
  return q;
}

// The sums of the 8 int32 lanes of v0 .. v3 (exact), as 4 floats.
FERRUM_AVX2 inline __m128 lane_sums(__m256i v0, __m256i v1, __m256i v2, __m256i v3) {
  const __m256i s = _mm256_hadd_epi32(_mm256_hadd_epi32(v0, v1), _mm256_hadd_epi32(v2, v3));
  return _mm_cvtepi32_ps(_mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1)));
}

// The f16 fields at byte offset `at` of 4 blocks, as floats.
template <class Block>
FERRUM_AVX2 inline __m128 halves4(const Block* const b[4], size_t at) {
  uint16_t h[4];
  for (int r = 0; r < 4; ++r) std::memcpy(&h[r], reinterpret_cast<const char*>(b[r]) + at, 2);
  return _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(h)));
}

// Legacy formats: a block's integer sums whole, then the scalar kernel's float chain
// (dot_scalar.cpp), which the AVX-512 kernels also take: every ISA gives the same bits. The
// chain is serial, so four rows run at once, one per float lane, sharing the activation block.
// Q4_0 .. Q5_1: unsigned quants q (0..31) times int8 activations, maddubs pairs within int16
// (2 * 31 * 127); the zero point is removed as offset * sum(a), also summed by maddubs.
// Q8_0: |w| (unsigned) times a with w's sign; both within +-127, so no pair saturates.
template <class Block, int kBits, int kOffsetShift, bool kHasMin>
FERRUM_AVX2 void dot_rows_legacy(int64_t n, const void* w, size_t w_row_bytes, int64_t rows, const void* act,
                                 float* out) {
  const BlockQ8_0* y = static_cast<const BlockQ8_0*>(act);
  const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
  for (int64_t r0 = 0; r0 < rows; r0 += 4) {
    const int live = int(std::min<int64_t>(4, rows - r0));
    const Block* x[4];  // rows past `live` repeat the last one (computed, not stored)
    for (int r = 0; r < 4; ++r)
      x[r] = reinterpret_cast<const Block*>(static_cast<const char*>(w) + size_t(r0 + std::min(r, live - 1)) * w_row_bytes);
    __m128 sum = _mm_setzero_ps();
    for (int64_t i = 0; i < n / kQK; ++i) {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y[i].qs));
      const __m256i sa = _mm256_maddubs_epi16(ones8, a);
      __m256i isum[4];
      for (int r = 0; r < 4; ++r) {
        __m256i pairs;
        if constexpr (kBits == 8) {
          const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[r][i].qs));
          pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(a, q));
        } else {
          pairs = _mm256_maddubs_epi16(unsigned_quants<Block, kBits>(x[r][i]), a);
          if constexpr (!kHasMin) pairs = _mm256_sub_epi16(pairs, _mm256_slli_epi16(sa, kOffsetShift));
        }
        isum[r] = _mm256_madd_epi16(pairs, ones16);
      }
      const Block* blocks[4] = {&x[0][i], &x[1][i], &x[2][i], &x[3][i]};
      const __m128 da = _mm_set1_ps(h2f(y[i].d));
      sum = _mm_fmadd_ps(_mm_mul_ps(halves4(blocks, offsetof(Block, d)), da), lane_sums(isum[0], isum[1], isum[2], isum[3]),
                         sum);
      if constexpr (kHasMin) {
        const __m256i sa32 = _mm256_madd_epi16(sa, ones16);
        sum = _mm_fmadd_ps(_mm_mul_ps(halves4(blocks, offsetof(Block, m)), da), lane_sums(sa32, sa32, sa32, sa32), sum);
      }
    }
    alignas(16) float lanes[4];
    _mm_store_ps(lanes, sum);
    for (int r = 0; r < live; ++r) out[r0 + r] = lanes[r];
  }
}

// ---- k-quants against Q8_K ----


// sum_j mins[j] * (bsums[2j] + bsums[2j + 1]), as 8 int32 lanes.
FERRUM_AVX2 inline __m256i min_terms(uint64_t mins, const int16_t* bsums) {
  __m256i m32 = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(mins)));
  m32 = _mm256_or_si256(m32, _mm256_slli_epi32(m32, 16));  // m_j in both int16 halves
  return _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bsums)), m32);
}

template <bool kFiveBit, class Block>
FERRUM_AVX2 float dot_k4(int64_t n, const void* w, const void* act) {  // Q4_K and Q5_K
  const Block* x = static_cast<const Block*>(w);
  const BlockQ8_K* y = static_cast<const BlockQ8_K*>(act);
  const __m256i low4 = _mm256_set1_epi8(15), ones8 = _mm256_set1_epi8(1);
  __m256 acc = _mm256_setzero_ps(), acc_min = acc;
  for (int64_t i = 0; i < n / kQKK; ++i) {
    uint64_t scale_bytes, mins;
    unpack_k4_scales(x[i].scales, scale_bytes, mins);
    uint8_t scales[8];
    std::memcpy(scales, &scale_bytes, 8);
    __m256i qh;
    if constexpr (kFiveBit) qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[i].qh));
    __m256i isum = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[i].qs + 32 * c));
      __m256i q_lo = _mm256_and_si256(q, low4);
      __m256i q_hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
      if constexpr (kFiveBit) {
        q_lo = _mm256_or_si256(
            q_lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), ones8), 4));
        q_hi = _mm256_or_si256(
            q_hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c + 1), ones8), 4));
      }
      const __m256i a_lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y[i].qs + 64 * c));
      const __m256i a_hi =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y[i].qs + 64 * c + 32));
      const __m256i p_lo = _mm256_madd_epi16(_mm256_maddubs_epi16(q_lo, a_lo),
                                             _mm256_set1_epi16(scales[2 * c]));
      const __m256i p_hi = _mm256_madd_epi16(_mm256_maddubs_epi16(q_hi, a_hi),
                                             _mm256_set1_epi16(scales[2 * c + 1]));
      isum = _mm256_add_epi32(isum, _mm256_add_epi32(p_lo, p_hi));
    }
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(h2f(x[i].d) * y[i].d), acc);
    acc_min = _mm256_fmadd_ps(_mm256_cvtepi32_ps(min_terms(mins, y[i].bsums)),
                              _mm256_set1_ps(h2f(x[i].dmin) * y[i].d), acc_min);
  }
  return hsum(_mm256_sub_ps(acc, acc_min));
}

// Q2_K / Q3_K: 32 bytes of qs hold four 32-element quarters j in 2-bit fields (element
// 128h + 32j + l is field j of qs[32h + l]); every 16 elements have a scale. Q2_K: 4-bit scales and
// mins (acc - dmin * sum_s min_s * bsum_s); Q3_K: bit 4h + j of hmask[l] is the third bit,
// the zero point is 4 (removed with the block sums, as Q6_K's) and the scales are 6-bit, offset 32.
template <bool kThreeBit>
FERRUM_AVX2 float dot_k2(int64_t n, const void* w, const void* act) {
  using Block = std::conditional_t<kThreeBit, BlockQ3_K, BlockQ2_K>;
  const Block* x = static_cast<const Block*>(w);
  const BlockQ8_K* y = static_cast<const BlockQ8_K*>(act);
  const __m256i low2 = _mm256_set1_epi8(3), ones8 = _mm256_set1_epi8(1);
  __m256 acc = _mm256_setzero_ps(), acc_min = acc;
  for (int64_t i = 0; i < n / kQKK; ++i) {
    const __m256i bsums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y[i].bsums));
    __m128i scale_bytes;  // the 16 scales as int8
    __m256i isum, hmask;
    if constexpr (kThreeBit) {
      uint32_t a[3], sc[4];
      std::memcpy(a, x[i].scales, 12);
      for (int k = 0; k < 4; ++k)  // scales 4k..4k+3: low nibbles (k = 0, 1) / high (2, 3) of a[k % 2]
        sc[k] = ((a[k % 2] >> (4 * (k / 2))) & 0x0f0f0f0fu) | (((a[2] >> (2 * k)) & 0x03030303u) << 4);
      scale_bytes = _mm_sub_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)), _mm_set1_epi8(32));
      // sum_s scale_s * (-4 * bsum_s)
      isum = _mm256_slli_epi32(_mm256_madd_epi16(bsums, _mm256_cvtepi8_epi16(scale_bytes)), 2);
      isum = _mm256_sub_epi32(_mm256_setzero_si256(), isum);
      hmask = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[i].hmask));
    } else {
      const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x[i].scales));
      scale_bytes = _mm_and_si128(packed, _mm_set1_epi8(15));
      const __m256i mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(packed, 4), _mm_set1_epi8(15)));
      acc_min = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(bsums, mins)),
                                _mm256_set1_ps(h2f(x[i].dmin) * y[i].d), acc_min);
      isum = _mm256_setzero_si256();
    }
    alignas(16) int8_t scales[16];
    _mm_store_si128(reinterpret_cast<__m128i*>(scales), scale_bytes);
    for (int h = 0; h < 2; ++h) {
      const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[i].qs + 32 * h));
      for (int j = 0; j < 4; ++j) {
        __m256i q = _mm256_and_si256(_mm256_srli_epi16(qs, 2 * j), low2);
        if constexpr (kThreeBit)
          q = _mm256_or_si256(q, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hmask, 4 * h + j), ones8), 2));
        const int s = 8 * h + 2 * j;  // elements l < 16 and l >= 16 of the quarter
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y[i].qs + 128 * h + 32 * j));
        const __m256i scale = _mm256_set_m128i(_mm_set1_epi16(scales[s + 1]), _mm_set1_epi16(scales[s]));
        isum = _mm256_add_epi32(isum, _mm256_madd_epi16(_mm256_maddubs_epi16(q, a), scale));
      }
    }
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(h2f(x[i].d) * y[i].d), acc);
  }
  return hsum(_mm256_sub_ps(acc, acc_min));
}

// IQ4_NL / IQ4_XS: vpshufb maps the nibbles to the 16 non-linear levels; the signed levels meet
// the signed activations as maddubs(|w|, a * sign(w)) (pair sums up to 2 * 127 * 127: no
// saturation).

// 16 bytes of nibbles -> the 32 levels: low nibbles (elements 0..15), then high ones (16..31).
FERRUM_AVX2 inline __m256i iq4_levels(const uint8_t* qs) {
  const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4Values));
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)), low4 = _mm_set1_epi8(15);
  return _mm256_set_m128i(_mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(q, 4), low4)),
                          _mm_shuffle_epi8(table, _mm_and_si128(q, low4)));
}

// 16 int16 sums of adjacent w * a products (both signed).
FERRUM_AVX2 inline __m256i signed_pairs(__m256i w, const int8_t* a) {
  const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
  return _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(av, w));
}

FERRUM_AVX2 float dot_iq4_nl(int64_t n, const void* w, const void* act) {
  const BlockIQ4_NL* x = static_cast<const BlockIQ4_NL*>(w);
  const BlockQ8_0* y = static_cast<const BlockQ8_0*>(act);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < n / kQK; ++i) {
    const __m256i isum = _mm256_madd_epi16(signed_pairs(iq4_levels(x[i].qs), y[i].qs), _mm256_set1_epi16(1));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(h2f(x[i].d) * h2f(y[i].d)), acc);
  }
  return hsum(acc);
}

FERRUM_AVX2 float dot_iq4_xs(int64_t n, const void* w, const void* act) {
  const BlockIQ4_XS* x = static_cast<const BlockIQ4_XS*>(w);
  const BlockQ8_K* y = static_cast<const BlockQ8_K*>(act);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < n / kQKK; ++i) {
    __m256i isum = _mm256_setzero_si256();
    for (int s = 0; s < 8; ++s) {
      const __m256i pairs = signed_pairs(iq4_levels(x[i].qs + 16 * s), y[i].qs + 32 * s);
      isum = _mm256_add_epi32(isum, _mm256_madd_epi16(pairs, _mm256_set1_epi16(int16_t(iq4xs_scale(x[i], s)))));
    }
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(h2f(x[i].d) * y[i].d), acc);
  }
  return hsum(acc);
}

// Q6_K: unsigned quants 0..63 times a, scaled per 16 elements; the -32 zero point is removed
// with the activation block sums: sum_s scale_s * 32 * bsum_s.
FERRUM_AVX2 float dot_q6_k(int64_t n, const void* w, const void* act) {
  const BlockQ6_K* x = static_cast<const BlockQ6_K*>(w);
  const BlockQ8_K* y = static_cast<const BlockQ8_K*>(act);
  const __m256i low4 = _mm256_set1_epi8(15), bits45 = _mm256_set1_epi8(0x30);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < n / kQKK; ++i) {
    const int8_t* sc = x[i].scales;
    const __m256i scales16 =
        _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)));
    const __m256i zero_point = _mm256_slli_epi32(
        _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(y[i].bsums)),
                          scales16),
        5);
    __m256i isum = _mm256_sub_epi32(_mm256_setzero_si256(), zero_point);
    for (int h = 0; h < 2; ++h) {
      const uint8_t* ql = x[i].ql + 64 * h;
      const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
      const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32));
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[i].qh + 32 * h));
      const __m256i groups[4] = {
          _mm256_or_si256(_mm256_and_si256(l0, low4),
                          _mm256_and_si256(_mm256_slli_epi16(qh, 4), bits45)),
          _mm256_or_si256(_mm256_and_si256(l1, low4),
                          _mm256_and_si256(_mm256_slli_epi16(qh, 2), bits45)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4),
                          _mm256_and_si256(qh, bits45)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                          _mm256_and_si256(_mm256_srli_epi16(qh, 2), bits45)),
      };
      for (int g = 0; g < 4; ++g) {
        const int s = 8 * h + 2 * g;  // the group's two 16-element sub-blocks
        const __m256i a =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y[i].qs + 128 * h + 32 * g));
        const __m256i scale = _mm256_set_m128i(_mm_set1_epi16(sc[s + 1]), _mm_set1_epi16(sc[s]));
        isum = _mm256_add_epi32(isum,
                                _mm256_madd_epi16(_mm256_maddubs_epi16(groups[g], a), scale));
      }
    }
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(h2f(x[i].d) * y[i].d), acc);
  }
  return hsum(acc);
}

}  // namespace

DotRowsFn avx2_dot_rows(DType t) {
  switch (t) {
    case DType::F32: return for_each_row<dot_float<float, load8_f32, scalar_f32>>;
    case DType::F16: return for_each_row<dot_float<uint16_t, load8_f16, scalar_f16>>;
    case DType::BF16: return for_each_row<dot_float<uint16_t, load8_bf16, scalar_bf16>>;
    case DType::Q4_0: return dot_rows_legacy<BlockQ4_0, 4, 3, false>;
    case DType::Q4_1: return dot_rows_legacy<BlockQ4_1, 4, 0, true>;
    case DType::Q5_0: return dot_rows_legacy<BlockQ5_0, 5, 4, false>;
    case DType::Q5_1: return dot_rows_legacy<BlockQ5_1, 5, 0, true>;
    case DType::Q8_0: return dot_rows_legacy<BlockQ8_0, 8, 0, false>;
    case DType::Q2_K: return for_each_row<dot_k2<false>>;
    case DType::Q3_K: return for_each_row<dot_k2<true>>;
    case DType::IQ4_NL: return for_each_row<dot_iq4_nl>;
    case DType::IQ4_XS: return for_each_row<dot_iq4_xs>;
    case DType::Q4_K: return for_each_row<dot_k4<false, BlockQ4_K>>;
    case DType::Q5_K: return for_each_row<dot_k4<true, BlockQ5_K>>;
    case DType::Q6_K: return for_each_row<dot_q6_k>;
    default: return nullptr;
  }
}

}  // namespace ferrum::quant::detail
