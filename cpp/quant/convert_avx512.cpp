// AVX-512 conversions between f32 and the 16-bit float formats, bit for bit those of the scalar
// reference (core/dtype.cpp): f16 weights are dequantized a tile at a time for prefill, and the
// bf16 GEMM's activations are rounded to bf16 once per matmul, both hot enough that the scalar
// per-element loops show in a prompt's time.
#include <immintrin.h>

#include "quant/kernels.h"

// GCC 12 reports the intrinsics' deliberately undefined upper lanes as uninitialized.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#define FERRUM_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,f16c")))

namespace ferrum::quant::detail {

// vcvtph2ps is exact (subnormals included); it only differs from the reference on signaling
// NaNs, which it quiets.
FERRUM_AVX512 void avx512_f16_to_f32(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
  if (i < n) {
    const __mmask16 m = __mmask16((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(dst + i, m, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, src + i)));
  }
}

// Round to nearest even by integer arithmetic, NaNs quieted, as f32_to_bf16 does. (vcvtneps2bf16
// would flush subnormals to zero.)
FERRUM_AVX512 inline __m256i to_bf16(__m512i u) {
  const __m512i one = _mm512_set1_epi32(1);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(64));
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, quiet));
}

FERRUM_AVX512 void avx512_f32_to_bf16(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), to_bf16(_mm512_castps_si512(_mm512_loadu_ps(src + i))));
  if (i < n) {
    const __mmask16 m = __mmask16((1u << (n - i)) - 1);
    _mm256_mask_storeu_epi16(dst + i, m, to_bf16(_mm512_castps_si512(_mm512_maskz_loadu_ps(m, src + i))));
  }
}

}  // namespace ferrum::quant::detail
