// AVX-512 VNNI kernels for weights in the R16 layout (quant/repack.h): a block of 16 rows loads as
// vpdpbusd-ready registers and 16-lane scale vectors, so the GEMM (legacy_gemm_avx512.h) reads
// its tiles in place instead of packing them, and the row kernel is that GEMM at T = 1 (no
// horizontal sums). Same float order as the GGUF GEMMs, hence the same results bit for bit.
#include <cstdint>
#include <cstring>
#include <iterator>
#include <type_traits>
#include <vector>

#include "quant/kernels.h"
#include "quant/kquant_acts.h"
#include "quant/legacy_gemm_avx512.h"
#include "quant/repack.h"

namespace ferrum::quant::detail {

namespace {

// The IQ4 levels + 128 (unsigned, as vpdpbusd takes them; the 128 leaves with the zero point),
// in every 128-bit lane for vpshufb.
FERRUM_AVX512_INLINE __m512i iq4_unsigned_levels() {
  return _mm512_broadcast_i32x4(_mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4Values)),
                                              _mm_set1_epi8(char(0x80))));
}

// What a kernel needs to know of one type in R16 (kLevels: IQ4_NL, whose nibbles index the
// non-linear levels).
template <class Block, int kBits, int kOffsetShift, bool kHasMin, bool kLevels = false>
struct R16 {
  static constexpr int kChunk = int(kR16Rows * sizeof(Block));  // block b of a group's 16 rows
  static constexpr int kHeader = kHasMin ? 64 : 32;               // the f16 fields
  static constexpr int kOffset = kOffsetShift;
  static constexpr bool kMin = kHasMin;
  // From this many activation rows the GEMM unpacks a tile once (unpack_tile) rather than at
  // every use. Pays for the 5-bit formats' bit gathering only, and from 16 rows; for the 4-bit
  // ones in place is as fast or faster up to T = 64.
  static constexpr int64_t kUnpackOnceFrom = kBits == 5 ? 16 : INT64_MAX;

  // Field f (0: d, 1: m) of block `chunk` in the 16 rows, one per lane.
  FERRUM_AVX512_INLINE static __m512 scales(const char* chunk, int f) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 32 * f)));
  }
  // Elements 4g..4g+3 of block `chunk` in the 16 rows, unsigned. 4-bit: bytes 4j..4j+3 of the
  // qs hold group j in their low nibbles and group 4 + j in the high ones. 5-bit: the qs come
  // after the qh dword, and element e's fifth bit is bit e of qh.
  FERRUM_AVX512_INLINE static __m512i quant_group(const char* chunk, int g) {
    if constexpr (kBits == 8) return _mm512_loadu_si512(chunk + kHeader + 64 * g);
    constexpr int kQs = kHeader + (kBits == 5 ? 64 : 0);
    const __m512i v = _mm512_loadu_si512(chunk + kQs + 64 * (g % 4));
    const __m512i low = _mm512_and_si512(g < 4 ? v : _mm512_srli_epi16(v, 4), _mm512_set1_epi8(15));
    if constexpr (kLevels) return _mm512_shuffle_epi8(iq4_unsigned_levels(), low);
    if constexpr (kBits == 4) return low;
    // Byte g / 2 of each lane's qh copied to its 4 bytes; byte i then tests bit 4 (g % 2) + i.
    const __m512i qh = _mm512_loadu_si512(chunk + kHeader);
    const __m512i spread = _mm512_shuffle_epi8(qh, _mm512_add_epi32(_mm512_set1_epi32(0x01010101 * (g / 2)),
                                                                    _mm512_set_epi32(0x0c0c0c0c, 0x08080808, 0x04040404, 0, 0x0c0c0c0c, 0x08080808, 0x04040404, 0,
                                                                                     0x0c0c0c0c, 0x08080808, 0x04040404, 0, 0x0c0c0c0c, 0x08080808, 0x04040404, 0)));
    const __mmask64 fifth = _mm512_test_epi8_mask(spread, _mm512_set1_epi32(0x08040201 << (4 * (g % 2))));
    return _mm512_mask_add_epi8(low, fifth, low, _mm512_set1_epi8(16));
  }
};
using R16Q4_0 = R16<BlockQ4_0, 4, 3, false>;
using R16Q4_1 = R16<BlockQ4_1, 4, 0, true>;
using R16Q5_0 = R16<BlockQ5_0, 5, 4, false>;
using R16Q5_1 = R16<BlockQ5_1, 5, 0, true>;
using R16Q8_0 = R16<BlockQ8_0, 8, 7, false>;
using R16IQ4_NL = R16<BlockIQ4_NL, 4, 7, false, true>;

// The kGemmVecs 16-row groups of the tile at row r0; a tile of one group repeats it (those
// lanes are never stored).
inline void tile_groups(const void* w, size_t w_row_bytes, int64_t r0, int64_t tile_rows, const char* group[kGemmVecs]) {
  for (int v = 0; v < kGemmVecs; ++v)
    group[v] = static_cast<const char*>(w) + (r0 + (16 * v < tile_rows ? 16 * v : 0)) * int64_t(w_row_bytes);
}

// Two groups read in place as a GEMM tile (gemm_block's source, see TileSource): the layout is
// the packed form but for the 4- and 5-bit formats' unpacking, done as the quants are used.
template <class F, int kVecs = kGemmVecs>
struct R16Source {
  const char* group[kVecs];
  FERRUM_AVX512_INLINE __m512i q(int64_t b, int g, int v) const { return F::quant_group(group[v] + b * F::kChunk, g); }
  FERRUM_AVX512_INLINE __m512 d(int64_t b, int v) const { return F::scales(group[v] + b * F::kChunk, 0); }
  FERRUM_AVX512_INLINE __m512 m(int64_t b, int v) const { return F::scales(group[v] + b * F::kChunk, 1); }
};

// The tile of src in the packed form, its quants unpacked.
template <class F>
FERRUM_AVX512 void unpack_tile(const R16Source<F>& src, int64_t nb, PackedTile& tile) {
  tile.quants.resize(size_t(nb * 8 * kGemmVecs));
  tile.scales.resize(size_t(nb * kGemmRows));
  if (F::kMin) tile.mins.resize(size_t(nb * kGemmRows));
  for (int64_t b = 0; b < nb; ++b)
    for (int v = 0; v < kGemmVecs; ++v) {
      for (int g = 0; g < 8; ++g) tile.quants[size_t((b * 8 + g) * kGemmVecs + v)] = src.q(b, g, v);
      _mm512_storeu_ps(&tile.scales[size_t(b * kGemmRows + 16 * v)], src.d(b, v));
      if constexpr (F::kMin) _mm512_storeu_ps(&tile.mins[size_t(b * kGemmRows + 16 * v)], src.m(b, v));
    }
}

// Activation rows 0 .. kActs - 1 against the weights' 16-row groups one after another (kVecs =
// 1), all of them in one pass over a group: one stream from DRAM, which the hardware prefetchers
// follow at close to a plain read's pace. The GEMM's 32-row tiles read two groups' blocks in
// turn, two streams 16 rows apart, which hold one thread well below that (their prefetches make
// up for it only where the arithmetic is the bound); the per-lane operations are the same, so
// are the bits.
template <class F, int kActs>
FERRUM_AVX512 void gemm_by_group(int64_t nb, const void* w, size_t w_row_bytes, int64_t rows, const LegacyActs& acts,
                                 float* out, int64_t ldo) {
  const char* group = static_cast<const char*>(w);
  for (int64_t r0 = 0; r0 < rows; r0 += kR16Rows, group += kR16Rows * w_row_bytes)
    gemm_block<F::kMin, kActs, R16Source<F, 1>, 1>(nb, R16Source<F, 1>{{group}}, acts, 0, out + r0, ldo,
                                                   std::min<int64_t>(kR16Rows, rows - r0), kNoPrefetch);
}

// Up to this many activation rows (a step verifying one or two proposals, a small batch) the
// GEMM walks the groups one at a time, where the weight stream binds it; from 4 rows on the
// arithmetic does, and the two-group tiles, each activation broadcast serving two weight
// registers, are as fast or faster (engine steps interleaved in one process).
constexpr int64_t kByGroupMaxActs = 3;

using ByGroupFn = void (*)(int64_t, const void*, size_t, int64_t, const LegacyActs&, float*, int64_t);

template <class F>
ByGroupFn gemm_by_group_kernel(int64_t T) {
  static constexpr ByGroupFn kernels[] = {gemm_by_group<F, 1>, gemm_by_group<F, 2>, gemm_by_group<F, 3>};
  static_assert(std::size(kernels) == kByGroupMaxActs);
  return kernels[T - 1];
}

// The GEMM (and batched decode from 2 rows).
template <class F>
FERRUM_AVX512 void gemm_r16(int64_t n, const void* w, size_t w_row_bytes, int64_t rows, const void* act,
                            size_t act_row_bytes, int64_t T, float* out, int64_t ldo) {
  const int64_t nb = n / kQK;
  thread_local LegacyActs acts;
  thread_local PackedTile tile;
  prepare_legacy_acts<F::kOffset, F::kMin>(nb, act, act_row_bytes, T, acts);
  if (T > 0 && T <= kByGroupMaxActs) {
    gemm_by_group_kernel<F>(T)(nb, w, w_row_bytes, rows, acts, out, ldo);
    return;
  }
  const auto in_place = [&](int64_t r0, int64_t tile_rows) {
    R16Source<F> src;
    tile_groups(w, w_row_bytes, r0, tile_rows, src.group);
    return src;
  };
  if (T < F::kUnpackOnceFrom)
    gemm_tiles<F::kMin>(w, w_row_bytes, nb, rows, acts, T, out, ldo, in_place);
  else
    gemm_tiles<F::kMin>(w, w_row_bytes, nb, rows, acts, T, out, ldo, [&](int64_t r0, int64_t tile_rows) {
      unpack_tile(in_place(r0, tile_rows), nb, tile);
      return TileSource{tile};
    });
}

// One activation row: the groups one after another, as the GEMM takes a few rows (software
// prefetches two groups ahead slow it: quant_dot_bench read).
template <class F>
FERRUM_AVX512 void dot_rows_r16(int64_t n, const void* w, size_t w_row_bytes, int64_t rows, const void* act,
                                float* out) {
  const int64_t nb = n / kQK;
  thread_local LegacyActs acts;
  prepare_legacy_acts<F::kOffset, F::kMin>(nb, act, 0, 1, acts);
  gemm_by_group<F, 1>(nb, w, w_row_bytes, rows, acts, out, 0);
}

// The k-quant block kernels' shared steps, per super-block of a tile (two 16-row vectors v) and
// kActs activation rows j:
// sum[j][v] += the 16 rows' quants of group g (elements 4g..4g+3) times row j's activations there.
template <int kActs, int kVecs>
FERRUM_AVX512_INLINE void dot_group(__m512i (&sum)[kActs][kVecs], const __m512i (&q)[kVecs],
                                    const BlockQ8_K* const (&y)[kActs], int g) {
  for (int j = 0; j < kActs; ++j) {
    int32_t a4;
    std::memcpy(&a4, y[j]->qs + 4 * g, 4);
    const __m512i a = _mm512_set1_epi32(a4);
    for (int v = 0; v < kVecs; ++v) sum[j][v] = _mm512_dpbusd_epi32(sum[j][v], q[v], a);
  }
}

// Activation rows t0.. of super-block sb: their Q8_K blocks and activation terms.
template <int kActs>
FERRUM_AVX512_INLINE void super_block_acts(const KActs& acts, int64_t nb, int64_t sb, int64_t t0,
                                           const BlockQ8_K* (&y)[kActs], const int32_t* (&terms)[kActs]) {
  for (int j = 0; j < kActs; ++j) {
    y[j] = acts.rows[size_t(t0 + j)] + sb;
    terms[j] = &acts.terms[size_t(((t0 + j) * nb + sb) * 16)];
  }
}

// isum[j][v] (+)= sum[j][v] * scale, the scale of sub-block s (the first one starts isum).
template <int kActs, int kVecs>
FERRUM_AVX512_INLINE void add_scaled(__m512i (&isum)[kActs][kVecs], const __m512i (&sum)[kActs][kVecs], int v,
                                     __m512i scale, int s) {
  for (int j = 0; j < kActs; ++j) {
    const __m512i scaled = _mm512_mullo_epi32(sum[j][v], scale);
    isum[j][v] = s == 0 ? scaled : _mm512_add_epi32(isum[j][v], scaled);
  }
}

// acc[j][v] += float(isum[j][v]) * (d * d_a): a super-block's float step for the 16 rows of
// vector v (d: their f16 scales, converted).
template <int kActs, int kVecs>
FERRUM_AVX512_INLINE void add_super_block(__m512 (&acc)[kActs][kVecs], const __m512i (&isum)[kActs][kVecs], int v,
                                          __m512 d, const BlockQ8_K* const (&y)[kActs]) {
  for (int j = 0; j < kActs; ++j)
    acc[j][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[j][v]), _mm512_mul_ps(d, _mm512_set1_ps(y[j]->d)), acc[j][v]);
}

// ---- Q4_K and Q5_K ----
//
// A super-block of 16 rows (16 * 144 or 176 bytes): d and dmin as f16 vectors, then dwords
// k = 0, 1, ... of the rows' remaining bytes, one per lane, 64 bytes each: k = 0..2 are the 12
// packed scale bytes; Q5_K's qh follows (k = 3..10); then dword m of qs[32c..32c + 31] at
// k = kQs + 8c + m, whose low nibbles are group 8s + m of sub-block s = 2c and whose high nibbles
// are group 8s + m of s = 2c + 1 (Q5_K: the fifth bit of those elements is bit s of the bytes of
// qh dword m).
// Per super-block and output, as the GGUF GEMM (gemm_kquant_avx512.cpp) computes it:
//   isum = sum_s scale_s * sum over sub-block s of q * a               (int32, exact)
//   acc = fma(float(isum), d * d_a, acc)
//   acc = fnmadd(float(sum_s min_s * sum_a_s), dmin * d_a, acc)

template <bool kFiveBit>
struct K4R16 {
  using Block = std::conditional_t<kFiveBit, BlockQ5_K, BlockQ4_K>;
  static constexpr int kChunk = int(kR16Rows * sizeof(Block));
  static constexpr int kQs = kFiveBit ? 11 : 3;  // the dword where qs starts
  static constexpr bool kFive = kFiveBit;
  static constexpr int kSubBlocks = 8, kZeroPoint = 0;
  static constexpr bool kHasMin = true;
  static constexpr bool kRowByGroup = true;  // dot_rows_r16_kquant
};

// One super-block's 6-bit scales and mins for the 16 rows of a group, unpacked lane-wise as
// unpack_k4_scales does per row: scale s as int32 lanes, mins 2k, 2k + 1 as int16 halves
// (vpdpwssd against the activation's paired sub-block sums).
struct K4Scales {
  __m512i scale[8], min_pair[4];
};

FERRUM_AVX512_INLINE K4Scales k4_scales(const char* chunk) {
  const __m512i a0 = _mm512_loadu_si512(chunk + 64), a1 = _mm512_loadu_si512(chunk + 128),
                a2 = _mm512_loadu_si512(chunk + 192);
  const __m512i six = _mm512_set1_epi8(63), four = _mm512_set1_epi8(15), top = _mm512_set1_epi8(0x30);
  // bytes j of each lane: scale j / scale 4 + j / min j / min 4 + j
  const __m512i sc_lo = _mm512_and_si512(a0, six);
  const __m512i sc_hi = _mm512_or_si512(_mm512_and_si512(a2, four), _mm512_and_si512(_mm512_srli_epi32(a0, 2), top));
  const __m512i mn_lo = _mm512_and_si512(a1, six);
  const __m512i mn_hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(a2, 4), four),
                                        _mm512_and_si512(_mm512_srli_epi32(a1, 2), top));
  // vpshufb indices (per 128-bit lane, 4 dwords): byte j of each dword zero-extended to a
  // dword, and bytes 2p, 2p + 1 to the two words of a dword.
  const __m512i dword_base = _mm512_set_epi32(12, 8, 4, 0, 12, 8, 4, 0, 12, 8, 4, 0, 12, 8, 4, 0);
  K4Scales r;
  for (int j = 0; j < 4; ++j) {
    const __m512i index = _mm512_add_epi32(dword_base, _mm512_set1_epi32(int(0x80808000u) + j));
    r.scale[j] = _mm512_shuffle_epi8(sc_lo, index);
    r.scale[4 + j] = _mm512_shuffle_epi8(sc_hi, index);
  }
  for (int p = 0; p < 2; ++p) {
    const __m512i index = _mm512_add_epi32(_mm512_add_epi32(dword_base, _mm512_slli_epi32(dword_base, 16)),
                                           _mm512_set1_epi32(int(0x80008000u) + 2 * p + ((2 * p + 1) << 16)));
    r.min_pair[p] = _mm512_shuffle_epi8(mn_lo, index);
    r.min_pair[2 + p] = _mm512_shuffle_epi8(mn_hi, index);
  }
  return r;
}

// kActs activation rows from t0 against the tile's two groups.
template <class F, int kActs, int kVecs = kGemmVecs>
FERRUM_AVX512 void gemm_block_k4(int64_t nb, const char* const group[kVecs], const KActs& acts, int64_t t0,
                                  float* out, int64_t ldo, int64_t rows, const Prefetch& prefetch) {
  const __m512i low4 = _mm512_set1_epi8(15);
  __m512 acc[kActs][kVecs];
  for (auto& a : acc)
    for (auto& v : a) v = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < nb; ++sb) {
    const char* chunk[kVecs];
    K4Scales sc[kVecs];
    for (int v = 0; v < kVecs; ++v) {
      chunk[v] = group[v] + sb * F::kChunk;
      sc[v] = k4_scales(chunk[v]);
    }
    const BlockQ8_K* y[kActs];
    for (int j = 0; j < kActs; ++j) y[j] = acts.rows[size_t(t0 + j)] + sb;
    __m512i isum[kActs][kVecs];
    for (int s = 0; s < 8; ++s) {
      prefetch.at(8 * sb + s);
      __m512i sum[kActs][kVecs];
      for (auto& a : sum)
        for (auto& v : a) v = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int m = 0; m < 8; ++m) {
        __m512i q[kVecs];
        for (int v = 0; v < kVecs; ++v) {
          const __m512i packed = _mm512_loadu_si512(chunk[v] + 64 * (1 + F::kQs + 8 * (s / 2) + m));
          q[v] = _mm512_and_si512(s % 2 ? _mm512_srli_epi16(packed, 4) : packed, low4);
          if constexpr (F::kFive) {
            const __m512i qh = _mm512_loadu_si512(chunk[v] + 64 * (4 + m));
            const __m512i bit = s <= 4 ? _mm512_slli_epi32(qh, 4 - s) : _mm512_srli_epi32(qh, s - 4);
            q[v] = _mm512_or_si512(q[v], _mm512_and_si512(bit, _mm512_set1_epi8(16)));
          }
        }
        dot_group<kActs>(sum, q, y, 8 * s + m);
      }
      for (int v = 0; v < kVecs; ++v) add_scaled<kActs>(isum, sum, v, sc[v].scale[s], s);
    }
    for (int v = 0; v < kVecs; ++v) {
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk[v])));
      const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk[v] + 32)));
      add_super_block<kActs>(acc, isum, v, d, y);
      for (int j = 0; j < kActs; ++j) {
        const int32_t* terms = &acts.terms[size_t(((t0 + j) * nb + sb) * 16)];
        const __m512 d_a = _mm512_set1_ps(y[j]->d);
        __m512i min_sum = _mm512_setzero_si512();
        for (int k = 0; k < 4; ++k) min_sum = _mm512_dpwssd_epi32(min_sum, sc[v].min_pair[k], _mm512_set1_epi32(terms[k]));
        acc[j][v] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(min_sum), _mm512_mul_ps(dmin, d_a), acc[j][v]);
      }
    }
  }
  store_block<kActs, kVecs>(acc, out, t0, ldo, rows);
}

// ---- Q6_K ----
//
// A super-block of 16 rows (16 * 210 bytes): d as an f16 vector, then dwords k = 0..51 of the
// rows' other bytes, one per lane: ql (k = 0..31), qh (32..47), the int8 scales (48..51), each
// in slot kQ6KSlots[k] (repack.h: the order this kernel first reads them).
// Group g = 32h + 8q + m (half h, quarter q, m = 0..7) takes its low 4 bits from the low (q < 2)
// or high nibbles of ql dword 16h + 8 (q % 2) + m and its top 2 from bits 2q, 2q + 1 of qh dword
// 8h + m; 16-element sub-block s holds the groups with h = s / 8, q = s % 8 / 2, m / 4 = s % 2.
// Quants stay unsigned (0..63); the -32 enters through the activation terms, and per super-block,
// as the GGUF GEMM computes it: isum = sum_s scale_s * (sum over s of q * a - 32 * bsum_s),
// acc = fma(float(isum), d * d_a, acc).

constexpr int kQ6Chunk = int(kR16Rows * sizeof(BlockQ6_K));

FERRUM_AVX512_INLINE __m512i q6k_dword(const char* chunk, int k) {
  return _mm512_loadu_si512(chunk + 32 + 64 * kQ6KSlots[size_t(k)]);
}

// Elements 4g..4g+3 of the 16 rows, g = 32h + 8q + m.
FERRUM_AVX512_INLINE __m512i q6k_group(const char* chunk, int h, int q, int m) {
  const __m512i ql = q6k_dword(chunk, 16 * h + 8 * (q % 2) + m);
  const __m512i qh = q6k_dword(chunk, 32 + 8 * h + m);
  const __m512i low = q < 2 ? ql : _mm512_srli_epi16(ql, 4);
  const __m512i high = q == 0 ? _mm512_slli_epi16(qh, 4) : q == 1 ? _mm512_slli_epi16(qh, 2) : q == 2 ? qh : _mm512_srli_epi16(qh, 2);
  return _mm512_or_si512(_mm512_and_si512(low, _mm512_set1_epi8(15)), _mm512_and_si512(high, _mm512_set1_epi8(0x30)));
}

// Scale s of the 16 rows as int32 lanes: byte s % 4 of scale dword s / 4 moved to the top byte of
// each dword, then shifted down with its sign.
FERRUM_AVX512_INLINE __m512i q6k_scale(const char* chunk, int s) {
  const __m512i dwords = q6k_dword(chunk, 48 + s / 4);
  const __m512i index = _mm512_add_epi32(_mm512_set1_epi32(int(0x00808080u) | ((s % 4) << 24)),
                                         _mm512_set_epi32(12 << 24, 8 << 24, 4 << 24, 0, 12 << 24, 8 << 24, 4 << 24, 0,
                                                          12 << 24, 8 << 24, 4 << 24, 0, 12 << 24, 8 << 24, 4 << 24, 0));
  return _mm512_srai_epi32(_mm512_shuffle_epi8(dwords, index), 24);
}

template <int kActs, int kVecs = kGemmVecs>
FERRUM_AVX512 void gemm_block_q6k(int64_t nb, const char* const group[kVecs], const KActs& acts, int64_t t0,
                                  float* out, int64_t ldo, int64_t rows, const Prefetch& prefetch) {
  __m512 acc[kActs][kVecs];
  for (auto& a : acc)
    for (auto& v : a) v = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < nb; ++sb) {
    const char* chunk[kVecs];
    for (int v = 0; v < kVecs; ++v) chunk[v] = group[v] + sb * kQ6Chunk;
    const BlockQ8_K* y[kActs];
    const int32_t* terms[kActs];
    super_block_acts<kActs>(acts, nb, sb, t0, y, terms);
    __m512i isum[kActs][kVecs];
#pragma GCC unroll 16  // constant shifts and offsets (one group at a time)
    for (int s = 0; s < 16; ++s) {
      prefetch.at(16 * sb + s);
      const int h = s / 8, q = s % 8 / 2, m0 = 4 * (s % 2);
      __m512i sum[kActs][kVecs];
      for (int j = 0; j < kActs; ++j)
        for (int v = 0; v < kVecs; ++v) sum[j][v] = _mm512_set1_epi32(terms[j][s]);
#pragma GCC unroll 4
      for (int m = m0; m < m0 + 4; ++m) {
        __m512i w[kVecs];
        for (int v = 0; v < kVecs; ++v) w[v] = q6k_group(chunk[v], h, q, m);
        dot_group<kActs>(sum, w, y, 32 * h + 8 * q + m);
      }
      for (int v = 0; v < kVecs; ++v) add_scaled<kActs>(isum, sum, v, q6k_scale(chunk[v], s), s);
    }
    for (int v = 0; v < kVecs; ++v)
      add_super_block<kActs>(acc, isum, v, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk[v]))), y);
  }
  store_block<kActs, kVecs>(acc, out, t0, ldo, rows);
}

// What gemm_r16_kquant needs of Q6_K (K4R16 carries the same for Q4_K / Q5_K).
struct Q6R16 {
  static constexpr int kSubBlocks = 16, kZeroPoint = 32;
  static constexpr bool kHasMin = false;
  static constexpr bool kRowByGroup = true;
};

// ---- Q2_K and Q3_K ----
//
// A super-block of 16 rows (16 * 84 or 110 bytes): the f16 fields (Q2_K: d, dmin; Q3_K: d), then
// dwords k of the rows' other bytes, one per lane. Q2_K: its 16 scale bytes (k = 0..3, each a
// 4-bit scale and a 4-bit min), then qs (k = 4..19). Q3_K: hmask (k = 0..7), qs (8..23), the 12
// packed 6-bit scales (24..26). Group g = 32h + 8j + m (element 4g..4g+3, sub-block s = g / 4) is
// bits 2j, 2j + 1 of the bytes of qs dword 8h + m; Q3_K's third bit is bit 4h + j of the bytes
// of hmask dword m, and its zero point is 4 (scales stored + 32). Per super-block and output, as
// the GGUF GEMM (gemm_kquant_avx512.cpp) computes it: isum = sum_s scale_s * (sum over s of
// q * a + term_s), acc = fma(float(isum), d * d_a, acc), and for Q2_K
// acc = fnmadd(float(sum_s min_s * bsum_s), dmin * d_a, acc).

template <bool kThreeBit>
struct K2R16 {
  using Block = std::conditional_t<kThreeBit, BlockQ3_K, BlockQ2_K>;
  static constexpr int kChunk = int(kR16Rows * sizeof(Block));
  static constexpr int kHeader = kThreeBit ? 32 : 64;
  static constexpr int kQs = kThreeBit ? 8 : 4;  // the dword where qs starts
  static constexpr int kSubBlocks = 16, kZeroPoint = kThreeBit ? 4 : 0;
  static constexpr bool kHasMin = !kThreeBit;
  static constexpr bool kRowByGroup = false;
  static constexpr int64_t kUnpackOnceFrom = kThreeBit ? 8 : INT64_MAX;

  FERRUM_AVX512_INLINE static __m512i dword(const char* chunk, int k) { return _mm512_loadu_si512(chunk + kHeader + 64 * k); }
  // v shifted right by `bits` (left where negative).
  FERRUM_AVX512_INLINE static __m512i shift(__m512i v, int bits) {
    return bits >= 0 ? _mm512_srli_epi32(v, unsigned(bits)) : _mm512_slli_epi32(v, unsigned(-bits));
  }
  // Group 32h + 8j + m of the 16 rows, unsigned.
  FERRUM_AVX512_INLINE static __m512i quants(const char* chunk, int h, int j, int m) {
    __m512i q = _mm512_and_si512(shift(dword(chunk, kQs + 8 * h + m), 2 * j), _mm512_set1_epi8(3));
    if constexpr (kThreeBit)
      q = _mm512_or_si512(q, _mm512_and_si512(shift(dword(chunk, m), 4 * h + j - 2), _mm512_set1_epi8(4)));
    return q;
  }
  // Scale of sub-block s as int32 lanes (Q3_K: less 32).
  FERRUM_AVX512_INLINE static __m512i scale(const char* chunk, int s) {
    if constexpr (!kThreeBit)
      return _mm512_and_si512(shift(dword(chunk, s / 4), 8 * (s % 4)), _mm512_set1_epi32(15));
    const int low_byte = s % 8;  // low 4 bits: nibble s / 8 of byte s % 8; top 2: bits 2 (s / 4) of byte 8 + s % 4
    const __m512i low = _mm512_and_si512(shift(dword(chunk, 24 + low_byte / 4), 8 * (low_byte % 4) + 4 * (s / 8)), _mm512_set1_epi32(15));
    const __m512i high = _mm512_and_si512(shift(dword(chunk, 26), 8 * (s % 4) + 2 * (s / 4) - 4), _mm512_set1_epi32(0x30));
    return _mm512_sub_epi32(_mm512_or_si512(low, high), _mm512_set1_epi32(32));
  }
  // Q2_K: mins 2k, 2k + 1 as the int16 halves of each lane (vpdpwssd against the paired bsums).
  FERRUM_AVX512_INLINE static __m512i min_pair(const char* chunk, int k) {
    const __m512i x = dword(chunk, k / 2);
    const int b = 2 * k % 4;  // byte of min 2k; 2k + 1's is the next
    return _mm512_or_si512(_mm512_and_si512(shift(x, 8 * b + 4), _mm512_set1_epi32(15)),
                           _mm512_and_si512(shift(x, 8 * b - 4), _mm512_set1_epi32(0xF0000)));
  }
};

// Where gemm_block_k2 reads a super-block's quants, scales, mins and d: the R16 chunks in place
// (K2InPlace), or a tile unpacked once (K2Unpacked: what pays from kUnpackOnceFrom activation
// rows on, as the unpacking is most of the work per use).
template <class F, int kVecs = kGemmVecs>
struct K2InPlace {
  const char* group[kVecs];
  FERRUM_AVX512_INLINE const char* chunk(int64_t sb, int v) const { return group[v] + sb * F::kChunk; }
  FERRUM_AVX512_INLINE __m512i q(int64_t sb, int g, int v) const { return F::quants(chunk(sb, v), g / 32, g % 32 / 8, g % 8); }
  FERRUM_AVX512_INLINE __m512i scale(int64_t sb, int s, int v) const { return F::scale(chunk(sb, v), s); }
  FERRUM_AVX512_INLINE __m512i min_pair(int64_t sb, int k, int v) const { return F::min_pair(chunk(sb, v), k); }
  FERRUM_AVX512_INLINE __m512 d(int64_t sb, int v, int f) const {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk(sb, v) + 32 * f)));
  }
};

struct K2Tile {
  std::vector<__m512i> quants, scales, min_pairs;  // [nb][64 groups / 16 / 8][kGemmVecs]
  std::vector<__m512> fields;                      // [nb][d, dmin][kGemmVecs]
};

struct K2Unpacked {
  const K2Tile& tile;
  FERRUM_AVX512_INLINE __m512i q(int64_t sb, int g, int v) const { return tile.quants[size_t((sb * 64 + g) * kGemmVecs + v)]; }
  FERRUM_AVX512_INLINE __m512i scale(int64_t sb, int s, int v) const { return tile.scales[size_t((sb * 16 + s) * kGemmVecs + v)]; }
  FERRUM_AVX512_INLINE __m512i min_pair(int64_t sb, int k, int v) const { return tile.min_pairs[size_t((sb * 8 + k) * kGemmVecs + v)]; }
  FERRUM_AVX512_INLINE __m512 d(int64_t sb, int v, int f) const { return tile.fields[size_t((sb * 2 + f) * kGemmVecs + v)]; }
};

template <class F>
FERRUM_AVX512 void unpack_k2_tile(const K2InPlace<F>& src, int64_t nb, K2Tile& tile) {
  tile.quants.resize(size_t(nb * 64 * kGemmVecs));
  tile.scales.resize(size_t(nb * 16 * kGemmVecs));
  tile.min_pairs.resize(size_t(nb * 8 * kGemmVecs));
  tile.fields.resize(size_t(nb * 2 * kGemmVecs));
  for (int64_t sb = 0; sb < nb; ++sb)
    for (int v = 0; v < kGemmVecs; ++v) {
      for (int g = 0; g < 64; ++g) tile.quants[size_t((sb * 64 + g) * kGemmVecs + v)] = src.q(sb, g, v);
      for (int s = 0; s < 16; ++s) tile.scales[size_t((sb * 16 + s) * kGemmVecs + v)] = src.scale(sb, s, v);
      for (int f = 0; f < (F::kHasMin ? 2 : 1); ++f) tile.fields[size_t((sb * 2 + f) * kGemmVecs + v)] = src.d(sb, v, f);
      if constexpr (F::kHasMin)
        for (int k = 0; k < 8; ++k) tile.min_pairs[size_t((sb * 8 + k) * kGemmVecs + v)] = src.min_pair(sb, k, v);
    }
}

// kActs activation rows from t0 against the tile in src.
template <class F, int kActs, class Source, int kVecs = kGemmVecs>
FERRUM_AVX512 void gemm_block_k2(int64_t nb, const Source& src, const KActs& acts, int64_t t0, float* out,
                                  int64_t ldo, int64_t rows, const Prefetch& prefetch) {
  __m512 acc[kActs][kVecs];
  for (auto& a : acc)
    for (auto& v : a) v = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < nb; ++sb) {
    const BlockQ8_K* y[kActs];
    const int32_t* terms[kActs];
    super_block_acts<kActs>(acts, nb, sb, t0, y, terms);
    __m512i isum[kActs][kVecs];
#pragma GCC unroll 16  // constant group indices: the in-place unpacking's shifts and offsets
    for (int s = 0; s < 16; ++s) {
      prefetch.at(16 * sb + s);
      __m512i sum[kActs][kVecs];
      for (int j = 0; j < kActs; ++j)
        for (int v = 0; v < kVecs; ++v)
          sum[j][v] = F::kZeroPoint ? _mm512_set1_epi32(terms[j][s]) : _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        // group g of sub-block s: g = 32h + 8j + m with h = s / 8, j = s % 8 / 2, m = 4 (s % 2) + i
        const int g = 32 * (s / 8) + 8 * (s % 8 / 2) + 4 * (s % 2) + i;
        __m512i q[kVecs];
        for (int v = 0; v < kVecs; ++v) q[v] = src.q(sb, g, v);
        dot_group<kActs>(sum, q, y, g);
      }
      for (int v = 0; v < kVecs; ++v) add_scaled<kActs>(isum, sum, v, src.scale(sb, s, v), s);
    }
    for (int v = 0; v < kVecs; ++v) {
      add_super_block<kActs>(acc, isum, v, src.d(sb, v, 0), y);
      if constexpr (F::kHasMin)
        for (int j = 0; j < kActs; ++j) {
          __m512i min_sum = _mm512_setzero_si512();
          for (int k = 0; k < 8; ++k)
            min_sum = _mm512_dpwssd_epi32(min_sum, src.min_pair(sb, k, v), _mm512_set1_epi32(terms[j][k]));
          acc[j][v] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(min_sum), _mm512_mul_ps(src.d(sb, v, 1), _mm512_set1_ps(y[j]->d)), acc[j][v]);
        }
    }
  }
  store_block<kActs, kVecs>(acc, out, t0, ldo, rows);
}

// ---- IQ4_XS ----
//
// A super-block of 16 rows (16 * 136 bytes): d (f16) and scales_h (u16) of the 16 rows, then
// dwords k of the rows' other bytes, one per lane: scales_l (k = 0), then qs (k = 1..32).
// Sub-block s (32 elements) is qs dwords 4s..4s + 3: group 8s + i is the low (i < 4) or high
// nibbles of dword 4s + i % 4, each an index into the IQ4 levels, looked up as level + 128
// (the 128 leaves through the activation terms). Per super-block and output:
// isum = sum_s (scale_s - 32) * (sum over s of (level + 128) * a - 128 * bsum_s),
// acc = fma(float(isum), d * d_a, acc).
struct XsR16 {
  static constexpr int kChunk = int(kR16Rows * sizeof(BlockIQ4_XS));
  static constexpr int kSubBlocks = 8, kZeroPoint = 128;
  static constexpr bool kHasMin = false;
  static constexpr bool kRowByGroup = true;
};

template <int kActs, int kVecs = kGemmVecs>
FERRUM_AVX512 void gemm_block_xs(int64_t nb, const char* const group[kVecs], const KActs& acts, int64_t t0,
                                 float* out, int64_t ldo, int64_t rows, const Prefetch& prefetch) {
  const __m512i levels = iq4_unsigned_levels(), low4 = _mm512_set1_epi8(15);
  __m512 acc[kActs][kVecs];
  for (auto& a : acc)
    for (auto& v : a) v = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < nb; ++sb) {
    const char* chunk[kVecs];
    __m512i scales_h[kVecs], scales_l[kVecs];
    for (int v = 0; v < kVecs; ++v) {
      chunk[v] = group[v] + sb * XsR16::kChunk;
      scales_h[v] = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk[v] + 32)));
      scales_l[v] = _mm512_loadu_si512(chunk[v] + 64);
    }
    const BlockQ8_K* y[kActs];
    const int32_t* terms[kActs];
    super_block_acts<kActs>(acts, nb, sb, t0, y, terms);
    __m512i isum[kActs][kVecs];
#pragma GCC unroll 8
    for (int s = 0; s < 8; ++s) {
      prefetch.at(8 * sb + s);
      __m512i sum[kActs][kVecs];
      for (int j = 0; j < kActs; ++j)
        for (int v = 0; v < kVecs; ++v) sum[j][v] = _mm512_set1_epi32(terms[j][2 * s] + terms[j][2 * s + 1]);
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {
        __m512i q[kVecs];
        for (int v = 0; v < kVecs; ++v) {
          const __m512i packed = _mm512_loadu_si512(chunk[v] + 64 * (2 + 4 * s + i % 4));
          q[v] = _mm512_shuffle_epi8(levels, _mm512_and_si512(i < 4 ? packed : _mm512_srli_epi16(packed, 4), low4));
        }
        dot_group<kActs>(sum, q, y, 8 * s + i);
      }
      for (int v = 0; v < kVecs; ++v) {
        const __m512i low = _mm512_and_si512(_mm512_srli_epi32(scales_l[v], 8 * (s / 2) + 4 * (s % 2)), _mm512_set1_epi32(15));
        const __m512i high = _mm512_and_si512(_mm512_slli_epi32(_mm512_srli_epi32(scales_h[v], 2 * s), 4), _mm512_set1_epi32(0x30));
        add_scaled<kActs>(isum, sum, v, _mm512_sub_epi32(_mm512_or_si512(low, high), _mm512_set1_epi32(32)), s);
      }
    }
    for (int v = 0; v < kVecs; ++v)
      add_super_block<kActs>(acc, isum, v, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk[v]))), y);
  }
  store_block<kActs, kVecs>(acc, out, t0, ldo, rows);
}

// F's block kernel for kActs activation rows against kVecs 16-row groups read in place.
template <class F, int kActs, int kVecs>
FERRUM_AVX512_INLINE void kquant_block(int64_t nb, const char* const (&group)[kVecs], const KActs& acts, int64_t t0,
                                       float* out, int64_t ldo, int64_t rows, const Prefetch& pf) {
  if constexpr (std::is_same_v<F, K2R16<false>> || std::is_same_v<F, K2R16<true>>) {
    K2InPlace<F, kVecs> src;
    std::copy(group, group + kVecs, src.group);
    gemm_block_k2<F, kActs, K2InPlace<F, kVecs>, kVecs>(nb, src, acts, t0, out, ldo, rows, pf);
  } else if constexpr (std::is_same_v<F, Q6R16>) {
    gemm_block_q6k<kActs, kVecs>(nb, group, acts, t0, out, ldo, rows, pf);
  } else if constexpr (std::is_same_v<F, XsR16>) {
    gemm_block_xs<kActs, kVecs>(nb, group, acts, t0, out, ldo, rows, pf);
  } else {
    gemm_block_k4<F, kActs, kVecs>(nb, group, acts, t0, out, ldo, rows, pf);
  }
}

struct KTile {
  const char* group[kGemmVecs];
};

// The k-quants' and IQ4_XS's GEMM (F: K2R16<...>, K4R16<...>, Q6R16 or XsR16), also their batched decode kernel from 2 rows;
// tiles of two groups read in place (Q2_K / Q3_K from kUnpackOnceFrom rows: unpacked once).
template <class F>
FERRUM_AVX512 void gemm_r16_kquant(int64_t n, const void* w, size_t w_row_bytes, int64_t rows, const void* act,
                                   size_t act_row_bytes, int64_t T, float* out, int64_t ldo) {
  const int64_t nb = n / kQKK;
  thread_local KActs acts;
  prepare_kquant_acts<F::kSubBlocks, F::kHasMin, F::kZeroPoint>(nb, act, act_row_bytes, T, acts);
  const auto tile_at = [&](int64_t r0, int64_t tile_rows) {
    KTile tile;
    tile_groups(w, w_row_bytes, r0, tile_rows, tile.group);
    return tile;
  };
  const auto walk = [&](auto pack, auto block) { walk_tiles(w, w_row_bytes, F::kSubBlocks * nb, n, rows, T, pack, block); };
  if constexpr (std::is_same_v<F, K2R16<false>> || std::is_same_v<F, K2R16<true>>) {
    if (T >= F::kUnpackOnceFrom) {
      thread_local K2Tile tile;
      walk([&](int64_t r0, int64_t tile_rows) {
        K2InPlace<F> src;
        std::memcpy(src.group, tile_at(r0, tile_rows).group, sizeof src.group);
        unpack_k2_tile(src, nb, tile);
        return K2Unpacked{tile};
      }, [&](auto acts_per_call, const K2Unpacked& src, int64_t t, int64_t r0, int64_t tile_rows, const Prefetch& pf) {
        gemm_block_k2<F, decltype(acts_per_call)::value>(nb, src, acts, t, out + r0, ldo, tile_rows, pf);
      });
      return;
    }
  }
  walk(tile_at, [&](auto acts_per_call, const KTile& tile, int64_t t, int64_t r0, int64_t tile_rows, const Prefetch& pf) {
    kquant_block<F, decltype(acts_per_call)::value, kGemmVecs>(nb, tile.group, acts, t, out + r0, ldo, tile_rows, pf);
  });
}

// One activation row. Q4_K, Q5_K, Q6_K, IQ4_XS (kRowByGroup): groups one after another, as
// dot_rows_r16, one stream for the prefetchers (Q6_K also with its dwords in read order and its
// sub-blocks unrolled), the next group prefetched into L1 over the steps of this one: left to
// the hardware prefetchers, one thread read DRAM-resident weights at a third to a half of a plain
// read's pace on a Zen 5 (quant_dot_bench read). Q2_K, Q3_K keep the GEMM's two-group tiles and
// its prefetches: one group at a time left them no faster (with or without prefetching a group
// ahead).
template <class F>
FERRUM_AVX512 void dot_rows_r16_kquant(int64_t n, const void* w, size_t w_row_bytes, int64_t rows, const void* act,
                                       float* out) {
  if constexpr (!F::kRowByGroup) {
    gemm_r16_kquant<F>(n, w, w_row_bytes, rows, act, 0, 1, out, rows);
  } else {
    const int64_t nb = n / kQKK;
    thread_local KActs acts;
    prepare_kquant_acts<F::kSubBlocks, F::kHasMin, F::kZeroPoint>(nb, act, 0, 1, acts);
    const int64_t rb = int64_t(w_row_bytes);
    for (int64_t r0 = 0; r0 < rows; r0 += kR16Rows) {
      const char* const group[1] = {static_cast<const char*>(w) + r0 * rb};
      const int64_t ahead_rows = std::clamp<int64_t>(rows - r0 - kR16Rows, 0, kR16Rows);
      const Prefetch pf{group[0] + kR16Rows * rb, ahead_rows * rb, 0, F::kSubBlocks * nb, true};
      kquant_block<F, 1, 1>(nb, group, acts, 0, out + r0, 0, std::min<int64_t>(kR16Rows, rows - r0), pf);
    }
  }
}

}  // namespace

DotRowsFn avx512_r16_dot_rows(DType t) {
  switch (t) {
    case DType::Q4_0: return dot_rows_r16<R16Q4_0>;
    case DType::Q4_1: return dot_rows_r16<R16Q4_1>;
    case DType::Q5_0: return dot_rows_r16<R16Q5_0>;
    case DType::Q5_1: return dot_rows_r16<R16Q5_1>;
    case DType::Q8_0: return dot_rows_r16<R16Q8_0>;
    case DType::IQ4_NL: return dot_rows_r16<R16IQ4_NL>;
    case DType::Q4_K: return dot_rows_r16_kquant<K4R16<false>>;
    case DType::Q5_K: return dot_rows_r16_kquant<K4R16<true>>;
    case DType::Q6_K: return dot_rows_r16_kquant<Q6R16>;
    case DType::Q2_K: return dot_rows_r16_kquant<K2R16<false>>;
    case DType::Q3_K: return dot_rows_r16_kquant<K2R16<true>>;
    case DType::IQ4_XS: return dot_rows_r16_kquant<XsR16>;
    default: return avx512_float_r16_dot_rows(t);
  }
}

DotBatchFn avx512_r16_gemm(DType t) {
  switch (t) {
    case DType::Q4_0: return gemm_r16<R16Q4_0>;
    case DType::Q4_1: return gemm_r16<R16Q4_1>;
    case DType::Q5_0: return gemm_r16<R16Q5_0>;
    case DType::Q5_1: return gemm_r16<R16Q5_1>;
    case DType::Q8_0: return gemm_r16<R16Q8_0>;
    case DType::IQ4_NL: return gemm_r16<R16IQ4_NL>;
    case DType::Q4_K: return gemm_r16_kquant<K4R16<false>>;
    case DType::Q5_K: return gemm_r16_kquant<K4R16<true>>;
    case DType::Q6_K: return gemm_r16_kquant<Q6R16>;
    case DType::Q2_K: return gemm_r16_kquant<K2R16<false>>;
    case DType::Q3_K: return gemm_r16_kquant<K2R16<true>>;
    case DType::IQ4_XS: return gemm_r16_kquant<XsR16>;
    default: return nullptr;
  }
}

}  // namespace ferrum::quant::detail
