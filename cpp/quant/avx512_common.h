// Internal: what the AVX-512 + VNNI kernel files (dot_avx512.cpp, gemm_kquant_avx512.cpp) share.
// Their functions carry a target attribute rather than the file a -m flag, so the library still
// runs on CPUs without AVX-512 (dot_kernel.cpp only hands these kernels out when it is present).
#pragma once
#include <immintrin.h>

#include <cstdint>

// GCC 12 reports the intrinsics' deliberately undefined upper lanes as uninitialized.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#define FERRUM_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
// For helpers called in kernel loops: an out-of-line call there spills every vector register.
#define FERRUM_AVX512_INLINE \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"), always_inline)) inline

namespace ferrum::quant::detail {

FERRUM_AVX512_INLINE static float h2f(uint16_t h) { return _cvtsh_ss(h); }

}  // namespace ferrum::quant::detail
