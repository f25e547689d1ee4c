// Internal: the legacy formats' (Q4_0 .. Q8_0) int8 kernels against Q8_0 activations that the
// GGUF-layout kernels (dot_avx512.cpp) and the R16-layout ones (dot_r16_avx512.cpp) share: the
// activation preparation, the one float order, and the GEMM over 32-row tiles (whose tile walk,
// walk_tiles, and masked store, store_block, the k-quants' R16 GEMMs use too).
#pragma once
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "quant/avx512_common.h"
#include "quant/formats.h"

namespace ferrum::quant::detail {

// Every kernel below (the row kernel, the GEMM, whatever its T and a row's place in a tile)
// computes an output in one float order, so a sequence's results do not depend on its batch:
// per block b, the exact integer isum_b = sum(q * a) - zero * sum(a), then one chain over
// b = 0 .. nb - 1 of acc = fma(float(isum_b), d_w * d_a, acc), followed for the min formats by
// acc = fma(m_w, d_a * float(sum(a)), acc) (block_step). Integer sums are exact in any order, so
// the kernels are free to form them as suits their layout. Weight quants are kept unsigned (q,
// Q8_0: w + 128) for vpdpbusd against the signed activations; -zero * sum(a) removes the offset.

// Per activation row and block: what the float chain needs besides the weights.
struct LegacyActs {
  std::vector<const BlockQ8_0*> rows;
  std::vector<float> scales;     // d_a
  std::vector<int32_t> offsets;  // -zero * sum(a)
  std::vector<float> min_terms;  // d_a * sum(a) (min formats)
};

template <int kOffsetShift, bool kHasMin>
FERRUM_AVX512 void prepare_legacy_acts(int64_t nb, const void* act, size_t act_row_bytes, int64_t T,
                                       LegacyActs& acts) {
  const int32_t zero = kHasMin ? 0 : 1 << kOffsetShift;
  acts.rows.resize(size_t(T));
  acts.scales.resize(size_t(T * nb));
  acts.offsets.resize(size_t(T * nb));
  if (kHasMin) acts.min_terms.resize(size_t(T * nb));
  for (int64_t t = 0; t < T; ++t) {
    const BlockQ8_0* y = reinterpret_cast<const BlockQ8_0*>(static_cast<const char*>(act) + t * act_row_bytes);
    acts.rows[size_t(t)] = y;
    for (int64_t b = 0; b < nb; ++b) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y[b].qs));
      const __m256i lanes = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(1), q);
      const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(lanes), _mm256_extracti128_si256(lanes, 1));
      const __m128i s2 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
      const int32_t sum_a = _mm_cvtsi128_si32(s2) + _mm_extract_epi32(s2, 1);
      const size_t k = size_t(t * nb + b);
      acts.scales[k] = h2f(y[b].d);
      acts.offsets[k] = -zero * sum_a;
      if constexpr (kHasMin) acts.min_terms[k] = acts.scales[k] * float(sum_a);
    }
  }
}

// One block of the float chain for 16 outputs (one per lane).
template <bool kHasMin>
FERRUM_AVX512_INLINE __m512 block_step(__m512 acc, __m512i isum, __m512 d_w, __m512 m_w, float d_a,
                                       float min_term) {
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d_w, _mm512_set1_ps(d_a)), acc);
  if constexpr (kHasMin) acc = _mm512_fmadd_ps(m_w, _mm512_set1_ps(min_term), acc);
  return acc;
}

// Share i of n of [p, p + bytes), prefetched into L2. The kernels read 16 or 32 rows at once,
// and from DRAM the hardware prefetchers do not keep up with that many streams; prefetching the
// rows two groups ahead as one sequential stream, a share per step, restores a plain read's
// pace (one group ahead, or four, falls short of it).
// to_l1: into L1 instead (a k-quant row kernel, one group ahead: its weights then stream at
// 80-91% of a plain read on a Zen 5 against 72-78% into L2; the GEMMs gain nothing from it).
FERRUM_AVX512_INLINE void prefetch_share(const char* p, int64_t bytes, int64_t i, int64_t n, bool to_l1 = false) {
  const int64_t step = ((bytes + n - 1) / n + 63) & ~int64_t(63);
  for (int64_t o = i * step; o < std::min(bytes, (i + 1) * step); o += 64)
    to_l1 ? _mm_prefetch(p + o, _MM_HINT_T0) : _mm_prefetch(p + o, _MM_HINT_T2);
}

// A row kernel (T = 1) over 8-bit weights prefetches only short 16-row groups. With the weights
// on 2 MiB pages (cpu/weight_arena.h) the hardware prefetchers follow a long Q8_0 group on their
// own and software prefetches only add to the misses in flight, while short groups still gain
// from them. The 4- to 6-bit formats (under 7 bits a weight), more work per byte, gain at every
// group size (docs/performance.md).
FERRUM_AVX512_INLINE bool row_kernel_prefetches(int64_t row_bytes, int64_t n) {
  return 8 * row_bytes < 7 * n || 16 * row_bytes <= 12 * 1024;
}

// ---- the int8 GEMM ----
//
// Weight rows go across the lanes, kGemmRows at a time, as their unsigned quants in vpdpbusd's
// layout: for block b and 4-element group g, one register holds elements 4g..4g+3 of 16 rows
// (GGUF rows are packed into that form per tile, R16 weights are stored in it). An activation
// row's 4 bytes are broadcast against it, so each weight register serves kGemmActs activation
// rows and there is no horizontal sum. The k-quants' GEMMs use the same shape.

constexpr int kGemmVecs = 2;               // 16-row weight registers per tile
constexpr int kGemmRows = 16 * kGemmVecs;  // weight rows per tile
constexpr int kGemmActs = 4;               // activation rows per register block

// What a GEMM block call prefetches: share `share` + i of `shares` of [ahead, ahead + bytes) at
// its step i (a block, or a k-quant's sub-block: a few cache lines each).
struct Prefetch {
  const char* ahead;
  int64_t bytes, share, shares;
  bool to_l1 = false;
  FERRUM_AVX512_INLINE void at(int64_t b) const { prefetch_share(ahead, bytes, share + b, shares, to_l1); }
};
inline constexpr Prefetch kNoPrefetch{nullptr, 0, 0, 1};

// out[t * ldo + r] for T activation rows against `rows` weight rows of n elements at w, in
// tiles of kGemmRows rows (the tile walk of the int8 GEMMs): pack(r0, tile_rows) returns the
// source of rows r0 .. r0 + tile_rows (packed, or read in place), then block(acts_per_call,
// source, t, r0, tile_rows, prefetch) runs activation rows t .. t + acts_per_call - 1 against it,
// 4 (kGemmActs), then 2, then 1 at a time, in `steps` prefetch steps. Both layouts keep a tile's
// rows in one contiguous range, which is prefetched two tiles ahead, spread over the block steps
// of the tile before: issued all at once, most prefetches would be dropped (more than the outstanding
// misses a core tracks), and DRAM-resident weights would stream far below a plain read.
template <class PackFn, class BlockFn>
FERRUM_AVX512 void walk_tiles(const void* w, size_t w_row_bytes, int64_t steps, int64_t n, int64_t rows, int64_t T,
                              PackFn pack, BlockFn block) {
  constexpr int kActs = kGemmActs, kTileRows = kGemmRows;
  const char* base = static_cast<const char*>(w);
  const int64_t rb = int64_t(w_row_bytes);
  const int64_t calls = T / kActs + (T % kActs >= 2) + (T % 2);  // block calls per tile
  const bool prefetch = T > 1 || row_kernel_prefetches(rb, n);
  if (prefetch) prefetch_share(base, std::min<int64_t>(rows, 2 * kTileRows) * rb, 0, 1);
  for (int64_t r0 = 0; r0 < rows; r0 += kTileRows) {
    const int64_t tile_rows = std::min<int64_t>(kTileRows, rows - r0);
    const char* ahead = base + (r0 + 2 * kTileRows) * rb;
    const int64_t ahead_bytes = prefetch ? std::clamp<int64_t>(rows - r0 - 2 * kTileRows, 0, kTileRows) * rb : 0;
    const auto source = pack(r0, tile_rows);
    int64_t t = 0, call = 0;
    auto run = [&](auto acts_per_call) {
      block(acts_per_call, source, t, r0, tile_rows, Prefetch{ahead, ahead_bytes, call++ * steps, calls * steps});
      t += decltype(acts_per_call)::value;
    };
    while (t + kActs <= T) run(std::integral_constant<int, kActs>{});
    if (t + 2 <= T) run(std::integral_constant<int, 2>{});
    if (t < T) run(std::integral_constant<int, 1>{});
  }
}

// A block call's outputs: acc[j][v] to row t0 + j of out, columns 16v.., the first `rows` only.
template <int kActs, int kVecs = kGemmVecs>
FERRUM_AVX512_INLINE void store_block(const __m512 (&acc)[kActs][kVecs], float* out, int64_t t0, int64_t ldo,
                                      int64_t rows) {
  for (int j = 0; j < kActs; ++j)
    for (int v = 0; v < kVecs; ++v) {
      const int64_t left = rows - 16 * v;
      if (left <= 0) break;
      const __mmask16 m = left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
      _mm512_mask_storeu_ps(out + (t0 + j) * ldo + 16 * v, m, acc[j][v]);
    }
}

struct PackedTile {
  std::vector<__m512i> quants;  // [nb][8 groups][kGemmVecs]
  std::vector<float> scales;    // [nb][kGemmRows]
  std::vector<float> mins;      // [nb][kGemmRows] (min formats)
};

// A packed tile as gemm_block reads it: q(b, g, v) = group g (elements 4g..4g+3) of block b in
// 16-row vector v (rows 16v .. 16v + 15), d / m = that block's scales.
struct TileSource {
  const PackedTile& tile;
  FERRUM_AVX512_INLINE __m512i q(int64_t b, int g, int v) const { return tile.quants[size_t((b * 8 + g) * kGemmVecs + v)]; }
  FERRUM_AVX512_INLINE __m512 d(int64_t b, int v) const { return _mm512_loadu_ps(&tile.scales[size_t(b * kGemmRows + 16 * v)]); }
  FERRUM_AVX512_INLINE __m512 m(int64_t b, int v) const { return _mm512_loadu_ps(&tile.mins[size_t(b * kGemmRows + 16 * v)]); }
};

// kActs activation rows from t0 against the 16 * kVecs weight rows of src (a TileSource or the
// like: q(), d(), and m() for the min formats).
template <bool kHasMin, int kActs, class Source, int kVecs = kGemmVecs>
FERRUM_AVX512 void gemm_block(int64_t nb, const Source& src, const LegacyActs& acts, int64_t t0,
                              float* out, int64_t ldo, int64_t rows, const Prefetch& prefetch) {
  __m512 acc[kActs][kVecs];
  for (auto& a : acc)
    for (auto& v : a) v = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    prefetch.at(b);
    __m512i sum[kActs][kVecs];
    for (int j = 0; j < kActs; ++j)
      for (int v = 0; v < kVecs; ++v) sum[j][v] = _mm512_set1_epi32(acts.offsets[size_t((t0 + j) * nb + b)]);
    const int8_t* a[kActs];
    for (int j = 0; j < kActs; ++j) a[j] = acts.rows[size_t(t0 + j)][b].qs;
#pragma GCC unroll 8  // straight-line dpbusd: the rolled loop shuffles the accumulators between registers
    for (int g = 0; g < 8; ++g) {
      __m512i q[kVecs];
      for (int v = 0; v < kVecs; ++v) q[v] = src.q(b, g, v);
      for (int j = 0; j < kActs; ++j) {
        int32_t a4;
        std::memcpy(&a4, a[j] + 4 * g, 4);
        const __m512i a = _mm512_set1_epi32(a4);
        for (int v = 0; v < kVecs; ++v) sum[j][v] = _mm512_dpbusd_epi32(sum[j][v], q[v], a);
      }
    }
    for (int v = 0; v < kVecs; ++v) {
      const __m512 d_w = src.d(b, v), m_w = kHasMin ? src.m(b, v) : d_w;
      for (int j = 0; j < kActs; ++j) {
        const size_t k = size_t((t0 + j) * nb + b);
        acc[j][v] = block_step<kHasMin>(acc[j][v], sum[j][v], d_w, m_w, acts.scales[k], kHasMin ? acts.min_terms[k] : 0.0f);
      }
    }
  }
  store_block<kActs, kVecs>(acc, out, t0, ldo, rows);
}

// The legacy formats' GEMM over T activation rows (walk_tiles with gemm_block); pack(r0,
// tile_rows) gives a TileSource or the like.
template <bool kHasMin, class PackFn>
FERRUM_AVX512 void gemm_tiles(const void* w, size_t w_row_bytes, int64_t nb, int64_t rows, const LegacyActs& acts,
                              int64_t T, float* out, int64_t ldo, PackFn pack) {
  walk_tiles(w, w_row_bytes, nb, nb * kQK, rows, T, pack,
             [&](auto acts_per_call, const auto& source, int64_t t, int64_t r0, int64_t tile_rows, const Prefetch& pf) {
               gemm_block<kHasMin, decltype(acts_per_call)::value>(nb, source, acts, t, out + r0, ldo, tile_rows, pf);
             });
}

}  // namespace ferrum::quant::detail
