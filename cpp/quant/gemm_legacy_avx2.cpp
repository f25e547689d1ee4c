// AVX2 kernels for the weight types dotted with Q8_0 activations (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
// IQ4_NL): one GEMM, whose single-activation-row case is also the row kernel.
//
// Every output takes the scalar kernel's float order (dot_scalar.cpp), which the AVX-512 kernels
// also take: per block, the exact integer sum, then one chain over the blocks of
// sum = fma(d_w * d_a, float(isum), sum), with sum = fma(m_w * d_a, float(sum(a)), sum) after it
// in the min formats. So every ISA gives the same bits, and a row's result depends neither on
// how many activation rows share the call nor on its place among them.
//
// Four weight rows run at once, one per float lane, sharing each activation block; up to four
// activation rows share each weight block's unpacking (the register block of the GEMM).
#include <algorithm>
#include <cstddef>
#include <cstring>

#include "quant/avx2_common.h"
#include "quant/formats.h"
#include "quant/kernels.h"

namespace ferrum::quant::detail {

namespace {

constexpr int kRows = 4;  // weight rows per pass, one per float lane
constexpr int kActs = 4;  // activation rows per register block

// 32 bits -> 32 bytes, 0x10 where bit j of `bits` is set (the fifth bit of element j).
FERRUM_AVX2_INLINE __m256i fifth_bits(const uint8_t* qh) {
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

// A format: its block, its 32 quants in element order (quants), and how they meet the
// activations. Unsigned formats (Q4_0 .. Q5_1): q in 0..31 times int8 activations by maddubs
// (pair sums within int16: 2 * 31 * 127); a symmetric format's zero point 1 << kZeroShift is
// removed as zero * sum(a); the min formats add m_w * d_a * sum(a).
template <class B, bool kFiveBit, bool kMin>
struct UnsignedFormat {
  using Block = B;
  static constexpr bool kSigned = false, kHasMin = kMin;
  static constexpr int kZeroShift = kMin ? 0 : kFiveBit ? 4 : 3;
  FERRUM_AVX2_INLINE static __m256i quants(const Block& b) {
    __m256i q = unpack_nibbles(b.qs);
    if constexpr (kFiveBit) q = _mm256_or_si256(q, fifth_bits(b.qh));
    return q;
  }
};

// Signed quants (Q8_0's int8, IQ4_NL's levels) meet the activations as signed_pairs.
struct Q8_0Format {
  using Block = BlockQ8_0;
  static constexpr bool kSigned = true, kHasMin = false;
  FERRUM_AVX2_INLINE static __m256i quants(const Block& b) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qs));
  }
};

struct IQ4_NLFormat {
  using Block = BlockIQ4_NL;
  static constexpr bool kSigned = true, kHasMin = false;
  FERRUM_AVX2_INLINE static __m256i quants(const Block& b) { return iq4_levels(b.qs); }
};

// The f16 fields at byte offset `at` of 4 blocks, as floats.
template <class Block>
FERRUM_AVX2_INLINE __m128 halves4(const Block* const b[kRows], size_t at) {
  uint16_t h[kRows];
  for (int r = 0; r < kRows; ++r) std::memcpy(&h[r], reinterpret_cast<const char*>(b[r]) + at, 2);
  return _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(h)));
}

// Activation rows t0 .. t0 + N - 1 against the 4 weight rows x over nb blocks; result j's lane r
// to out[j * ldo + r] for the first `live` rows.
template <class F, int N>
FERRUM_AVX2 void gemm_block(int64_t nb, const typename F::Block* const x[kRows], const BlockQ8_0* const y[N],
                            const LegacyActTerms& acts, int64_t t0, float* out, int64_t ldo, int live) {
  using Block = typename F::Block;
  const __m256i ones16 = _mm256_set1_epi16(1);
  __m128 sum[N];
  for (int j = 0; j < N; ++j) sum[j] = _mm_setzero_ps();
  for (int64_t i = 0; i < nb; ++i) {
    __m256i q[kRows];
    for (int r = 0; r < kRows; ++r) q[r] = F::quants(x[r][i]);
    const Block* blocks[kRows] = {&x[0][i], &x[1][i], &x[2][i], &x[3][i]};
    const __m128 d_w = halves4(blocks, offsetof(Block, d));
    __m128 m_w;
    if constexpr (F::kHasMin) m_w = halves4(blocks, offsetof(Block, m));
    for (int j = 0; j < N; ++j) {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y[j][i].qs));
      __m256i isum[kRows];
      for (int r = 0; r < kRows; ++r)
        isum[r] = _mm256_madd_epi16(F::kSigned ? signed_pairs(q[r], a) : _mm256_maddubs_epi16(q[r], a), ones16);
      const size_t k = size_t((t0 + j) * nb + i);
      __m128i block_sums = lane_sums(isum[0], isum[1], isum[2], isum[3]);
      if constexpr (!F::kSigned && !F::kHasMin)
        block_sums = _mm_add_epi32(block_sums, _mm_set1_epi32(-(1 << F::kZeroShift) * acts.sum[k]));
      const __m128 d_a = _mm_set1_ps(acts.d[k]);
      sum[j] = _mm_fmadd_ps(_mm_mul_ps(d_w, d_a), _mm_cvtepi32_ps(block_sums), sum[j]);
      if constexpr (F::kHasMin) sum[j] = _mm_fmadd_ps(_mm_mul_ps(m_w, d_a), _mm_set1_ps(float(acts.sum[k])), sum[j]);
    }
  }
  for (int j = 0; j < N; ++j) {
    alignas(16) float lanes[kRows];
    _mm_store_ps(lanes, sum[j]);
    for (int r = 0; r < live; ++r) out[j * ldo + r] = lanes[r];
  }
}

// out[t * ldo + r] = dot(weight row r, activation row t): weight rows 4 at a time, activation
// rows kActs at a time, then one by one.
template <class F>
FERRUM_AVX2 void gemm(int64_t n, const void* w, size_t w_row_bytes, int64_t rows, const void* act, size_t act_row_bytes,
                      int64_t T, float* out, int64_t ldo) {
  using Block = typename F::Block;
  const int64_t nb = n / kQK;
  thread_local LegacyActTerms acts;
  prepare_legacy_acts(nb, act, act_row_bytes, T, !F::kSigned, acts);
  const auto act_row = [&](int64_t t) {
    return reinterpret_cast<const BlockQ8_0*>(static_cast<const char*>(act) + t * act_row_bytes);
  };
  for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
    const int live = int(std::min<int64_t>(kRows, rows - r0));
    const Block* x[kRows];  // rows past `live` repeat the last one (computed, not stored)
    for (int r = 0; r < kRows; ++r)
      x[r] = reinterpret_cast<const Block*>(static_cast<const char*>(w) + size_t(r0 + std::min(r, live - 1)) * w_row_bytes);
    int64_t t = 0;
    for (; t + kActs <= T; t += kActs) {
      const BlockQ8_0* y[kActs];
      for (int j = 0; j < kActs; ++j) y[j] = act_row(t + j);
      gemm_block<F, kActs>(nb, x, y, acts, t, out + t * ldo + r0, ldo, live);
    }
    for (; t < T; ++t) {
      const BlockQ8_0* y[1] = {act_row(t)};
      gemm_block<F, 1>(nb, x, y, acts, t, out + t * ldo + r0, ldo, live);
    }
  }
}

// The row kernel is the GEMM for one activation row.
template <class F>
Avx2Kernels kernels_of() {
  return kernels_from_gemm<gemm<F>>();
}

}  // namespace

Avx2Kernels avx2_q8_0_kernels(DType t) {
  switch (t) {
    case DType::Q4_0: return kernels_of<UnsignedFormat<BlockQ4_0, false, false>>();
    case DType::Q4_1: return kernels_of<UnsignedFormat<BlockQ4_1, false, true>>();
    case DType::Q5_0: return kernels_of<UnsignedFormat<BlockQ5_0, true, false>>();
    case DType::Q5_1: return kernels_of<UnsignedFormat<BlockQ5_1, true, true>>();
    case DType::Q8_0: return kernels_of<Q8_0Format>();
    case DType::IQ4_NL: return kernels_of<IQ4_NLFormat>();
    default: return {nullptr, nullptr};
  }
}

}  // namespace ferrum::quant::detail
