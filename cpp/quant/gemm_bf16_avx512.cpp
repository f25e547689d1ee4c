// BF16 weights x BF16 activations, many activation rows (prefill): a GEMM on vdpbf16ps
// (AVX512_BF16), which does 32 multiply-adds per instruction, twice an f32 FMA's 16.
//
// Weight rows go across the lanes, kRows at a time, packed once per tile so that one register
// holds the element pair (2p, 2p + 1) of 16 rows; the activation row's pair p (one 32-bit word
// of its bf16 row) is broadcast against it. Each packed register then serves kActs activation
// rows and no horizontal sum is needed. Every output has one accumulator that takes the pairs
// in order, so a row's result does not depend on T or its place in the register blocks.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "quant/kernels.h"

// GCC 12 reports the intrinsics' deliberately undefined upper lanes as uninitialized.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#define FERRUM_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

namespace ferrum::quant::detail {

namespace {

constexpr int kVecs = 2;           // 16-row weight registers per tile
constexpr int kRows = 16 * kVecs;  // weight rows per tile
constexpr int kActs = 8;           // activation rows per register block: kActs * kVecs accumulators

// 16 x 16 transpose of 32-bit words: out[j] = word j of each of r[0..15].
FERRUM_BF16 inline void transpose16(const __m512i r[16], __m512i out[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: words of rows 2i, 2i + 1 interleaved
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int g = 0; g < 4; ++g) {  // u[4g + j], lane L: word 4L + j of rows 4g .. 4g + 3
    u[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int j = 0; j < 4; ++j) {  // a 4 x 4 transpose of 128-bit lanes across u[j], u[4 + j], ...
    const __m512i v0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x44), v1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xee);
    const __m512i w0 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x44),
                  w1 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xee);
    out[j] = _mm512_shuffle_i32x4(v0, w0, 0x88);
    out[4 + j] = _mm512_shuffle_i32x4(v0, w0, 0xdd);
    out[8 + j] = _mm512_shuffle_i32x4(v1, w1, 0x88);
    out[12 + j] = _mm512_shuffle_i32x4(v1, w1, 0xdd);
  }
}

// Packs `rows` (<= kRows) weight rows: packed[p * kVecs + v], lane i = pair p of row 16v + i.
// Rows past the end, and the missing second element of an odd n, are zero.
FERRUM_BF16 void pack_tile(const char* w, size_t w_row_bytes, int64_t rows, int64_t n, std::vector<__m512i>& packed) {
  const int64_t pairs = (n + 1) / 2, full = n / 32;  // full: 16-pair chunks every row has
  packed.resize(size_t(pairs * kVecs));
  for (int v = 0; v < kVecs; ++v) {
    const int64_t r0 = 16 * v, nr = std::clamp<int64_t>(rows - r0, 0, 16);
    __m512i r[16], out[16];
    for (int64_t c = 0; c < full; ++c) {
      for (int i = 0; i < 16; ++i)
        r[i] = i < nr ? _mm512_loadu_si512(w + (r0 + i) * w_row_bytes + 64 * c) : _mm512_setzero_si512();
      transpose16(r, out);
      for (int j = 0; j < 16; ++j) packed[size_t((16 * c + j) * kVecs + v)] = out[j];
    }
    for (int64_t p = 16 * full; p < pairs; ++p) {  // the tail, a pair at a time
      alignas(64) uint32_t lane[16] = {};
      for (int64_t i = 0; i < nr; ++i) {
        uint16_t e[2] = {0, 0};
        std::memcpy(e, w + (r0 + i) * w_row_bytes + 4 * p, 2 * p + 1 < n ? 4 : 2);
        lane[i] = e[0] | uint32_t(e[1]) << 16;
      }
      packed[size_t(p * kVecs + v)] = _mm512_load_si512(lane);
    }
  }
}

// kA activation rows (bf16, row stride act_row_bytes) against a packed tile.
template <int kA>
FERRUM_BF16 void gemm_block(int64_t n, const __m512i* packed, const char* act, size_t act_row_bytes,
                            float* out, int64_t ldo, int64_t rows) {
  __m512 acc[kA][kVecs];
  for (auto& a : acc)
    for (auto& v : a) v = _mm512_setzero_ps();
  const char* a[kA];
  for (int j = 0; j < kA; ++j) a[j] = act + j * act_row_bytes;
  const int64_t pairs = n / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512i* w = packed + p * kVecs;
    for (int j = 0; j < kA; ++j) {
      int32_t pair;  // elements 2p, 2p + 1 (memcpy: an odd n leaves rows 2-byte aligned)
      std::memcpy(&pair, a[j] + 4 * p, 4);
      const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < kVecs; ++v) acc[j][v] = _mm512_dpbf16_ps(acc[j][v], x, (__m512bh)w[v]);
    }
  }
  if (n % 2) {  // odd n: the last element alone (its packed pair's second half is zero)
    const __m512i* w = packed + pairs * kVecs;
    for (int j = 0; j < kA; ++j) {
      uint16_t last;
      std::memcpy(&last, a[j] + 2 * (n - 1), 2);
      const __m512bh x = (__m512bh)_mm512_set1_epi32(last);
      for (int v = 0; v < kVecs; ++v) acc[j][v] = _mm512_dpbf16_ps(acc[j][v], x, (__m512bh)w[v]);
    }
  }
  for (int j = 0; j < kA; ++j)
    for (int v = 0; v < kVecs; ++v) {
      const int64_t left = rows - 16 * v;
      if (left <= 0) break;
      const __mmask16 m = left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
      _mm512_mask_storeu_ps(out + j * ldo + 16 * v, m, acc[j][v]);
    }
}

// The last `left` (< kActs) activation rows, in one block of that many.
template <int kA>
FERRUM_BF16 void gemm_tail(int64_t left, int64_t n, const __m512i* packed, const char* act, size_t act_row_bytes,
                           float* out, int64_t ldo, int64_t rows) {
  if constexpr (kA > 0) {
    if (left == kA) gemm_block<kA>(n, packed, act, act_row_bytes, out, ldo, rows);
    else gemm_tail<kA - 1>(left, n, packed, act, act_row_bytes, out, ldo, rows);
  }
}

FERRUM_BF16 void gemm_bf16(int64_t n, const void* w, size_t w_row_bytes, int64_t rows, const void* act,
                           size_t act_row_bytes, int64_t T, float* out, int64_t ldo) {
  thread_local std::vector<__m512i> packed;
  const char* a = static_cast<const char*>(act);
  for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
    const int64_t tile_rows = std::min<int64_t>(kRows, rows - r0);
    pack_tile(static_cast<const char*>(w) + r0 * w_row_bytes, w_row_bytes, tile_rows, n, packed);
    int64_t t = 0;
    for (; t + kActs <= T; t += kActs)
      gemm_block<kActs>(n, packed.data(), a + t * act_row_bytes, act_row_bytes, out + t * ldo + r0, ldo, tile_rows);
    gemm_tail<kActs - 1>(T - t, n, packed.data(), a + t * act_row_bytes, act_row_bytes, out + t * ldo + r0, ldo,
                         tile_rows);
  }
}

}  // namespace

DotBatchFn avx512_bf16_gemm() { return gemm_bf16; }

}  // namespace ferrum::quant::detail
