// AVX2 kernels for the k-quants (Q2_K .. Q6_K) and IQ4_XS in the R16 layout (quant/repack.h),
// laid out as the legacy types' (dot_r16_avx2.cpp): quant dword k of a half-group is one register
// of 8 rows, one row per 32-bit lane, against the activation's dword broadcast, so maddubs leaves
// each row's products in its own lane and a super-block's scales of 8 rows come as one register.
//
// Per super-block and row the integer terms are exact, whatever their order inside a lane:
//   isum    = sum_s scale_s * (sum over sub-block s of (q - zero point) * a)
//   min_sum = sum_s min_s * (sum over sub-block s of a)           (Q2_K, Q4_K, Q5_K)
// (a zero point leaves as zero point * sum_s scale_s * bsum_s), and the float steps are the scalar
// kernels' (dot_scalar.cpp, kquant_step), super-block after super-block: sum = fma(float(isum),
// d * d_a, sum), then sum = fma(-float(min_sum), dmin * d_a, sum). So a row's result is every
// ISA's, whatever the number of activation rows.
#include <type_traits>

#include "quant/avx2_common.h"
#include "quant/formats.h"
#include "quant/kernels.h"
#include "quant/kquant_acts.h"
#include "quant/repack.h"

namespace ferrum::quant::detail {

namespace {

// pshufb indices: in each 32-bit lane, bytes b0..b3 of that lane (0x80: zero; the lane's offset
// added to it leaves bit 7 set).
FERRUM_AVX2_INLINE __m256i lane_bytes(int b0, int b1, int b2, int b3) {
  const __m256i lane = _mm256_setr_epi32(0, 0x04040404, 0x08080808, 0x0c0c0c0c, 0, 0x04040404, 0x08080808, 0x0c0c0c0c);
  return _mm256_add_epi32(lane, _mm256_set1_epi32(int(unsigned(b0) | unsigned(b1) << 8 | unsigned(b2) << 16 | unsigned(b3) << 24)));
}

// The int32 lanes sum[j][v] plus the products of acc16's int16 pairs with `scale`'s.
template <int N, int V>
FERRUM_AVX2_INLINE void add_scaled(__m256i (&sum)[N][V], __m256i (&acc16)[N][V], const __m256i (&scale)[V]) {
  for (int j = 0; j < N; ++j)
    for (int v = 0; v < V; ++v) {
      sum[j][v] = _mm256_add_epi32(sum[j][v], _mm256_madd_epi16(acc16[j][v], scale[v]));
      keep_in_register(sum[j][v]);
      acc16[j][v] = _mm256_setzero_si256();
    }
}

// acc16[j][v] += maddubs(w[v], activation dword at a[j]): the int16 pair sums of 4 elements.
template <int N, int V>
FERRUM_AVX2_INLINE void add_dword(__m256i (&acc16)[N][V], const __m256i (&w)[V], const int8_t* const a[N]) {
  for (int j = 0; j < N; ++j) {
    const __m256i act = broadcast_dword(a[j]);
    for (int v = 0; v < V; ++v) {
      acc16[j][v] = _mm256_add_epi16(acc16[j][v], _mm256_maddubs_epi16(w[v], act));
      keep_in_register(acc16[j][v]);
    }
  }
}

// Each format: its block, its 16-bit fields (d, and dmin in Q4_K / Q5_K), the sub-blocks whose
// activation sums prepare_kquant_acts pairs (terms[k]: sums 2k, 2k + 1 as int16 halves), and
// products: isum and min_sum of one super-block for activation rows j (quants at a[j], paired
// sums at terms[j]) and the halves v of the pass (dword k of half v at q + 64k + 32v).

// Q4_K / Q5_K: dwords 0..2 are the 12 packed scale bytes, Q5_K's qh follows (3..10), then qs:
// dword m of qs[32c..32c + 31] at kQs + 8c + m, its low nibbles elements 4m.. of sub-block 2c,
// its high ones those of 2c + 1 (Q5_K: their fifth bits are bit s of qh dword m's bytes).
// Unsigned quants: maddubs pairs within int16 over 8 dwords of 4 bits, 4 of 5 bits.
template <bool kFiveBit>
struct K4 {
  using Block = std::conditional_t<kFiveBit, BlockQ5_K, BlockQ4_K>;
  static constexpr int kFields = 2, kSubBlocks = 8;
  static constexpr bool kHasMin = true;
  static constexpr int kQs = kFiveBit ? 11 : 3;

  // Bytes j of each lane: scale (or min) 4p + j, as unpack_k4_scales: the low 6 bits of byte j
  // (min: 4 + j) for p = 0, else the nibble of byte 8 + j and the top 2 bits of byte j (4 + j).
  FERRUM_AVX2_INLINE static __m256i packed_6bit(const uint8_t* q, int v, bool min, int p) {
    const __m256i a0 = load(q + 32 * v), a1 = load(q + 64 + 32 * v), a2 = load(q + 128 + 32 * v);
    const __m256i low = min ? a1 : a0;
    if (p == 0) return _mm256_and_si256(low, _mm256_set1_epi8(63));
    const __m256i nibble = _mm256_and_si256(min ? _mm256_srli_epi32(a2, 4) : a2, _mm256_set1_epi8(15));
    return _mm256_or_si256(nibble, _mm256_and_si256(_mm256_srli_epi32(low, 2), _mm256_set1_epi8(0x30)));
  }

  template <int N, int V>
  FERRUM_AVX2_INLINE static void products(const uint8_t* q, const uint8_t*, const int8_t* const a[N],
                                          const int32_t* const terms[N], __m256i (&isum)[N][V], __m256i (&min_sum)[N][V]) {
    const __m256i low4 = _mm256_set1_epi8(15);
    __m256i acc16[N][V];
    for (int j = 0; j < N; ++j)
      for (int v = 0; v < V; ++v) isum[j][v] = acc16[j][v] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int s = 0; s < 8; ++s) {
      __m256i scale[V];  // scale s in both int16 halves of each lane
      for (int v = 0; v < V; ++v)
        scale[v] = _mm256_shuffle_epi8(packed_6bit(q, v, false, s / 4), lane_bytes(s % 4, 0x80, s % 4, 0x80));
#pragma GCC unroll 8
      for (int m = 0; m < 8; ++m) {
        __m256i w[V];
        for (int v = 0; v < V; ++v) {
          const __m256i packed = load(q + 64 * (kQs + 8 * (s / 2) + m) + 32 * v);
          w[v] = _mm256_and_si256(s % 2 ? _mm256_srli_epi16(packed, 4) : packed, low4);
          if constexpr (kFiveBit) {
            const __m256i qh = load(q + 64 * (3 + m) + 32 * v);
            const __m256i bit = s <= 4 ? _mm256_slli_epi32(qh, 4 - s) : _mm256_srli_epi32(qh, s - 4);
            w[v] = _mm256_or_si256(w[v], _mm256_and_si256(bit, _mm256_set1_epi8(16)));
          }
        }
        const int8_t* at[N];
        for (int j = 0; j < N; ++j) at[j] = a[j] + 32 * s + 4 * m;
        add_dword<N, V>(acc16, w, at);
        if (m == 7 || (kFiveBit && m == 3)) add_scaled<N, V>(isum, acc16, scale);
      }
    }
    // mins 2k, 2k + 1 as int16 halves, against the paired activation sums
    for (int v = 0; v < V; ++v) {
      __m256i pair[4];
      for (int k = 0; k < 4; ++k)
        pair[k] = _mm256_shuffle_epi8(packed_6bit(q, v, true, k / 2), lane_bytes(2 * (k % 2), 0x80, 2 * (k % 2) + 1, 0x80));
      for (int j = 0; j < N; ++j) {
        __m256i sum = _mm256_madd_epi16(pair[0], _mm256_set1_epi32(terms[j][0]));
        for (int k = 1; k < 4; ++k) sum = _mm256_add_epi32(sum, _mm256_madd_epi16(pair[k], _mm256_set1_epi32(terms[j][k])));
        min_sum[j][v] = sum;
      }
    }
  }
};

// The formats of 16 sub-blocks of 16 elements, unsigned quants (Q2_K, Q3_K, Q6_K): F gives group
// g (elements 4g..4g+3) of the 8 rows of half v, scale s in both int16 halves of each lane, and
// (Q2_K) min_pair(k): mins 2k, 2k + 1 as int16 halves. Against the paired bsums these give
// min_sum, or scales 2k, 2k + 1 the zero point's term (isum -= 2^kZeroShift * it). Sub-block s holds groups g = 32h + 8j + m,
// h = s / 8, j = s % 8 / 2, m = 4 (s % 2) + 0..3; F::kPerMadd dwords' maddubs pairs stay within
// int16 (2 * 63 * 127 each for 6 bits, 2 * 7 * 127 for 3).
template <class F>
struct Sixteen {
  template <int N, int V>
  FERRUM_AVX2_INLINE static void products(const uint8_t* q, const uint8_t*, const int8_t* const a[N],
                                          const int32_t* const terms[N], __m256i (&isum)[N][V], __m256i (&min_sum)[N][V]) {
    __m256i acc16[N][V];
    for (int j = 0; j < N; ++j)
      for (int v = 0; v < V; ++v) isum[j][v] = acc16[j][v] = _mm256_setzero_si256();
#pragma GCC unroll 16
    for (int s = 0; s < 16; ++s) {
      __m256i scale[V];
      for (int v = 0; v < V; ++v) scale[v] = F::scale16(q, s, v);
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        const int g = 32 * (s / 8) + 8 * (s % 8 / 2) + 4 * (s % 2) + i;
        __m256i w[V];
        for (int v = 0; v < V; ++v) w[v] = F::group(q, g, v);
        const int8_t* at[N];
        for (int j = 0; j < N; ++j) at[j] = a[j] + 4 * g;
        add_dword<N, V>(acc16, w, at);
        if (i % F::kPerMadd == F::kPerMadd - 1) add_scaled<N, V>(isum, acc16, scale);
      }
    }
    for (int j = 0; j < N; ++j)
      for (int v = 0; v < V; ++v) min_sum[j][v] = _mm256_setzero_si256();
    for (int v = 0; v < V; ++v)
      for (int k = 0; k < 8; ++k) {
        __m256i pair;
        if constexpr (F::kHasMin)
          pair = F::min_pair(q, k, v);
        else  // the zero points' terms take the scales again: unpacked again, not held in 16 registers
          pair = _mm256_blend_epi16(F::scale16(q, 2 * k, v), F::scale16(q, 2 * k + 1, v), 0xaa);
        for (int j = 0; j < N; ++j) {
          const __m256i term = _mm256_madd_epi16(pair, _mm256_set1_epi32(terms[j][k]));
          if constexpr (F::kHasMin)
            min_sum[j][v] = _mm256_add_epi32(min_sum[j][v], term);
          else
            isum[j][v] = _mm256_sub_epi32(isum[j][v], _mm256_slli_epi32(term, F::kZeroShift));
        }
      }
  }
};

// int32 lanes (within int16) in both int16 halves of each lane.
FERRUM_AVX2_INLINE __m256i both_halves(__m256i x) {
  return _mm256_or_si256(_mm256_and_si256(x, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(x, 16));
}

// v shifted right by `bits` (left where negative), per 32-bit lane.
FERRUM_AVX2_INLINE __m256i shift(__m256i v, int bits) {
  return bits >= 0 ? _mm256_srli_epi32(v, bits) : _mm256_slli_epi32(v, -bits);
}

// Q6_K: dwords k = 0..51 (ql 0..31, qh 32..47, the int8 scales 48..51) in slots kQ6KSlots[k].
// Group g = 32h + 8j + m takes its low 4 bits from the low (j < 2) or high nibbles of ql dword
// 16h + 8 (j % 2) + m and its top 2 from bits 2j, 2j + 1 of qh dword 32 + 8h + m; the -32 leaves
// as 32 * sum_s scale_s * bsum_s.
struct Q6 : Sixteen<Q6> {
  using Block = BlockQ6_K;
  static constexpr int kFields = 1, kSubBlocks = 16, kPerMadd = 2, kZeroShift = 5;
  static constexpr bool kHasMin = false;

  FERRUM_AVX2_INLINE static __m256i dword(const uint8_t* q, int k, int v) { return load(q + 64 * kQ6KSlots[size_t(k)] + 32 * v); }
  FERRUM_AVX2_INLINE static __m256i group(const uint8_t* q, int g, int v) {
    const int h = g / 32, j = g % 32 / 8, m = g % 8;
    const __m256i ql = dword(q, 16 * h + 8 * (j % 2) + m, v), qh = dword(q, 32 + 8 * h + m, v);
    const __m256i low = j < 2 ? ql : _mm256_srli_epi16(ql, 4);
    const __m256i high = j == 0 ? _mm256_slli_epi16(qh, 4) : j == 1 ? _mm256_slli_epi16(qh, 2) : j == 2 ? qh : _mm256_srli_epi16(qh, 2);
    return _mm256_or_si256(_mm256_and_si256(low, _mm256_set1_epi8(15)), _mm256_and_si256(high, _mm256_set1_epi8(0x30)));
  }
  // byte s % 4 of scale dword s / 4, sign-extended
  FERRUM_AVX2_INLINE static __m256i scale16(const uint8_t* q, int s, int v) {
    return _mm256_srai_epi16(_mm256_shuffle_epi8(dword(q, 48 + s / 4, v), lane_bytes(0x80, s % 4, 0x80, s % 4)), 8);
  }
};

// Q2_K / Q3_K: dwords Q2_K: the 16 scale bytes (k = 0..3, scale in the low nibble, min in the
// high one), qs (4..19); Q3_K: hmask (0..7), qs (8..23), the 12 packed 6-bit scales (24..26,
// q3k_scale, stored + 32). Group g = 32h + 8j + m is bits 2j, 2j + 1 of the bytes of qs dword
// 8h + m; Q3_K's third bit is bit 4h + j of the bytes of hmask dword m, and its zero point 4.
template <bool kThreeBit>
struct K2 : Sixteen<K2<kThreeBit>> {
  using Block = std::conditional_t<kThreeBit, BlockQ3_K, BlockQ2_K>;
  static constexpr int kFields = kThreeBit ? 1 : 2, kSubBlocks = 16, kPerMadd = 4, kZeroShift = 2;
  static constexpr bool kHasMin = !kThreeBit;
  static constexpr int kQs = kThreeBit ? 8 : 4;

  FERRUM_AVX2_INLINE static __m256i dword(const uint8_t* q, int k, int v) { return load(q + 64 * k + 32 * v); }
  FERRUM_AVX2_INLINE static __m256i group(const uint8_t* q, int g, int v) {
    const int h = g / 32, j = g % 32 / 8, m = g % 8;
    __m256i w = _mm256_and_si256(shift(dword(q, kQs + 8 * h + m, v), 2 * j), _mm256_set1_epi8(3));
    if constexpr (kThreeBit) w = _mm256_or_si256(w, _mm256_and_si256(shift(dword(q, m, v), 4 * h + j - 2), _mm256_set1_epi8(4)));
    return w;
  }
  // Scale s as int32 lanes (Q3_K: less 32).
  FERRUM_AVX2_INLINE static __m256i scale32(const uint8_t* q, int s, int v) {
    if constexpr (!kThreeBit) return _mm256_and_si256(shift(dword(q, s / 4, v), 8 * (s % 4)), _mm256_set1_epi32(15));
    const int b = s % 8;  // low 4 bits: nibble s / 8 of byte s % 8; top 2: bits 2 (s / 4) of byte 8 + s % 4
    const __m256i low = _mm256_and_si256(shift(dword(q, 24 + b / 4, v), 8 * (b % 4) + 4 * (s / 8)), _mm256_set1_epi32(15));
    const __m256i high = _mm256_and_si256(shift(dword(q, 26, v), 8 * (s % 4) + 2 * (s / 4) - 4), _mm256_set1_epi32(0x30));
    return _mm256_sub_epi32(_mm256_or_si256(low, high), _mm256_set1_epi32(32));
  }
  FERRUM_AVX2_INLINE static __m256i scale16(const uint8_t* q, int s, int v) { return both_halves(scale32(q, s, v)); }
  // Q2_K: mins 2k, 2k + 1 (the high nibbles of scale bytes 2k, 2k + 1).
  FERRUM_AVX2_INLINE static __m256i min_pair(const uint8_t* q, int k, int v) {
    const int b = 2 * k % 4;
    const __m256i x = dword(q, k / 2, v);
    return _mm256_or_si256(_mm256_and_si256(shift(x, 8 * b + 4), _mm256_set1_epi32(15)),
                           _mm256_and_si256(shift(x, 8 * b - 4), _mm256_set1_epi32(0xF0000)));
  }
};

// IQ4_XS: the fields d and scales_h (u16), then dwords scales_l (k = 0) and qs (1..32): group
// 8s + i of 32-element sub-block s is the low (i < 4) or high nibbles of qs dword 4s + i % 4,
// indices into the signed levels kIq4Values, dotted as |level| * (a with the level's sign)
// (signed_pairs' sums stay within int16) and scaled at once (madd against the scale).
struct XS {
  using Block = BlockIQ4_XS;
  static constexpr int kFields = 2, kSubBlocks = 8;
  static constexpr bool kHasMin = false;

  template <int N, int V>
  FERRUM_AVX2_INLINE static void products(const uint8_t* q, const uint8_t* fields, const int8_t* const a[N],
                                          const int32_t* const[N], __m256i (&isum)[N][V], __m256i (&)[N][V]) {
    const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4Values));
    const __m256i levels = _mm256_set_m128i(table, table), low4 = _mm256_set1_epi8(15);
    for (int j = 0; j < N; ++j)
      for (int v = 0; v < V; ++v) isum[j][v] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int s = 0; s < 8; ++s) {
      __m256i scale[V];  // (scale_s - 32) in both int16 halves
      for (int v = 0; v < V; ++v) {
        const __m256i scales_h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(fields + 32 + 16 * v)));
        const __m256i low = _mm256_and_si256(_mm256_srli_epi32(load(q + 32 * v), 8 * (s / 2) + 4 * (s % 2)), _mm256_set1_epi32(15));
        const __m256i high = _mm256_and_si256(_mm256_slli_epi32(_mm256_srli_epi32(scales_h, 2 * s), 4), _mm256_set1_epi32(0x30));
        scale[v] = both_halves(_mm256_sub_epi32(_mm256_or_si256(low, high), _mm256_set1_epi32(32)));
      }
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {
        __m256i w[V];
        for (int v = 0; v < V; ++v) {
          const __m256i packed = load(q + 64 * (1 + 4 * s + i % 4) + 32 * v);
          w[v] = _mm256_shuffle_epi8(levels, _mm256_and_si256(i < 4 ? packed : _mm256_srli_epi16(packed, 4), low4));
        }
        for (int j = 0; j < N; ++j) {
          const __m256i act = broadcast_dword(a[j] + 32 * s + 4 * i);
          for (int v = 0; v < V; ++v) {
            isum[j][v] = _mm256_add_epi32(isum[j][v], _mm256_madd_epi16(signed_pairs(w[v], act), scale[v]));
            keep_in_register(isum[j][v]);
          }
        }
      }
    }
  }
};

// Activation rows t0 .. t0 + N - 1 against halves h0 .. h0 + V - 1 of the group at `group`
// (live rows of it: `live`), over nb super-blocks; row r of the group's result to out[j * ldo + r].
// `next` (or null): the group to prefetch, super-block by super-block as this one's are read.
template <class F, int N, int V>
FERRUM_AVX2 void pass(int64_t nb, const uint8_t* group, int h0, int live, const KActs& acts, int64_t t0, float* out,
                      int64_t ldo, const uint8_t* next) {
  constexpr size_t kChunk = kR16Rows * sizeof(typename F::Block);
  __m256 sum[N][V];
  for (int j = 0; j < N; ++j)
    for (int v = 0; v < V; ++v) sum[j][v] = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < nb; ++sb) {
    const uint8_t* chunk = group + sb * kChunk;
    if (next) prefetch_l1(next + sb * kChunk, kChunk);
    const BlockQ8_K* y[N];
    const int8_t* a[N];
    const int32_t* terms[N];
    for (int j = 0; j < N; ++j) {
      y[j] = acts.rows[size_t(t0 + j)] + sb;
      a[j] = y[j]->qs;
      terms[j] = &acts.terms[size_t(((t0 + j) * nb + sb) * 16)];
    }
    __m256i isum[N][V], min_sum[N][V];
    F::template products<N, V>(chunk + 32 * F::kFields + 32 * h0, chunk + 16 * h0, a, terms, isum, min_sum);
    for (int v = 0; v < V; ++v) {
      const int field = 16 * (h0 + v);  // this half's 8 fields
      const __m256 d_w = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk + field)));
      __m256 dmin_w;
      if constexpr (F::kHasMin) dmin_w = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk + 32 + field)));
      for (int j = 0; j < N; ++j) {
        const __m256 d_a = _mm256_set1_ps(y[j]->d);
        sum[j][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[j][v]), _mm256_mul_ps(d_w, d_a), sum[j][v]);
        if constexpr (F::kHasMin)
          sum[j][v] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(min_sum[j][v]), _mm256_mul_ps(dmin_w, d_a), sum[j][v]);
      }
    }
  }
  store_halves<N, V>(sum, h0, live, out, ldo);
}

// out[t * ldo + r] = dot(weight row r, activation row t), group by group, as the legacy types'
// GEMM: one or two activation rows take both halves at once (the group's bytes in address
// order), four at a time one half.
template <class F>
FERRUM_AVX2 void gemm(int64_t n, const void* w, size_t w_row_bytes, int64_t rows, const void* act,
                      size_t act_row_bytes, int64_t T, float* out, int64_t ldo) {
  const int64_t nb = n / kQKK;
  thread_local KActs acts;
  prepare_kquant_acts<F::kSubBlocks, true, 0>(nb, act, act_row_bytes, T, acts);  // the paired sums
  r16_register_blocks(w, w_row_bytes, rows, T,
                      [&](auto n, auto v, const uint8_t* group, const uint8_t* next, int64_t r0, int live, int h,
                          int64_t t) {
                        pass<F, decltype(n)::value, decltype(v)::value>(nb, group, h, live, acts, t,
                                                                        out + r0 + t * ldo, ldo, next);
                      });
}

}  // namespace

Avx2Kernels avx2_r16_kquant_kernels(DType t) {
  switch (t) {
    case DType::Q4_K: return kernels_from_gemm<gemm<K4<false>>>();
    case DType::Q5_K: return kernels_from_gemm<gemm<K4<true>>>();
    case DType::Q6_K: return kernels_from_gemm<gemm<Q6>>();
    case DType::Q2_K: return kernels_from_gemm<gemm<K2<false>>>();
    case DType::Q3_K: return kernels_from_gemm<gemm<K2<true>>>();
    case DType::IQ4_XS: return kernels_from_gemm<gemm<XS>>();
    default: return {nullptr, nullptr};
  }
}

}  // namespace ferrum::quant::detail
