// Internal: what the AVX2 kernel files (dot_avx2.cpp, gemm_legacy_avx2.cpp,
// gemm_kquant_avx2.cpp, dot_r16_avx2.cpp, dot_r16_kquant_avx2.cpp) share. Only those files include it: CMake builds them without AVX-512
// (-mno-avx512f in a native build), so they stay what AVX2-only CPUs can run.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "quant/formats.h"
#include "quant/kernels.h"

#define FERRUM_AVX2 __attribute__((target("avx2,fma,f16c")))
// For helpers called in kernel loops: an out-of-line call there spills every vector register.
#define FERRUM_AVX2_INLINE __attribute__((target("avx2,fma,f16c"), always_inline)) inline

namespace ferrum::quant::detail {

FERRUM_AVX2_INLINE static float h2f(uint16_t h) { return _cvtsh_ss(h); }

// A running integer sum, kept in its register at this step. GCC otherwise reorders a chain of
// integer vector adds across a fully unrolled loop, deferring them until every product is
// computed: the products stay live, spill to the stack, and the loads and stores then bound
// the kernel rather than its multiplies. Integer sums are exact in any order: no result changes.
FERRUM_AVX2_INLINE static void keep_in_register(__m256i& sum) { asm("" : "+x"(sum)); }

// The sum of 8 float lanes, in the one order the AVX2 float and k-quant kernels share.
FERRUM_AVX2_INLINE static float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The sums of the 8 int32 lanes of v0 .. v3: one per weight row of the kernels that run four
// rows at once, one per lane.
FERRUM_AVX2_INLINE static __m128i lane_sums(__m256i v0, __m256i v1, __m256i v2, __m256i v3) {
  const __m256i s = _mm256_hadd_epi32(_mm256_hadd_epi32(v0, v1), _mm256_hadd_epi32(v2, v3));
  return _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
}

// 16 bytes of 4-bit indices -> 32 bytes: element j (low nibble of byte j) then j + 16 (high).
FERRUM_AVX2_INLINE static __m256i unpack_nibbles(const uint8_t* qs) {
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(x, 4), x), _mm256_set1_epi8(15));
}

// 16 bytes of IQ4 nibbles -> their 32 signed levels (kIq4Values), in element order.
FERRUM_AVX2_INLINE static __m256i iq4_levels(const uint8_t* qs) {
  const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4Values));
  const __m256i table2 = _mm256_set_m128i(table, table);
  return _mm256_shuffle_epi8(table2, unpack_nibbles(qs));
}

// 16 int16 sums of adjacent w * a products, w signed: maddubs(|w|, a * sign(w)). Both are
// within +-127 (the activation quantizers never give -128), so no pair saturates.
FERRUM_AVX2_INLINE static __m256i signed_pairs(__m256i w, __m256i a) {
  return _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w));
}

// The R16 kernels (dot_r16_avx2.cpp, dot_r16_kquant_avx2.cpp): a 16-row group's block is two
// 8-row halves, and quant dword k of a half loads as one register, one row per 32-bit lane.
constexpr int kHalfRows = 8;

FERRUM_AVX2_INLINE static __m256i broadcast_dword(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

FERRUM_AVX2_INLINE static __m256i load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// [p, p + bytes) into L1, a cache line at a time.
FERRUM_AVX2_INLINE static void prefetch_l1(const uint8_t* p, size_t bytes) {
  for (size_t o = 0; o < bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p + o), _MM_HINT_T0);
}

// The R16 GEMMs' register blocks, group by group of 16 weight rows of w: four activation rows at
// a time take one half, two or one take both halves (a decode reads the group's bytes in address
// order). pass(N, V, group, next, r0, live, h, t) computes rows [t, t + N) against halves
// h .. h + V - 1 of the group at row r0 (N and V as std::integral_constant); `next` is the
// following group in a group's first pass, for the pass to prefetch as it reads (left to the
// hardware prefetchers, one thread read DRAM-resident weights at a third of a plain read's pace
// on a Zen 5), else null.
template <class Pass>
inline void r16_register_blocks(const void* w, size_t w_row_bytes, int64_t rows, int64_t T, const Pass& pass) {
  using Four = std::integral_constant<int, 4>;
  using Two = std::integral_constant<int, 2>;
  using One = std::integral_constant<int, 1>;
  constexpr int64_t kGroupRows = 2 * kHalfRows;
  for (int64_t r0 = 0; r0 < rows; r0 += kGroupRows) {
    const int live = int(std::min<int64_t>(kGroupRows, rows - r0));
    const uint8_t* group = static_cast<const uint8_t*>(w) + r0 * w_row_bytes;
    const uint8_t* next = r0 + kGroupRows < rows ? group + kGroupRows * w_row_bytes : nullptr;
    const auto run = [&](auto n, auto v, int h, int64_t t) {
      pass(n, v, group, next, r0, live, h, t);
      next = nullptr;  // prefetched by the first pass
    };
    int64_t t = 0;
    for (; t + 4 <= T; t += 4)
      for (int h = 0; h < 2 && kHalfRows * h < live; ++h) run(Four{}, One{}, h, t);
    for (; t + 2 <= T; t += 2) run(Two{}, Two{}, 0, t);
    for (; t < T; ++t) run(One{}, Two{}, 0, t);
  }
}

// sum[j][v]: activation row j against half h0 + v of a group (live rows of it: `live`), to
// out[j * ldo + row in the group]; a partial half stores its live lanes only.
template <int N, int V>
FERRUM_AVX2_INLINE static void store_halves(const __m256 (&sum)[N][V], int h0, int live, float* out, int64_t ldo) {
  for (int v = 0; v < V; ++v) {
    const int first = kHalfRows * (h0 + v), count = std::min(kHalfRows, live - first);
    if (count <= 0) continue;
    for (int j = 0; j < N; ++j) {
      float* dst = out + j * ldo + first;
      if (count == kHalfRows) {
        _mm256_storeu_ps(dst, sum[j][v]);
      } else {
        alignas(32) float lanes[kHalfRows];
        _mm256_store_ps(lanes, sum[j][v]);
        std::copy(lanes, lanes + count, dst);
      }
    }
  }
}

// A GEMM and its single-activation-row case as a row kernel.
template <DotBatchFn kGemm>
FERRUM_AVX2 void dot_rows_by_gemm(int64_t n, const void* w, size_t w_row_bytes, int64_t rows, const void* act,
                                  float* out) {
  kGemm(n, w, w_row_bytes, rows, act, 0, 1, out, 0);
}
template <DotBatchFn kGemm>
Avx2Kernels kernels_from_gemm() {
  return {dot_rows_by_gemm<kGemm>, kGemm};
}

// Per activation row and block of Q8_0 activations, what the legacy types' float chain needs
// besides the products: d_a, and where `with_sums` sum(a) (the min formats' term, or the zero
// point's: -zero * sum(a)).
struct LegacyActTerms {
  std::vector<float> d;      // [T][nb]
  std::vector<int32_t> sum;  // [T][nb]
};

FERRUM_AVX2_INLINE static void prepare_legacy_acts(int64_t nb, const void* act, size_t act_row_bytes, int64_t T,
                                                   bool with_sums, LegacyActTerms& acts) {
  acts.d.resize(size_t(T * nb));
  acts.sum.resize(size_t(T * nb));
  for (int64_t t = 0; t < T; ++t) {
    const BlockQ8_0* y = reinterpret_cast<const BlockQ8_0*>(static_cast<const char*>(act) + t * act_row_bytes);
    for (int64_t i = 0; i < nb; ++i) {
      const size_t k = size_t(t * nb + i);
      acts.d[k] = h2f(y[i].d);
      if (with_sums) {
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y[i].qs));
        const __m256i sa = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), a), _mm256_set1_epi16(1));
        acts.sum[k] = _mm_cvtsi128_si32(lane_sums(sa, sa, sa, sa));
      }
    }
  }
}

}  // namespace ferrum::quant::detail
