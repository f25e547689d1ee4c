// AVX2 kernels for the weight types dotted with Q8_K activations (Q2_K .. Q6_K, IQ4_XS): the
// GEMM and the row kernels.
//
// The GEMM gives the row kernels' bits: per 256-element super-block and output it forms the same
// 8 int32 lanes (exact, so their order inside a lane does not matter) of
//   isum    = sum_s scale_s * (sum over sub-block s of q * a  - zero point * bsum_s)
//   min_sum = sum_s min_s * bsum_s                                     (Q2_K, Q4_K, Q5_K)
// and the same float steps on them: acc = fma(float(isum), d * d_a, acc) lane by lane (acc_min
// likewise with dmin), with the super-blocks in order, then hsum(acc - acc_min). So a row's
// result depends neither on how many activation rows share the call nor on its place among
// them. (These kernels round in their own order, not the scalar kernels'.)
//
// The GEMM runs four weight rows at once: each super-block of the four is unpacked once into a
// small buffer in L1 (PackedSuperBlock), which every activation row then passes over.
#include <algorithm>
#include <cstddef>
#include <cstring>
#include <type_traits>
#include <vector>

#include "quant/avx2_common.h"
#include "quant/formats.h"
#include "quant/kernels.h"

namespace ferrum::quant::detail {

namespace {

constexpr int kRows = 4;             // weight rows per pass, one per float lane
constexpr int kChunks = kQKK / 32;   // 32-element chunks per super-block

// One super-block of 4 weight rows, ready for the multiply loop.
struct PackedSuperBlock {
  __m256i quants[kRows][kChunks];  // chunk c: elements 32c .. 32c + 31 in order (unsigned, or signed levels)
  __m256i scales[kRows][kChunks];  // chunk c's scales as int16 words: elements 32c .. 32c + 15 in the low
                                   // 128 bits, the rest in the high ones (maddubs keeps that split)
  __m256i bsum_terms[kRows];       // int16 weights of the 16 activation block sums (bsums): -zero point
                                   // * scale (joins isum), or the mins (min_sum)
  alignas(16) float d[kRows], dmin[kRows];
};

// Chunk c's scale words from the scales of its two 16-element halves.
FERRUM_AVX2_INLINE __m256i half_scales(int lo, int hi) {
  return _mm256_set_m128i(_mm_set1_epi16(short(hi)), _mm_set1_epi16(short(lo)));
}

// Per format: pack(block, p, r) fills row r of p. kZeroPoint: bsum_terms join isum; kHasMin: they
// give min_sum; kSigned: quants are signed levels (signed_pairs), else unsigned (maddubs; pair
// sums within int16: 2 * 63 * 127).

// Q4_K / Q5_K: each 32 bytes of qs hold 32-element sub-block 2c in the low nibbles and 2c + 1 in
// the high ones; Q5_K's fifth bit of element l of sub-block j is bit j of qh[l].
template <class B, bool kFiveBit>
struct K4Format {
  using Block = B;
  static constexpr bool kZeroPoint = false, kHasMin = true, kSigned = false;
  FERRUM_AVX2_INLINE static void pack(const Block& b, PackedSuperBlock& p, int r) {
    uint64_t scale_bytes, mins;
    unpack_k4_scales(b.scales, scale_bytes, mins);
    uint8_t sc[8];
    std::memcpy(sc, &scale_bytes, 8);
    const __m256i low4 = _mm256_set1_epi8(15), ones8 = _mm256_set1_epi8(1);
    __m256i qh;
    if constexpr (kFiveBit) qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qh));
    for (int c = 0; c < 4; ++c) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qs + 32 * c));
      __m256i lo = _mm256_and_si256(q, low4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
      if constexpr (kFiveBit) {
        lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), ones8), 4));
        hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c + 1), ones8), 4));
      }
      p.quants[r][2 * c] = lo;
      p.quants[r][2 * c + 1] = hi;
    }
    for (int j = 0; j < 8; ++j) p.scales[r][j] = _mm256_set1_epi16(short(sc[j]));
    // min j weighs bsums 2j and 2j + 1
    const __m256i m32 = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(mins)));
    p.bsum_terms[r] = _mm256_or_si256(m32, _mm256_slli_epi32(m32, 16));
    p.d[r] = h2f(b.d);
    p.dmin[r] = h2f(b.dmin);
  }
};

// Q6_K: half h (128 elements) takes 64 bytes of ql and 32 of qh; its 32-element quarter g is the
// low (g = 0, 1) / high (g = 2, 3) nibbles of ql[32 (g % 2)..] with bits 2g, 2g + 1 of qh on top.
// Quants stay unsigned (0..63); the -32 zero point goes through the bsums.
struct Q6Format {
  using Block = BlockQ6_K;
  static constexpr bool kZeroPoint = true, kHasMin = false, kSigned = false;
  FERRUM_AVX2_INLINE static void pack(const Block& b, PackedSuperBlock& p, int r) {
    const __m256i low4 = _mm256_set1_epi8(15), bits45 = _mm256_set1_epi8(0x30);
    for (int h = 0; h < 2; ++h) {
      const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.ql + 64 * h));
      const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.ql + 64 * h + 32));
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qh + 32 * h));
      const __m256i low[4] = {l0, l1, _mm256_srli_epi16(l0, 4), _mm256_srli_epi16(l1, 4)};
      const __m256i high[4] = {_mm256_slli_epi16(qh, 4), _mm256_slli_epi16(qh, 2), qh, _mm256_srli_epi16(qh, 2)};
      for (int g = 0; g < 4; ++g) {
        p.quants[r][4 * h + g] = _mm256_or_si256(_mm256_and_si256(low[g], low4), _mm256_and_si256(high[g], bits45));
        const int s = 8 * h + 2 * g;
        p.scales[r][4 * h + g] = half_scales(b.scales[s], b.scales[s + 1]);
      }
    }
    const __m256i scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.scales)));
    p.bsum_terms[r] = _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_slli_epi16(scales16, 5));
    p.d[r] = h2f(b.d);
  }
};

// Q2_K / Q3_K: each 32 bytes of qs hold four 32-element quarters j in 2-bit fields (element
// 128h + 32j + l is field j of qs[32h + l]); every 16 elements have a scale. Q2_K: 4-bit scales and
// mins; Q3_K: bit 4h + j of hmask[l] is the third bit, the zero point is 4 and the 6-bit scales
// are offset by 32.
template <bool kThreeBit>
struct K2Format {
  using Block = std::conditional_t<kThreeBit, BlockQ3_K, BlockQ2_K>;
  static constexpr bool kZeroPoint = kThreeBit, kHasMin = !kThreeBit, kSigned = false;
  FERRUM_AVX2_INLINE static void pack(const Block& b, PackedSuperBlock& p, int r) {
    int8_t sc[16];
    if constexpr (kThreeBit) {
      for (int s = 0; s < 16; ++s) sc[s] = int8_t(q3k_scale(b.scales, s) - 32);
      const __m256i scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)));
      p.bsum_terms[r] = _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_slli_epi16(scales16, 2));
    } else {
      const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b.scales));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(sc), _mm_and_si128(packed, _mm_set1_epi8(15)));
      p.bsum_terms[r] = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(packed, 4), _mm_set1_epi8(15)));
      p.dmin[r] = h2f(b.dmin);
    }
    const __m256i low2 = _mm256_set1_epi8(3), ones8 = _mm256_set1_epi8(1);
    __m256i hmask;
    if constexpr (kThreeBit) hmask = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.hmask));
    for (int h = 0; h < 2; ++h) {
      const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qs + 32 * h));
      for (int j = 0; j < 4; ++j) {
        __m256i q = _mm256_and_si256(_mm256_srli_epi16(qs, 2 * j), low2);
        if constexpr (kThreeBit)
          q = _mm256_or_si256(q, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hmask, 4 * h + j), ones8), 2));
        p.quants[r][4 * h + j] = q;
        const int s = 8 * h + 2 * j;
        p.scales[r][4 * h + j] = half_scales(sc[s], sc[s + 1]);
      }
    }
    p.d[r] = h2f(b.d);
  }
};

// IQ4_XS: sub-block c (32 elements, IQ4_NL's nibble layout at qs + 16c) has a 6-bit scale less 32.
struct IQ4_XSFormat {
  using Block = BlockIQ4_XS;
  static constexpr bool kZeroPoint = false, kHasMin = false, kSigned = true;
  FERRUM_AVX2_INLINE static void pack(const Block& b, PackedSuperBlock& p, int r) {
    for (int c = 0; c < kChunks; ++c) {
      p.quants[r][c] = iq4_levels(b.qs + 16 * c);
      p.scales[r][c] = _mm256_set1_epi16(short(iq4xs_scale(b, c)));
    }
    p.d[r] = h2f(b.d);
  }
};

// One output's float accumulators, the row kernel's: 8 lanes, and 8 for the min terms.
struct Accumulators {
  __m256 acc[kRows], acc_min[kRows];
};

// One super-block step of the 4 packed rows' accumulators against activation super-block y.
template <class F>
FERRUM_AVX2_INLINE void super_block_step(const PackedSuperBlock& p, const BlockQ8_K& y, bool first, Accumulators& a) {
  const __m256i bsums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y.bsums));
  __m256i isum[kRows];
  for (int r = 0; r < kRows; ++r)
    isum[r] = F::kZeroPoint ? _mm256_madd_epi16(bsums, p.bsum_terms[r]) : _mm256_setzero_si256();
  for (int c = 0; c < kChunks; ++c) {
    const __m256i q8 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y.qs + 32 * c));
    for (int r = 0; r < kRows; ++r) {
      const __m256i pairs = F::kSigned ? signed_pairs(p.quants[r][c], q8) : _mm256_maddubs_epi16(p.quants[r][c], q8);
      isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(pairs, p.scales[r][c]));
    }
  }
  const __m256 zero = _mm256_setzero_ps();
  for (int r = 0; r < kRows; ++r) {
    a.acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_set1_ps(p.d[r] * y.d), first ? zero : a.acc[r]);
    if constexpr (F::kHasMin)
      a.acc_min[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(bsums, p.bsum_terms[r])),
                                     _mm256_set1_ps(p.dmin[r] * y.d), first ? zero : a.acc_min[r]);
  }
}

// out[t * ldo + r] = dot(weight row r, activation row t): weight rows 4 at a time; for each of
// their super-blocks, packed once, every activation row's step of its accumulators.
template <class F>
FERRUM_AVX2 void gemm(int64_t n, const void* w, size_t w_row_bytes, int64_t rows, const void* act, size_t act_row_bytes,
                      int64_t T, float* out, int64_t ldo) {
  using Block = typename F::Block;
  const int64_t nb = n / kQKK;
  thread_local PackedSuperBlock packed;
  thread_local std::vector<Accumulators> accs;  // [T]
  accs.resize(size_t(T));
  for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
    const int live = int(std::min<int64_t>(kRows, rows - r0));
    const Block* x[kRows];  // rows past `live` repeat the last one (computed, not stored)
    for (int r = 0; r < kRows; ++r)
      x[r] = reinterpret_cast<const Block*>(static_cast<const char*>(w) + size_t(r0 + std::min(r, live - 1)) * w_row_bytes);
    for (int64_t sb = 0; sb < nb; ++sb) {
      for (int r = 0; r < kRows; ++r) F::pack(x[r][sb], packed, r);
      for (int64_t t = 0; t < T; ++t) {
        const BlockQ8_K& y = reinterpret_cast<const BlockQ8_K*>(static_cast<const char*>(act) + t * act_row_bytes)[sb];
        super_block_step<F>(packed, y, sb == 0, accs[size_t(t)]);
      }
    }
    for (int64_t t = 0; t < T; ++t) {
      const Accumulators& a = accs[size_t(t)];
      for (int r = 0; r < live; ++r)
        out[t * ldo + r0 + r] = hsum(F::kHasMin ? _mm256_sub_ps(a.acc[r], a.acc_min[r]) : a.acc[r]);
    }
  }
}

// ---- the row kernels: one weight row at a time, unpacked straight into registers ----
//
// A decode reads each weight super-block once, for one activation row: unpacking it into the
// GEMM's buffer would cost more than the products.

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

// IQ4_XS: signed levels against signed activations (signed_pairs).
FERRUM_AVX2 float dot_iq4_xs(int64_t n, const void* w, const void* act) {
  const BlockIQ4_XS* x = static_cast<const BlockIQ4_XS*>(w);
  const BlockQ8_K* y = static_cast<const BlockQ8_K*>(act);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < n / kQKK; ++i) {
    __m256i isum = _mm256_setzero_si256();
    for (int s = 0; s < 8; ++s) {
      const __m256i pairs = signed_pairs(iq4_levels(x[i].qs + 16 * s), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y[i].qs + 32 * s)));
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


template <class F, float (*DotRow)(int64_t, const void*, const void*)>
Avx2Kernels kernels_of() {
  return {for_each_row<DotRow>, gemm<F>};
}

}  // namespace

Avx2Kernels avx2_q8_k_kernels(DType t) {
  switch (t) {
    case DType::Q2_K: return kernels_of<K2Format<false>, dot_k2<false>>();
    case DType::Q3_K: return kernels_of<K2Format<true>, dot_k2<true>>();
    case DType::Q4_K: return kernels_of<K4Format<BlockQ4_K, false>, dot_k4<false, BlockQ4_K>>();
    case DType::Q5_K: return kernels_of<K4Format<BlockQ5_K, true>, dot_k4<true, BlockQ5_K>>();
    case DType::Q6_K: return kernels_of<Q6Format, dot_q6_k>();
    case DType::IQ4_XS: return kernels_of<IQ4_XSFormat, dot_iq4_xs>();
    default: return {nullptr, nullptr};
  }
}

}  // namespace ferrum::quant::detail
