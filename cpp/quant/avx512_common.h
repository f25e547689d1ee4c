// Internal: what the AVX-512 kernel files (dot_avx512.cpp, gemm_kquant_avx512.cpp,
// gemm_float_avx512.cpp) share.
// Their functions carry a target attribute rather than the file a -m flag, so the library still
// runs on CPUs without AVX-512 (dot_kernel.cpp only hands these kernels out when it is present).
#pragma once
#include <immintrin.h>

#include <cstdint>

// GCC 12 reports the intrinsics' deliberately undefined upper lanes as uninitialized.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// std::vector<__m512i> (packed tiles): the alignment attribute is not part of the type.
#pragma GCC diagnostic ignored "-Wignored-attributes"

#define FERRUM_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
// For helpers called in kernel loops: an out-of-line call there spills every vector register.
#define FERRUM_AVX512_INLINE \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"), always_inline)) inline

namespace ferrum::quant::detail {

FERRUM_AVX512_INLINE static float h2f(uint16_t h) { return _cvtsh_ss(h); }

// 16 registers of 16 dwords transposed in place: dword c of r[i] goes to dword i of r[c].
// (AVX-512F only, so the BF16 kernels' target can inline it too.)
__attribute__((target("avx512f"), always_inline)) inline void transpose16x16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {  // per 128-bit lane: rows i, i + 1 interleaved
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // r[i + e], 128-bit lane L: dword 4L + e of rows i..i + 3
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int e = 0; e < 4; ++e) {  // 4 x 4 transpose of 128-bit lanes across r[e], r[4 + e], ...
    const __m512i u0 = _mm512_shuffle_i32x4(r[e], r[4 + e], 0x44), u1 = _mm512_shuffle_i32x4(r[e], r[4 + e], 0xee);
    const __m512i u2 = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0x44), u3 = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0xee);
    t[e] = _mm512_shuffle_i32x4(u0, u2, 0x88);
    t[4 + e] = _mm512_shuffle_i32x4(u0, u2, 0xdd);
    t[8 + e] = _mm512_shuffle_i32x4(u1, u3, 0x88);
    t[12 + e] = _mm512_shuffle_i32x4(u1, u3, 0xdd);
  }
  for (int j = 0; j < 16; ++j) r[j] = t[j];
}

}  // namespace ferrum::quant::detail
