// GEMMs for float weights, many activation rows (prefill), on AVX-512:
//   - BF16 weights x BF16 activations on vdpbf16ps (AVX512_BF16): 32 multiply-adds per
//     instruction, twice an f32 FMA's 16.
//   - F16 / F32 weights x F32 activations: f16 is converted to f32 (vcvtph2ps) when a tile is
//     packed, then f32 FMAs. Same arithmetic class as (dequantize +) sgemm, f32 products and
//     sums, but no dequantized tile in memory and no per-call packing of the activations, which
//     OpenBLAS's sgemm does.
//
// Weight rows go across the lanes, kRows at a time, packed once per tile so that one register
// holds one step of 16 rows (BF16: the element pair 2p, 2p + 1; else element k); the activation
// row's step (one 32-bit word: a bf16 pair or an f32) is broadcast against it. Each packed
// register then serves kActs activation rows and no horizontal sum is needed. Every output has
// one accumulator that takes the steps in order, so a row's result does not depend on T or its
// place in the register blocks.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "quant/avx512_common.h"
#include "quant/kernels.h"

// One target for both kernels, which share their code: the F16 one needs no AVX512_BF16 (the
// compiler emits BF16 instructions only for the intrinsics) but is only offered with it, so no
// CPU ever runs code compiled for more than it has.
#define FERRUM_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,f16c,avx512bf16")))

namespace ferrum::quant::detail {

namespace {

// 32-row x 8-activation register blocks (16 accumulators): the fastest of the shapes tried
// (docs/performance.md), and 32 divides each thread's share of the usual widths.
constexpr int kVecs = 2;           // 16-row weight registers per tile
constexpr int kRows = 16 * kVecs;  // weight rows per tile
constexpr int kActs = 8;           // activation rows per register block


// Per weight type: kElems elements per 32-bit step, kChunkBytes bytes per 16 steps; load16 gives
// the 16 steps (a chunk) at p as 32-bit words; step gives step s of a row alone (the tail); fma accumulates one step. The
// activations come in the same steps (bf16 pairs, or f32).
struct Bf16 {  // a step is an element pair; an odd n's last pair is padded with a zero
  static constexpr int kElems = 2, kChunkBytes = 64;
  FERRUM_AVX512_BF16 static __m512i load16(const char* p) { return _mm512_loadu_si512(p); }
  static uint32_t step(const char* row, int64_t s, int64_t n) {
    uint16_t e[2] = {0, 0};
    std::memcpy(e, row + 4 * s, 2 * s + 1 < n ? 4 : 2);
    return e[0] | uint32_t(e[1]) << 16;
  }
  FERRUM_AVX512_BF16 static __m512 fma(__m512 acc, __m512i x, __m512i w) {
    return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)w);
  }
};

struct F16 {  // a step is one element, converted to f32
  static constexpr int kElems = 1, kChunkBytes = 32;
  FERRUM_AVX512_BF16 static __m512i load16(const char* p) {
    return _mm512_castps_si512(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
  }
  FERRUM_AVX512_BF16 static uint32_t step(const char* row, int64_t s, int64_t) {
    uint16_t h;
    std::memcpy(&h, row + 2 * s, 2);
    const float f = _cvtsh_ss(h);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
  }
  FERRUM_AVX512_BF16 static __m512 fma(__m512 acc, __m512i x, __m512i w) {
    return _mm512_fmadd_ps(_mm512_castsi512_ps(x), _mm512_castsi512_ps(w), acc);
  }
};

struct F32 {  // a step is one element
  static constexpr int kElems = 1, kChunkBytes = 64;
  FERRUM_AVX512_BF16 static __m512i load16(const char* p) { return _mm512_loadu_si512(p); }
  static uint32_t step(const char* row, int64_t s, int64_t) {
    uint32_t u;
    std::memcpy(&u, row + 4 * s, 4);
    return u;
  }
  FERRUM_AVX512_BF16 static __m512 fma(__m512 acc, __m512i x, __m512i w) { return F16::fma(acc, x, w); }
};

// Where chunk c (steps 16c .. 16c + 15) of row r0 + i starts (r0: a group start in the R16
// layouts, whose 64-byte blocks hold 1 or 2 chunks of a row, 16 rows' blocks together).
template <class W, bool kR16>
FERRUM_AVX512_BF16 const char* chunk_at(const char* w, size_t w_row_bytes, int64_t r0, int i, int64_t c) {
  if constexpr (!kR16) return w + (r0 + i) * w_row_bytes + c * W::kChunkBytes;
  const int64_t at = c * W::kChunkBytes;
  return w + r0 * w_row_bytes + (at / 64) * 16 * 64 + i * 64 + at % 64;
}

// Packs `rows` (<= kRows) weight rows: packed[s * kVecs + v], lane i = step s of row 16v + i.
// Rows past the end are zero. (In the R16 layout n is whole blocks, so there is no tail.)
template <class W, bool kR16>
FERRUM_AVX512_BF16 void pack_tile(const char* w, size_t w_row_bytes, int64_t rows, int64_t n, std::vector<__m512i>& packed) {
  const int64_t steps = (n + W::kElems - 1) / W::kElems, full = n / (16 * W::kElems);  // full: whole chunks
  packed.resize(size_t(steps * kVecs));
  for (int v = 0; v < kVecs; ++v) {
    const int64_t r0 = 16 * v, nr = std::clamp<int64_t>(rows - r0, 0, 16);
    __m512i r[16];
    for (int64_t c = 0; c < full; ++c) {
      for (int i = 0; i < 16; ++i)
        r[i] = i < nr ? W::load16(chunk_at<W, kR16>(w, w_row_bytes, r0, i, c)) : _mm512_setzero_si512();
      transpose16x16(r);
      for (int j = 0; j < 16; ++j) packed[size_t((16 * c + j) * kVecs + v)] = r[j];
    }
    for (int64_t s = 16 * full; s < steps; ++s) {  // the tail, a step at a time
      alignas(64) uint32_t lane[16] = {};
      for (int64_t i = 0; i < nr; ++i) lane[i] = W::step(w + (r0 + i) * w_row_bytes, s, n);
      packed[size_t(s * kVecs + v)] = _mm512_load_si512(lane);
    }
  }
}

// kA activation rows (row stride act_row_bytes) against a packed tile.
template <class W, int kA>
FERRUM_AVX512_BF16 void gemm_block(int64_t n, const __m512i* packed, const char* act, size_t act_row_bytes, float* out,
                              int64_t ldo, int64_t rows) {
  __m512 acc[kA][kVecs];
  for (auto& a : acc)
    for (auto& v : a) v = _mm512_setzero_ps();
  const char* a[kA];
  for (int j = 0; j < kA; ++j) a[j] = act + j * act_row_bytes;
  const int64_t whole = n / W::kElems;
  for (int64_t s = 0; s < whole; ++s) {
    const __m512i* w = packed + s * kVecs;
    for (int j = 0; j < kA; ++j) {
      int32_t step;  // memcpy: an odd n leaves bf16 rows 2-byte aligned
      std::memcpy(&step, a[j] + 4 * s, 4);
      const __m512i x = _mm512_set1_epi32(step);
      for (int v = 0; v < kVecs; ++v) acc[j][v] = W::fma(acc[j][v], x, w[v]);
    }
  }
  if (whole * W::kElems < n) {  // bf16, odd n: the last element alone (zero-padded on both sides)
    const __m512i* w = packed + whole * kVecs;
    for (int j = 0; j < kA; ++j) {
      uint16_t last;
      std::memcpy(&last, a[j] + 2 * (n - 1), 2);
      const __m512i x = _mm512_set1_epi32(last);
      for (int v = 0; v < kVecs; ++v) acc[j][v] = W::fma(acc[j][v], x, w[v]);
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
template <class W, int kA>
FERRUM_AVX512_BF16 void gemm_tail(int64_t left, int64_t n, const __m512i* packed, const char* act, size_t act_row_bytes,
                             float* out, int64_t ldo, int64_t rows) {
  if constexpr (kA > 0) {
    if (left == kA) gemm_block<W, kA>(n, packed, act, act_row_bytes, out, ldo, rows);
    else gemm_tail<W, kA - 1>(left, n, packed, act, act_row_bytes, out, ldo, rows);
  }
}

template <class W, bool kR16>
FERRUM_AVX512_BF16 void gemm(int64_t n, const void* w, size_t w_row_bytes, int64_t rows, const void* act,
                        size_t act_row_bytes, int64_t T, float* out, int64_t ldo) {
  thread_local std::vector<__m512i> packed;
  const char* a = static_cast<const char*>(act);
  const int64_t blocks = (T + kActs - 1) / kActs;
  for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
    const int64_t tile_rows = std::min<int64_t>(kRows, rows - r0);
    const char* tile = static_cast<const char*>(w) + r0 * w_row_bytes;
    pack_tile<W, kR16>(tile, w_row_bytes, tile_rows, n, packed);
    // The weights come from memory once per call: the next tile's rows (one contiguous span)
    // are prefetched into L2 a share per activation block, so packing them does not stall.
    const char* next = tile + tile_rows * w_row_bytes;
    const int64_t next_bytes = std::min<int64_t>(kRows, rows - r0 - tile_rows) * int64_t(w_row_bytes);
    const int64_t share = (next_bytes / blocks + 64) & ~int64_t(63);
    int64_t t = 0, fetched = 0;
    for (; t + kActs <= T; t += kActs) {
      for (const int64_t end = std::min(next_bytes, fetched + share); fetched < end; fetched += 64)
        _mm_prefetch(next + fetched, _MM_HINT_T1);
      gemm_block<W, kActs>(n, packed.data(), a + t * act_row_bytes, act_row_bytes, out + t * ldo + r0, ldo, tile_rows);
    }
    gemm_tail<W, kActs - 1>(T - t, n, packed.data(), a + t * act_row_bytes, act_row_bytes, out + t * ldo + r0, ldo,
                            tile_rows);
  }
}

}  // namespace

DotBatchFn avx512_float_gemm(DType weight_type, WeightLayout layout) {
  if (layout == WeightLayout::R16) {
    switch (weight_type) {
      case DType::BF16: return gemm<Bf16, true>;
      case DType::F16: return gemm<F16, true>;
      default: return nullptr;
    }
  }
  switch (weight_type) {
    case DType::BF16: return gemm<Bf16, false>;
    case DType::F16: return gemm<F16, false>;
    case DType::F32: return gemm<F32, false>;
    default: return nullptr;
  }
}

}  // namespace ferrum::quant::detail
