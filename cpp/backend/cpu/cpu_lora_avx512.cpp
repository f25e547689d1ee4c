// The LoRA kernels on AVX-512 (lora_kernels.h), the AVX2 ones' floats on 16 lanes: the shrink
// runs two rank rows' 8-lane chains in the halves of one register, the expand a chunk's 16
// columns in one. 32 registers take 4 shrink rows (of 4 ranks) or 8 expand rows a call.
#include "backend/cpu/lora_kernels.h"
#include "quant/avx512_common.h"

namespace ferrum::cpu {

namespace {

constexpr int kShrinkRows = 4, kExpandRows = 8, kMaxRanks = 4;

// 8 elements of a matrix stored as kType at element i, as 8 bits-for-bits f32 lanes (16-bit
// ones in the low 128 bits of the result, before conversion).
template <DType kType>
FERRUM_AVX512_INLINE __m256i raw8(const uint8_t* p, int64_t i) {
  if constexpr (kType == DType::F32) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 4 * i));
  else return _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * i)));
}

// Elements i .. i + 7 of row a and j .. j + 7 of row b (stored as kType) in the low and high
// halves of one f32 register.
template <DType kType>
FERRUM_AVX512_INLINE __m512 pair8(const uint8_t* p, int64_t i, int64_t j) {
  if constexpr (kType == DType::F32) {
    return _mm512_castsi512_ps(_mm512_inserti64x4(_mm512_castsi256_si512(raw8<kType>(p, i)), raw8<kType>(p, j), 1));
  } else {
    const __m256i h = _mm256_inserti128_si256(raw8<kType>(p, i), _mm256_castsi256_si128(raw8<kType>(p, j)), 1);
    if constexpr (kType == DType::F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

template <DType kType>
FERRUM_AVX512_INLINE __m512 elements16(const uint8_t* p, int64_t i) {
  if constexpr (kType == DType::F32) return _mm512_loadu_ps(reinterpret_cast<const float*>(p) + i);
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2 * i));
  if constexpr (kType == DType::F16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

template <DType kType>
FERRUM_AVX512_INLINE float element(const uint8_t* p, int64_t i) {
  if constexpr (kType == DType::F32) return reinterpret_cast<const float*>(p)[i];
  const uint16_t h = *reinterpret_cast<const uint16_t*>(p + 2 * i);
  if constexpr (kType == DType::F16) return _cvtsh_ss(h);
  return _mm_cvtss_f32(_mm_castsi128_ps(_mm_cvtsi32_si128(int(uint32_t(h) << 16))));
}

// lora_kernels.h's lane sum of one 8-lane chain.
FERRUM_AVX512_INLINE float hsum8(__m256 v) {
  v = _mm256_add_ps(v, _mm256_permute2f128_ps(v, v, 1));
  v = _mm256_add_ps(v, _mm256_permute_ps(v, 0x4E));
  return _mm_cvtss_f32(_mm256_castps256_ps128(v)) + _mm_cvtss_f32(_mm_shuffle_ps(_mm256_castps256_ps128(v),
                                                                                _mm256_castps256_ps128(v), 1));
}

// Register p of row r holds rank 2p's chain in its low half and rank 2p + 1's (rank 2p's again
// when N is odd) in its high half.
template <DType kType, int R, int N>
FERRUM_AVX512 void shrink_rows(const float* const* x, const uint8_t* a, int64_t K, float* const* out) {
  constexpr int P = (N + 1) / 2;
  __m512 acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m512 v[R];
    for (int r = 0; r < R; ++r) {
      const __m512 h = _mm512_castps256_ps512(_mm256_loadu_ps(x[r] + k));
      v[r] = _mm512_shuffle_f32x4(h, h, 0x44);
    }
    for (int p = 0; p < P; ++p) {
      const int hi = 2 * p + 1 < N ? 2 * p + 1 : 2 * p;
      const __m512 w = pair8<kType>(a, 2 * p * K + k, hi * K + k);
      for (int r = 0; r < R; ++r) acc[r][p] = _mm512_fmadd_ps(v[r], w, acc[r][p]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < N; ++i) {
      const __m512 pair = acc[r][i / 2];
      float sum = hsum8(i % 2 ? _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(pair), 1))
                              : _mm512_castps512_ps256(pair));
      for (int64_t kk = k; kk < K; ++kk) sum = __builtin_fmaf(x[r][kk], element<kType>(a, i * K + kk), sum);
      out[r][i] = sum;
    }
}

template <DType kType, int R>
FERRUM_AVX512 void expand_chunk(const float* const* v, const uint8_t* b, int64_t rank, int64_t width, const float* scale,
                              float* const* out) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t j = 0; j < rank; ++j) {
    const __m512 w = elements16<kType>(b, j * 16);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(v[r][j]), w, acc[r]);
  }
  const __mmask16 live = __mmask16((1u << width) - 1);
  for (int r = 0; r < R; ++r) {
    const __m512 o = _mm512_maskz_loadu_ps(live, out[r]);
    _mm512_mask_storeu_ps(out[r], live, _mm512_fmadd_ps(_mm512_set1_ps(scale[r]), acc[r], o));
  }
}

template <DType kType, int R>
LoraShrinkFn shrink_of(int64_t n) {
  static constexpr LoraShrinkFn k[kMaxRanks] = {shrink_rows<kType, R, 1>, shrink_rows<kType, R, 2>,
                                                shrink_rows<kType, R, 3>, shrink_rows<kType, R, 4>};
  return k[n - 1];
}

template <int R>
LoraShrinkFn shrink_for(DType t, int64_t n) {
  return t == DType::F32 ? shrink_of<DType::F32, R>(n) : t == DType::F16 ? shrink_of<DType::F16, R>(n)
                                                                          : shrink_of<DType::BF16, R>(n);
}

LoraShrinkFn shrink(DType t, int rows, int64_t n) {
  return rows == 1 ? shrink_for<1>(t, n) : shrink_for<kShrinkRows>(t, n);
}

template <int R>
LoraExpandFn expand_for(DType t) {
  return t == DType::F32 ? expand_chunk<DType::F32, R> : t == DType::F16 ? expand_chunk<DType::F16, R>
                                                                          : expand_chunk<DType::BF16, R>;
}

LoraExpandFn expand(DType t, int rows) { return rows == 1 ? expand_for<1>(t) : expand_for<kExpandRows>(t); }

constexpr LoraKernels kKernels{kShrinkRows, kExpandRows, shrink, expand};

}  // namespace

const LoraKernels& lora_kernels_avx512() { return kKernels; }

}  // namespace ferrum::cpu
