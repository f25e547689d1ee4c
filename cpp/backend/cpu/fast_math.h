// Branch-free float math for the CPU kernels' inner loops, on scalars and on 16-float vectors
// (GCC/Clang vector extensions: one AVX-512 register, or two AVX2 ones, without intrinsics).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif

// Inline helpers only: the vector-argument ABI note GCC prints without AVX-512 does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace ferrum::cpu {

typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));

// Internal linkage: a file compiled for AVX-512 (attention's AVX-512 copy) and baseline files
// each keep their own copies, never one for both (docs/install.md).
namespace {

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store16(float* p, f32x16 v) { std::memcpy(p, &v, sizeof v); }

inline f32x16 splat(float x) {
#if defined(__AVX512F__)
  return f32x16(_mm512_set1_ps(x));
#elif defined(__AVX2__)
  union {
    __m256 h[2];
    f32x16 v;
  } u;
  u.h[0] = u.h[1] = _mm256_set1_ps(x);
  return u.v;
#else
  return f32x16{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
#endif
}

// v, held in a register. Without this GCC folds the load of a vector used by several FMAs into
// each of them as a memory operand; on Zen 4 a 512-bit load takes all of a cycle's load
// bandwidth, so the FMAs wait on the loads.
// (Only where 16 floats fit one register: AVX-512.)
inline f32x16 in_register(f32x16 v) {
#if defined(__AVX512F__) && (defined(__GNUC__) || defined(__clang__))
  asm("" : "+v"(v));
#endif
  return v;
}

// a * b + c, rounded once. The compiler contracts `x * y + z` into an FMA or not depending on
// how it unrolled the code around it; a kernel whose results must not depend on its unrolling
// (attention's per-row float order, whatever rows share a call) spells its FMAs out.
inline f32x16 fmadd(f32x16 a, f32x16 b, f32x16 c) {
#if defined(__AVX512F__)
  return f32x16(_mm512_fmadd_ps(__m512(a), __m512(b), __m512(c)));
#elif defined(__FMA__)
  union U {
    f32x16 v;
    __m256 h[2];
  };
  const U x{a}, y{b}, z{c};
  U r;
  r.h[0] = _mm256_fmadd_ps(x.h[0], y.h[0], z.h[0]);
  r.h[1] = _mm256_fmadd_ps(x.h[1], y.h[1], z.h[1]);
  return r.v;
#else
  f32x16 r;
  for (int i = 0; i < 16; ++i) r[i] = std::fma(a[i], b[i], c[i]);
  return r;
#endif
}

// Lane-wise comparisons (all bits set where true), selection and max. Without AVX-512, GCC
// turns a 16-lane comparison or ?: into scalar code, so AVX2 builds spell them out on two
// 256-bit halves; the results are the expressions' (a > b ? a : b is max_ps(a, b), NaN included).
#if !defined(__AVX512F__) && defined(__AVX2__)
union Halves {  // (GCC keeps a union's members in registers; its vector shuffles it does not)
  f32x16 v;
  __m256 h[2];
};
inline __m256 low_half(f32x16 v) { return Halves{v}.h[0]; }
inline __m256 high_half(f32x16 v) { return Halves{v}.h[1]; }
inline f32x16 join(__m256 lo, __m256 hi) {
  Halves u;
  u.h[0] = lo, u.h[1] = hi;
  return u.v;
}
template <int kPredicate>
inline i32x16 compare(f32x16 a, f32x16 b) {
  return i32x16(join(_mm256_cmp_ps(low_half(a), low_half(b), kPredicate),
                     _mm256_cmp_ps(high_half(a), high_half(b), kPredicate)));
}
inline i32x16 lanes_lt(f32x16 a, f32x16 b) { return compare<_CMP_LT_OQ>(a, b); }
inline i32x16 lanes_ge(f32x16 a, f32x16 b) { return compare<_CMP_GE_OQ>(a, b); }
inline f32x16 lanes_max(f32x16 a, f32x16 b) {
  return join(_mm256_max_ps(low_half(a), low_half(b)), _mm256_max_ps(high_half(a), high_half(b)));
}
inline f32x16 select(i32x16 mask, f32x16 a, f32x16 b) {
  return f32x16((i32x16(a) & mask) | (i32x16(b) & ~mask));
}
inline i32x16 truncate_to_i32(f32x16 v) {
  return i32x16(join(_mm256_castsi256_ps(_mm256_cvttps_epi32(low_half(v))),
                     _mm256_castsi256_ps(_mm256_cvttps_epi32(high_half(v)))));
}
#else
inline i32x16 lanes_lt(f32x16 a, f32x16 b) { return a < b; }
inline i32x16 lanes_ge(f32x16 a, f32x16 b) { return a >= b; }
inline f32x16 lanes_max(f32x16 a, f32x16 b) { return a > b ? a : b; }
inline f32x16 select(i32x16 mask, f32x16 a, f32x16 b) { return mask ? a : b; }
inline i32x16 truncate_to_i32(f32x16 v) { return __builtin_convertvector(v, i32x16); }
#endif

// The sum of v's lanes in the order of _mm512_reduce_add_ps (halves, quarters, then
// (v0 + v2) + (v1 + v3)), whatever the ISA: the AVX-512 and baseline copies of a kernel agree.
inline float hsum(f32x16 v) {
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  return (v[0] + v[2]) + (v[1] + v[3]);
}

inline float hmax(f32x16 v) {
  v = lanes_max(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  v = lanes_max(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  return std::max(std::max(v[0], v[2]), std::max(v[1], v[3]));
}

namespace detail {
// exp(r) on [-ln2/2, ln2/2]: degree-7 Taylor polynomial, relative error < 1e-8 there.
template <class V>
inline V exp_poly(V r) {
  V p = r * (1.0f / 5040.0f) + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  return p * r + 1.0f;
}
constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding and subtracting rounds to an integer
constexpr float kLog2e = 1.44269504f, kLn2Hi = 0.693145751953125f, kLn2Lo = 1.428606765330187e-06f;
}  // namespace detail

// exp(x) = 2^n * exp(x - n ln2), relative error below 1e-7. Inputs are clamped to [-87, 88]:
// below, it returns ~1.6e-38 instead of 0, far under what a softmax or SiLU can resolve;
// exp(0) is exactly 1.
inline float fast_exp(float x) {
  using namespace detail;
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float n = (x * kLog2e + kRound) - kRound;
  const float p = exp_poly((x - n * kLn2Hi) - n * kLn2Lo);
  const int32_t bits = (int32_t(n) + 127) << 23;  // 2^n
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

inline f32x16 fast_exp(f32x16 x) {
  using namespace detail;
  const f32x16 lowest = splat(-87.0f), highest = splat(88.0f);
  x = select(lanes_lt(x, lowest), lowest, select(lanes_lt(highest, x), highest, x));
  const f32x16 n = (x * kLog2e + kRound) - kRound;
  const f32x16 p = exp_poly((x - n * kLn2Hi) - n * kLn2Lo);
  const i32x16 bits = (truncate_to_i32(n) + 127) << 23;
  f32x16 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

}  // namespace
}  // namespace ferrum::cpu
