// The AVX2 + FMA + F16C kernel table: the float-weight row kernels here, the quantized types'
// row kernels and GEMMs in gemm_legacy_avx2.cpp (Q8_0 activations) and gemm_kquant_avx2.cpp
// (Q8_K activations). Every function carries the target attribute (and CMake builds these
// files with -mno-avx512f), so this is genuine AVX2 code that runs on AVX2-only CPUs.
#include "quant/avx2_common.h"
#include "quant/formats.h"
#include "quant/kernels.h"

namespace ferrum::quant::detail {

namespace {

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

}  // namespace

// The quantized types' kernels, from whichever file has them.
Avx2Kernels avx2_int8_kernels(DType t) {
  const Avx2Kernels q8_0 = avx2_q8_0_kernels(t);
  return q8_0.dot_rows ? q8_0 : avx2_q8_k_kernels(t);
}

DotRowsFn avx2_dot_rows(DType t) {
  switch (t) {
    case DType::F32: return for_each_row<dot_float<float, load8_f32, scalar_f32>>;
    case DType::F16: return for_each_row<dot_float<uint16_t, load8_f16, scalar_f16>>;
    case DType::BF16: return for_each_row<dot_float<uint16_t, load8_bf16, scalar_bf16>>;
    default: return avx2_int8_kernels(t).dot_rows;
  }
}

DotBatchFn avx2_gemm(DType t) { return avx2_int8_kernels(t).gemm; }

}  // namespace ferrum::quant::detail
