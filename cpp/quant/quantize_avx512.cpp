// AVX-512 Q8_0 quantizer: the same bytes as the reference quant_q8 in quantize.cpp. Decode
// quantizes every matmul's activation row to Q8_0, where the reference's per-element roundf
// shows in a small model's time per token.
#include <immintrin.h>

#include <cstring>

#include "core/dtype.h"
#include "quant/formats.h"
#include "quant/kernels.h"

// GCC 12 reports the intrinsics' deliberately undefined upper lanes as uninitialized.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace ferrum::quant::detail {

namespace {
#define FERRUM_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))

// roundf(v): round half away from zero. v - trunc(v) is exact, so ties are found exactly.
FERRUM_AVX512 inline __m512i round_half_away(__m512 v) {
  const __m512 t = _mm512_roundscale_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
  const __m512 frac = _mm512_abs_ps(_mm512_sub_ps(v, t));
  const __mmask16 up = _mm512_cmp_ps_mask(frac, _mm512_set1_ps(0.5f), _CMP_GE_OQ);
  const __m512 one = _mm512_or_ps(_mm512_set1_ps(1.0f), _mm512_and_ps(v, _mm512_set1_ps(-0.0f)));
  return _mm512_cvttps_epi32(_mm512_mask_add_ps(t, up, t, one));
}
}  // namespace

FERRUM_AVX512 void avx512_quantize_q8_0(const float* x, void* dst, int64_t nb) {
  BlockQ8_0* y = static_cast<BlockQ8_0*>(dst);
  for (int64_t i = 0; i < nb; ++i, x += kQK) {
    const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const float d = amax / 127;
    const float id = d != 0 ? 1.0f / d : 0.0f;
    const __m512 s = _mm512_set1_ps(id);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y[i].qs), _mm512_cvtepi32_epi8(round_half_away(_mm512_mul_ps(a, s))));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y[i].qs + 16),
                     _mm512_cvtepi32_epi8(round_half_away(_mm512_mul_ps(b, s))));
    y[i].d = f32_to_f16(d);
  }
}

// Q8_K (the k-quants' activations: prefill quantizes every matmul's input rows to it) in the
// reference's steps: max = the first element of largest magnitude, iscale = -127 / max,
// q = min(127, nearbyint(iscale * x)) (cvtps_epi32 rounds to nearest even, as nearbyint does in
// the default rounding mode), bsums, d = 1 / iscale.
FERRUM_AVX512 void avx512_quantize_q8_k(const float* x, void* dst, int64_t nb) {
  BlockQ8_K* y = static_cast<BlockQ8_K*>(dst);
  for (int64_t i = 0; i < nb; ++i, x += kQKK) {
    __m512 v[16], amax = _mm512_setzero_ps();
    for (int k = 0; k < 16; ++k) {
      v[k] = _mm512_loadu_ps(x + 16 * k);
      amax = _mm512_max_ps(amax, _mm512_abs_ps(v[k]));
    }
    const float abs_max = _mm512_reduce_max_ps(amax);
    if (abs_max == 0) {
      std::memset(&y[i], 0, sizeof(BlockQ8_K));
      continue;
    }
    float max = 0;
    for (int k = 0; k < 16; ++k) {
      const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_abs_ps(v[k]), _mm512_set1_ps(abs_max), _CMP_EQ_OQ);
      if (hit) {
        max = x[16 * k + __builtin_ctz(hit)];
        break;
      }
    }
    const float iscale = -127.f / max;
    for (int k = 0; k < 16; ++k) {
      const __m512i q = _mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v[k], _mm512_set1_ps(iscale))),
                                         _mm512_set1_epi32(127));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(y[i].qs + 16 * k), _mm512_cvtepi32_epi8(q));
      y[i].bsums[k] = int16_t(_mm512_reduce_add_epi32(q));
    }
    y[i].d = 1 / iscale;
  }
}

}  // namespace ferrum::quant::detail
