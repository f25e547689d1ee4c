// AVX2 kernels for the legacy types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL) in the R16 layout
// (quant/repack.h; the k-quants' are in dot_r16_kquant_avx2.cpp): a 16-row group's block is two 8-row halves, and quant dword k of a half loads
// as one register holding bytes 4k..4k+3 of its 8 rows, one row per 32-bit lane. Against the
// activation's dword k broadcast, maddubs + madd leave each row's partial sum in its own lane: no
// horizontal sums, and the f16 scales of 8 rows convert in one instruction.
//
// The float chain is the scalar kernel's (dot_scalar.cpp): per block the exact integer sum, then
// sum = fma(d_w * d_a, float(isum), sum) (and fma(m_w * d_a, float(sum(a)), sum) in the min
// formats), block after block. So these give every other ISA's bits for these types, whatever
// the number of activation rows.
#include <algorithm>
#include <cstring>

#include "quant/avx2_common.h"
#include "quant/formats.h"
#include "quant/kernels.h"
#include "quant/repack.h"

namespace ferrum::quant::detail {

namespace {

// Each format: its block, its 16-bit fields (d, and m in the min formats), the zero point it
// takes off as kOffset * sum(a), and add_products: isum[j][v] = the exact sum of quant * a over
// one block, for activation rows j (their block's quants at a[j]) and the halves v of the pass
// (dword k of half v at q + 64k + 32v).

// What the kernels know of a 4- or 5-bit type: its fields and zero point.
template <class B, int kZero, bool kMin>
struct NibbleTraits {
  using Block = B;
  static constexpr int kFields = kMin ? 2 : 1, kOffset = kZero;
  static constexpr bool kHasMin = kMin;
};

// Q4_0 / Q4_1: 4 dwords of nibbles; dword k's low nibbles are elements 4k..4k+3, its high ones
// 16 + 4k... Products of 0..15 and +-127 stay within int16 over the whole block.
template <class B, int kZero, bool kMin>
struct Q4 : NibbleTraits<B, kZero, kMin> {
  template <int N, int V>
  FERRUM_AVX2_INLINE static void add_products(const uint8_t* q, const int8_t* const a[N], __m256i (&isum)[N][V]) {
    const __m256i low4 = _mm256_set1_epi8(15);
    __m256i acc[N][V];
    for (int j = 0; j < N; ++j)
      for (int v = 0; v < V; ++v) acc[j][v] = _mm256_setzero_si256();
    for (int k = 0; k < 4; ++k) {
      __m256i lo[V], hi[V];
      for (int v = 0; v < V; ++v) {
        const __m256i w = load(q + 64 * k + 32 * v);
        lo[v] = _mm256_and_si256(w, low4);
        hi[v] = _mm256_and_si256(_mm256_srli_epi16(w, 4), low4);
      }
      for (int j = 0; j < N; ++j) {
        const __m256i a_lo = broadcast_dword(a[j] + 4 * k), a_hi = broadcast_dword(a[j] + 16 + 4 * k);
        for (int v = 0; v < V; ++v) {
          acc[j][v] = _mm256_add_epi16(acc[j][v], _mm256_add_epi16(_mm256_maddubs_epi16(lo[v], a_lo),
                                                                    _mm256_maddubs_epi16(hi[v], a_hi)));
          keep_in_register(acc[j][v]);
        }
      }
    }
    const __m256i ones16 = _mm256_set1_epi16(1);
    for (int j = 0; j < N; ++j)
      for (int v = 0; v < V; ++v) isum[j][v] = _mm256_madd_epi16(acc[j][v], ones16);
  }
};

// Bytes i = 0..3 of each lane: 0x10 where bit 8b + s + i of the lane's qh is set (the fifth bit
// of the element that byte holds; b = the qh byte, s = 0 or 4).
FERRUM_AVX2_INLINE __m256i fifth_bits(__m256i qh, int b, int s) {
  const int spread = b * 0x01010101;
  const __m256i index = _mm256_setr_epi32(spread, spread + 0x04040404, spread + 0x08080808, spread + 0x0c0c0c0c,
                                          spread, spread + 0x04040404, spread + 0x08080808, spread + 0x0c0c0c0c);
  const __m256i bit = _mm256_set1_epi32(int(0x08040201u << s));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(qh, index), bit), bit);
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

// Q5_0 / Q5_1: dword 0 is qh (bit j: the fifth bit of element j), dwords 1..4 the nibbles as in
// Q4. Products of 0..31 stay within int16 over two dwords.
template <class B, int kZero, bool kMin>
struct Q5 : NibbleTraits<B, kZero, kMin> {
  template <int N, int V>
  FERRUM_AVX2_INLINE static void add_products(const uint8_t* q, const int8_t* const a[N], __m256i (&isum)[N][V]) {
    const __m256i low4 = _mm256_set1_epi8(15), ones16 = _mm256_set1_epi16(1);
    __m256i qh[V], acc[N][V];
    for (int v = 0; v < V; ++v) qh[v] = load(q + 32 * v);
    for (int j = 0; j < N; ++j)
      for (int v = 0; v < V; ++v) isum[j][v] = acc[j][v] = _mm256_setzero_si256();
    for (int k = 0; k < 4; ++k) {
      __m256i lo[V], hi[V];
      for (int v = 0; v < V; ++v) {
        const __m256i w = load(q + 64 * (k + 1) + 32 * v);
        lo[v] = _mm256_or_si256(_mm256_and_si256(w, low4), fifth_bits(qh[v], k / 2, 4 * (k % 2)));
        hi[v] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(w, 4), low4), fifth_bits(qh[v], 2 + k / 2, 4 * (k % 2)));
      }
      for (int j = 0; j < N; ++j) {
        const __m256i a_lo = broadcast_dword(a[j] + 4 * k), a_hi = broadcast_dword(a[j] + 16 + 4 * k);
        for (int v = 0; v < V; ++v) {
          acc[j][v] = _mm256_add_epi16(acc[j][v], _mm256_add_epi16(_mm256_maddubs_epi16(lo[v], a_lo),
                                                                    _mm256_maddubs_epi16(hi[v], a_hi)));
          keep_in_register(acc[j][v]);
        }
      }
      if (k % 2 == 1) {
        for (int j = 0; j < N; ++j)
          for (int v = 0; v < V; ++v) {
            isum[j][v] = _mm256_add_epi32(isum[j][v], _mm256_madd_epi16(acc[j][v], ones16));
            acc[j][v] = _mm256_setzero_si256();
          }
      }
    }
  }
};

// Signed quants (w) against signed activations: |w| * (a with w's sign), which maddubs takes.
template <int N, int V>
FERRUM_AVX2_INLINE void add_signed(const __m256i (&w)[V], const __m256i (&a)[N], __m256i (&isum)[N][V]) {
  const __m256i ones16 = _mm256_set1_epi16(1);
  for (int v = 0; v < V; ++v) {
    const __m256i magnitude = _mm256_sign_epi8(w[v], w[v]);
    for (int j = 0; j < N; ++j) {
      isum[j][v] = _mm256_add_epi32(
          isum[j][v], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(a[j], w[v])), ones16));
      keep_in_register(isum[j][v]);
    }
  }
}

// Q8_0: 8 dwords of int8 quants, stored + 128.
struct Q8 {
  using Block = BlockQ8_0;
  static constexpr int kFields = 1, kOffset = 0;
  static constexpr bool kHasMin = false;
  template <int N, int V>
  FERRUM_AVX2_INLINE static void add_products(const uint8_t* q, const int8_t* const a[N], __m256i (&isum)[N][V]) {
    const __m256i bias = _mm256_set1_epi8(char(0x80));
    for (int j = 0; j < N; ++j)
      for (int v = 0; v < V; ++v) isum[j][v] = _mm256_setzero_si256();
    for (int k = 0; k < 8; ++k) {
      __m256i w[V], act[N];
      for (int v = 0; v < V; ++v) w[v] = _mm256_xor_si256(load(q + 64 * k + 32 * v), bias);
      for (int j = 0; j < N; ++j) act[j] = broadcast_dword(a[j] + 4 * k);
      add_signed<N, V>(w, act, isum);
    }
  }
};

// IQ4_NL: Q4's nibbles index the signed levels kIq4Values.
struct IQ4NL {
  using Block = BlockIQ4_NL;
  static constexpr int kFields = 1, kOffset = 0;
  static constexpr bool kHasMin = false;
  template <int N, int V>
  FERRUM_AVX2_INLINE static void add_products(const uint8_t* q, const int8_t* const a[N], __m256i (&isum)[N][V]) {
    const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4Values));
    const __m256i levels = _mm256_set_m128i(table, table), low4 = _mm256_set1_epi8(15);
    for (int j = 0; j < N; ++j)
      for (int v = 0; v < V; ++v) isum[j][v] = _mm256_setzero_si256();
    for (int k = 0; k < 4; ++k) {
      __m256i lo[V], hi[V], a_lo[N], a_hi[N];
      for (int v = 0; v < V; ++v) {
        const __m256i w = load(q + 64 * k + 32 * v);
        lo[v] = _mm256_shuffle_epi8(levels, _mm256_and_si256(w, low4));
        hi[v] = _mm256_shuffle_epi8(levels, _mm256_and_si256(_mm256_srli_epi16(w, 4), low4));
      }
      for (int j = 0; j < N; ++j) {
        a_lo[j] = broadcast_dword(a[j] + 4 * k);
        a_hi[j] = broadcast_dword(a[j] + 16 + 4 * k);
      }
      add_signed<N, V>(lo, a_lo, isum);
      add_signed<N, V>(hi, a_hi, isum);
    }
  }
};

// Activation rows t0 .. t0 + N - 1 against halves h0 .. h0 + V - 1 of the group at `group`
// (live rows of it: `live`), over nb blocks; row r of the group's result to out[j * ldo + r].
// `next` (or null): the group to prefetch, block by block as this one's are read.
template <class F, int N, int V>
FERRUM_AVX2 void pass(int64_t nb, const uint8_t* group, int h0, int live, const void* act, size_t act_row_bytes,
                      const LegacyActTerms& acts, int64_t t0, float* out, int64_t ldo, const uint8_t* next) {
  constexpr size_t kChunk = kR16Rows * sizeof(typename F::Block);
  const BlockQ8_0* y[N];
  for (int j = 0; j < N; ++j)
    y[j] = reinterpret_cast<const BlockQ8_0*>(static_cast<const char*>(act) + (t0 + j) * act_row_bytes);
  __m256 sum[N][V];
  for (int j = 0; j < N; ++j)
    for (int v = 0; v < V; ++v) sum[j][v] = _mm256_setzero_ps();
  for (int64_t i = 0; i < nb; ++i) {
    const uint8_t* chunk = group + i * kChunk;
    if (next) prefetch_l1(next + i * kChunk, kChunk);
    const int8_t* a[N];
    for (int j = 0; j < N; ++j) a[j] = y[j][i].qs;
    __m256i isum[N][V];
    F::template add_products<N, V>(chunk + 32 * F::kFields + 32 * h0, a, isum);
    for (int v = 0; v < V; ++v) {
      const int field = 16 * (h0 + v);  // this half's 8 fields
      const __m256 d_w = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk + field)));
      __m256 m_w;
      if constexpr (F::kHasMin) m_w = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk + 32 + field)));
      for (int j = 0; j < N; ++j) {
        const size_t k = size_t((t0 + j) * nb + i);
        const __m256 d_a = _mm256_set1_ps(acts.d[k]);
        __m256i s = isum[j][v];
        if constexpr (F::kOffset != 0) s = _mm256_sub_epi32(s, _mm256_set1_epi32(F::kOffset * acts.sum[k]));
        sum[j][v] = _mm256_fmadd_ps(_mm256_mul_ps(d_w, d_a), _mm256_cvtepi32_ps(s), sum[j][v]);
        if constexpr (F::kHasMin)
          sum[j][v] = _mm256_fmadd_ps(_mm256_mul_ps(m_w, d_a), _mm256_set1_ps(float(acts.sum[k])), sum[j][v]);
      }
    }
  }
  store_halves<N, V>(sum, h0, live, out, ldo);
}

// out[t * ldo + r] = dot(weight row r, activation row t), group by group: one activation row
// (a decode) or two take both halves of a group at once, so its bytes are read in address order;
// four at a time take one half, the register block of a prompt's GEMM.
template <class F>
FERRUM_AVX2 void gemm(int64_t n, const void* w, size_t w_row_bytes, int64_t rows, const void* act,
                      size_t act_row_bytes, int64_t T, float* out, int64_t ldo) {
  const int64_t nb = n / kQK;
  thread_local LegacyActTerms acts;
  prepare_legacy_acts(nb, act, act_row_bytes, T, F::kOffset != 0 || F::kHasMin, acts);
  r16_register_blocks(w, w_row_bytes, rows, T,
                      [&](auto n, auto v, const uint8_t* group, const uint8_t* next, int64_t r0, int live, int h,
                          int64_t t) {
                        pass<F, decltype(n)::value, decltype(v)::value>(nb, group, h, live, act, act_row_bytes, acts,
                                                                        t, out + r0 + t * ldo, ldo, next);
                      });
}

template <class F>
Avx2Kernels kernels_of() {
  return kernels_from_gemm<gemm<F>>();
}

Avx2Kernels r16_kernels(DType t) {
  switch (t) {
    case DType::Q4_0: return kernels_of<Q4<BlockQ4_0, 8, false>>();
    case DType::Q4_1: return kernels_of<Q4<BlockQ4_1, 0, true>>();
    case DType::Q5_0: return kernels_of<Q5<BlockQ5_0, 16, false>>();
    case DType::Q5_1: return kernels_of<Q5<BlockQ5_1, 0, true>>();
    case DType::Q8_0: return kernels_of<Q8>();
    case DType::IQ4_NL: return kernels_of<IQ4NL>();
    default: return avx2_r16_kquant_kernels(t);
  }
}

}  // namespace

DotRowsFn avx2_r16_dot_rows(DType t) { return r16_kernels(t).dot_rows; }
DotBatchFn avx2_r16_gemm(DType t) { return r16_kernels(t).gemm; }

}  // namespace ferrum::quant::detail
