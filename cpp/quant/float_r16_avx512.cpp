// Decode row kernels over F16 / BF16 weights in the R16 layout (repack.h) against f32
// activations, on AVX-512 (VL: 32 registers of 256 bits).
//
// A group's block b holds 64 bytes of each of its 16 rows in address order, so one pass over the
// group reads the weights as one stream while each block's activations are loaded once for the 16
// rows (over the file layout they are loaded again for every row, and a short row's loads hold
// one thread below a plain read of the same bytes). Each row has one accumulator,
// which takes its blocks in order: a result depends on neither `rows` nor where a call starts.
#include <immintrin.h>

#include <algorithm>

#include "quant/kernels.h"
#include "quant/repack.h"

#define FERRUM_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,f16c")))

namespace ferrum::quant::detail {

namespace {

constexpr int kBlockBytes = 64;

// One type's 64-byte block of a row as kVecs vectors of 8 floats, and the block's activations
// (kElems floats at a) in the same lane order. 256-bit vectors: vcvtph2ps on 512 bits made the
// F16 kernel slower with the weights in L2.
struct F16Block {
  static constexpr int kElems = 32, kVecs = 4;
  FERRUM_AVX512 static void acts(const float* a, __m256 v[4]) {
    for (int k = 0; k < 4; ++k) v[k] = _mm256_loadu_ps(a + 8 * k);
  }
  FERRUM_AVX512 static void weights(const char* p, __m256 v[4]) {
    for (int k = 0; k < 4; ++k) v[k] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p) + k));
  }
};

// bf16 is the top half of an f32: a dword's low element shifted up, its high element masked,
// so each 16-element half of the block gives its even and its odd elements; the activations
// are split to match.
struct BF16Block {
  static constexpr int kElems = 32, kVecs = 4;
  FERRUM_AVX512 static void acts(const float* a, __m256 v[4]) {
    const __m256i even = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
    const __m256i odd = _mm256_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15);
    for (int h = 0; h < 2; ++h) {
      const __m256 lo = _mm256_loadu_ps(a + 16 * h), hi = _mm256_loadu_ps(a + 16 * h + 8);
      v[2 * h] = _mm256_permutex2var_ps(lo, even, hi);
      v[2 * h + 1] = _mm256_permutex2var_ps(lo, odd, hi);
    }
  }
  FERRUM_AVX512 static void weights(const char* p, __m256 v[4]) {
    for (int h = 0; h < 2; ++h) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p) + h);
      v[2 * h] = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
      v[2 * h + 1] = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(int(0xffff0000u))));
    }
  }
};

// Lane i of the result: the sum of v[i]'s 8 lanes.
FERRUM_AVX512 inline __m256 sum_lanes8(const __m256 v[8]) {
  const __m256 a = _mm256_hadd_ps(v[0], v[1]), b = _mm256_hadd_ps(v[2], v[3]);
  const __m256 c = _mm256_hadd_ps(v[4], v[5]), d = _mm256_hadd_ps(v[6], v[7]);
  const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);  // 128-bit lanes: rows 0-3 / 4-7
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

// `rows` rows from a group start; every group is whole in memory (the backend repacks only
// matrices of whole groups), so a partial last group is computed in full and stored in part.
template <class B>
FERRUM_AVX512 void dot_rows_float_r16(int64_t n, const void* w, size_t w_row_bytes, int64_t rows, const void* act,
                                      float* out) {
  const float* a = static_cast<const float*>(act);
  const int64_t blocks = n / B::kElems;
  const char* group = static_cast<const char*>(w);
  for (int64_t r = 0; r < rows; r += kR16Rows, group += kR16Rows * w_row_bytes) {
    __m256 acc[kR16Rows];
    for (__m256& v : acc) v = _mm256_setzero_ps();
    const char* p = group;
    for (int64_t b = 0; b < blocks; ++b, p += kR16Rows * kBlockBytes) {
      __m256 av[B::kVecs];
      B::acts(a + b * B::kElems, av);
#pragma GCC unroll 16
      for (int i = 0; i < kR16Rows; ++i) {
        __m256 wv[B::kVecs];
        B::weights(p + i * kBlockBytes, wv);
        for (int k = 0; k < B::kVecs; ++k) acc[i] = _mm256_fmadd_ps(wv[k], av[k], acc[i]);
      }
    }
    for (int h = 0; h < 2; ++h) {
      const int64_t left = std::clamp<int64_t>(rows - r - 8 * h, 0, 8);
      _mm256_mask_storeu_ps(out + r + 8 * h, __mmask8((1u << left) - 1), sum_lanes8(acc + 8 * h));
    }
  }
}

// ---- F16, several activation rows (a verify step, a batch of decodes) ----
//
// A group is taken a span of kSpanBlocks blocks at a time (all 16 rows: the weights are read in
// address order, and the span stays in L1 while it is used), and within a span R rows against TC
// activation rows at a time, their R x TC accumulators in registers (a weight vector converted
// once for TC FMAs, an activation vector loaded once for R rows) and in L1 between spans. Every
// accumulator takes its blocks and their vectors in the row kernel's order and is summed by the
// same tree (sum_lanes8), so a result equals dot_rows_float_r16's bit for bit, whatever T.

constexpr int kMaxActs = 8;            // activation rows at a time
constexpr int64_t kSpanBlocks = 4;     // 4 KB of a group
constexpr int64_t kPrefetchSpans = 2;  // how far ahead the weights are fetched, into L2 (faster than into L1)

// Rows at a time for TC activation rows: R x TC accumulators, TC activation vectors and a weight
// vector within the 32 registers.
constexpr int rows_at_a_time(int tc) { return tc <= 3 ? 8 : tc <= 6 ? 4 : 2; }

// Blocks [b0, b1) of R rows (from `rows`) against TC activation rows, adding to acc[r * kMaxActs + t].
template <int R, int TC>
FERRUM_AVX512 void f16_span(int64_t b0, int64_t b1, const char* rows, const float* const* acts, __m256* acc,
                            const char* prefetch, int prefetch_per_block) {
  __m256 c[R][TC];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int t = 0; t < TC; ++t) c[r][t] = acc[r * kMaxActs + t];
  const char* p = rows + b0 * kR16Rows * kBlockBytes;
  for (int64_t b = b0; b < b1; ++b, p += kR16Rows * kBlockBytes) {
    for (int l = 0; l < prefetch_per_block; ++l, prefetch += 64) _mm_prefetch(prefetch, _MM_HINT_T1);
#pragma GCC unroll 4
    for (int k = 0; k < F16Block::kVecs; ++k) {
      __m256 a[TC];
#pragma GCC unroll 8
      for (int t = 0; t < TC; ++t) {
        a[t] = _mm256_loadu_ps(acts[t] + b * F16Block::kElems + 8 * k);
        asm("" : "+v"(a[t]));  // one load for the R rows, not one folded into each FMA
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 w = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + r * kBlockBytes) + k));
#pragma GCC unroll 8
        for (int t = 0; t < TC; ++t) c[r][t] = _mm256_fmadd_ps(w, a[t], c[r][t]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int t = 0; t < TC; ++t) acc[r * kMaxActs + t] = c[r][t];
}

// One group against TC activation rows: acc[row * kMaxActs + t].
template <int TC>
FERRUM_AVX512 void f16_group(int64_t blocks, const char* group, const float* const* acts, __m256* acc) {
  constexpr int R = rows_at_a_time(TC);
  for (int i = 0; i < kR16Rows * kMaxActs; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b0 = 0; b0 < blocks; b0 += kSpanBlocks) {
    const int64_t b1 = std::min(blocks, b0 + kSpanBlocks);
    // R rows at a time read a span across its lines, which the hardware does not stream: the
    // span kPrefetchSpans ahead (the next group's where this one ends; groups are contiguous) is
    // fetched meanwhile, a share before each block.
    const char* ahead = group + (b1 + (kPrefetchSpans - 1) * kSpanBlocks) * kR16Rows * kBlockBytes;
    const int per_block = int((kSpanBlocks * R + (b1 - b0) - 1) / (b1 - b0));  // R lines a block, in a span's walk
    for (int i = 0; i < kR16Rows; i += R, ahead += kSpanBlocks * R * kBlockBytes)
      f16_span<R, TC>(b0, b1, group + i * kBlockBytes, acts, acc + i * kMaxActs, ahead, per_block);
  }
}

FERRUM_AVX512 void dot_batch_f16_r16(int64_t n, const void* w, size_t w_row_bytes, int64_t rows, const void* act,
                                     size_t act_row_bytes, int64_t T, float* out, int64_t ldo) {
  using GroupFn = void (*)(int64_t, const char*, const float* const*, __m256*);
  static constexpr GroupFn kGroup[kMaxActs + 1] = {nullptr, f16_group<1>, f16_group<2>, f16_group<3>, f16_group<4>,
                                                   f16_group<5>, f16_group<6>, f16_group<7>, f16_group<8>};
  const int64_t blocks = n / F16Block::kElems;
  const char* group = static_cast<const char*>(w);
  for (int64_t r = 0; r < rows; r += kR16Rows, group += kR16Rows * w_row_bytes) {
    for (int64_t t0 = 0; t0 < T; t0 += kMaxActs) {
      const int tc = int(std::min<int64_t>(kMaxActs, T - t0));
      const float* acts[kMaxActs];
      for (int t = 0; t < tc; ++t)
        acts[t] = reinterpret_cast<const float*>(static_cast<const char*>(act) + (t0 + t) * act_row_bytes);
      __m256 acc[kR16Rows * kMaxActs];
      kGroup[tc](blocks, group, acts, acc);
      for (int t = 0; t < tc; ++t)
        for (int h = 0; h < 2; ++h) {
          __m256 v[8];
          for (int i = 0; i < 8; ++i) v[i] = acc[(8 * h + i) * kMaxActs + t];
          const int64_t left = std::clamp<int64_t>(rows - r - 8 * h, 0, 8);
          _mm256_mask_storeu_ps(out + (t0 + t) * ldo + r + 8 * h, __mmask8((1u << left) - 1), sum_lanes8(v));
        }
    }
  }
}

}  // namespace

DotBatchFn avx512_float_r16_dot_batch(DType t) { return t == DType::F16 ? dot_batch_f16_r16 : nullptr; }

DotRowsFn avx512_float_r16_dot_rows(DType t) {
  switch (t) {
    case DType::F16: return dot_rows_float_r16<F16Block>;
    case DType::BF16: return dot_rows_float_r16<BF16Block>;
    default: return nullptr;
  }
}

}  // namespace ferrum::quant::detail
