// AVX-512 (F/BW/VL + VNNI) dot kernels. Integer dot products use vpdpbusd (unsigned x signed
// bytes) with the weight quants kept unsigned and the zero point removed through the activation
// sum, and vpdpwssd to apply the k-quant sub-block scales.
#include <algorithm>
#include <cstddef>
#include <cstring>
#include <vector>

#include "quant/kernels.h"
#include "quant/legacy_gemm_avx512.h"

namespace ferrum::quant::detail {

namespace {

// Float weights (F32 / F16 / BF16) have no AVX-512 row kernel: the AVX2 one (dot_avx2.cpp) is
// what the CPU table hands out. Decode over float weights is a memory-bound stream, and with
// 512-bit vectors it decoded slower (plain or masked loads alike; docs/performance.md).

// ---- legacy formats (Q4_0 .. Q8_0) against Q8_0 activations (legacy_gemm_avx512.h) ----

// d and m of block b in 16 rows (x[r]: row r's blocks), one row per lane. A block's first dword
// holds d in its low half and, in the min formats, m in its high half; the dwords are staged
// through memory (scalar loads: a vpgatherdd here slows the row kernel markedly).
struct RowScales {
  __m512 d, m;
};
template <class Block, bool kHasMin>
FERRUM_AVX512_INLINE RowScales row_scales(const Block* const x[16], int64_t b) {
  alignas(64) uint32_t words[16];
  for (int r = 0; r < 16; ++r) std::memcpy(&words[r], &x[r][b], 4);
  const __m512i g = _mm512_load_si512(words);
  RowScales s;
  s.d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g));
  s.m = kHasMin ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(g, 16))) : s.d;
  return s;
}

// Pointers to 16 rows from row0; rows at or past `count` repeat the last one (their lanes are
// computed but never stored, and nothing past the weights is read).
template <class Block>
inline void row_pointers(const char* row0, size_t w_row_bytes, int count, const Block* x[16]) {
  for (int r = 0; r < 16; ++r) x[r] = reinterpret_cast<const Block*>(row0 + size_t(std::min(r, count - 1)) * w_row_bytes);
}

FERRUM_AVX512_INLINE __m512i pair(__m256i lo, __m256i hi) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}
FERRUM_AVX512_INLINE __m256i load_act(const BlockQ8_0& b) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qs));
}

// Blocks 2p and 2p + 1 of a row as one 512-bit register: bytes 0-31 hold block 2p's quants in
// element order, bytes 32-63 block 2p + 1's (zero past an odd last block). The quants of the
// 4/5-bit formats are 16-bit aligned and two blocks span at most 48 bytes, so one load (masked
// at the end of a row) and a word permute place them. (Q8_0's pair spans 68 bytes: two loads.)
template <class Block, int kBits>
struct BlockPairs {
  static constexpr int kSize = int(sizeof(Block));
  __m512i quant_words, nibble_shift;
  __m512i qs_words;  // the pair's packed qs words from two loads (transpose_nibbles16)

  FERRUM_AVX512 BlockPairs() {
    alignas(64) int16_t q[32], sh[32], qs[32];
    for (int j = 0; j < 32; ++j) {
      const int block = j / 16, in_block = j % 16;
      q[j] = int16_t(block * kSize / 2 + int(offsetof(Block, qs)) / 2 + in_block % 8);
      sh[j] = int16_t(in_block < 8 ? 0 : 4);  // words 8..15 of a block: the high nibbles
      const int w = j % 16;  // word w of the pair's qs; words 16-31 come from the second load
      qs[j] = int16_t((j / 16) * 32 + (w / 8) * kSize / 2 + int(offsetof(Block, qs)) / 2 + w % 8);
    }
    quant_words = _mm512_load_si512(q);
    nibble_shift = _mm512_load_si512(sh);
    qs_words = _mm512_load_si512(qs);
  }
  // plain: the 64 bytes from b lie inside the weights, so no mask is needed (a masked load
  // streams slower from DRAM).
  FERRUM_AVX512_INLINE __m512i load(const Block* b, bool both, bool plain) const {
    if (plain) return _mm512_loadu_si512(b);
    const int bytes = both ? 2 * kSize : kSize;
    return _mm512_maskz_loadu_epi8(bytes >= 64 ? ~__mmask64(0) : (__mmask64(1) << bytes) - 1, b);
  }
  // The two blocks' quants as unsigned bytes (v: load(b, ...); unused for Q8_0).
  FERRUM_AVX512_INLINE __m512i quants(const Block* b, const __m512i& v, bool both) const {
    if constexpr (kBits == 8) {
      const __m512i q = pair(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b[0].qs)),
                             both ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b[1].qs))
                                  : _mm256_set1_epi8(char(0x80)));
      return _mm512_xor_si512(q, _mm512_set1_epi8(char(0x80)));
    } else {
      __m512i q = _mm512_and_si512(_mm512_srlv_epi16(_mm512_permutexvar_epi16(quant_words, v), nibble_shift),
                                   _mm512_set1_epi8(15));
      if constexpr (kBits == 5) {
        uint32_t lo, hi = 0;
        std::memcpy(&lo, b[0].qh, 4);
        if (both) std::memcpy(&hi, b[1].qh, 4);
        q = _mm512_mask_add_epi8(q, __mmask64(lo) | __mmask64(hi) << 32, q, _mm512_set1_epi8(0x10));
      }
      return q;
    }
  }
  // Block pairs whose 64-byte load ends inside a row of nb blocks (a row's tail must not be read
  // past: it may be the last of the weights).
  static int64_t plain_pairs(int64_t nb) {
    const int64_t row_bytes = nb * kSize;
    return row_bytes >= 64 ? (row_bytes - 64) / (2 * kSize) + 1 : 0;
  }
};

// The 16 dword lanes of 16 rows' vpdpbusd results over a block pair (lanes 0-7: block 2p,
// 8-15: block 2p + 1), summed per row and block: lane r of even / odd is row r's sum over
// block 2p / 2p + 1. A tree of unpacks and 128-bit shuffles; v is overwritten.
FERRUM_AVX512_INLINE void sum_rows16(__m512i v[16], __m512i& even, __m512i& odd) {
  for (int k = 0; k < 8; ++k)  // 2 rows per register, 4 partial sums each
    v[k] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_epi32(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 4; ++k)  // 4 rows per 128-bit chunk, 2 chunks per block
    v[k] = _mm512_add_epi32(_mm512_unpacklo_epi64(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_epi64(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 2; ++k)  // chunks: rows 8k..8k+3 of block 2p, of 2p + 1, then rows 8k+4..8k+7
    v[k] = _mm512_add_epi32(_mm512_shuffle_i32x4(v[2 * k], v[2 * k + 1], 0x88),
                            _mm512_shuffle_i32x4(v[2 * k], v[2 * k + 1], 0xdd));
  even = _mm512_shuffle_i32x4(v[0], v[1], 0x88);
  odd = _mm512_shuffle_i32x4(v[0], v[1], 0xdd);
}

// Legacy weight rows against one Q8_0 activation row, 16 rows at a time (one per float lane):
// each row's block pair is one vpdpbusd against the activation pair, and sum_rows16 turns the
// 16 results into per-block sums for the float chain.
template <class Block, int kBits, int kOffsetShift, bool kHasMin>
FERRUM_AVX512 void dot_rows_legacy(int64_t n, const void* w, size_t w_row_bytes, int64_t rows,
                                   const void* act, float* out) {
  const int64_t nb = n / kQK, np = (nb + 1) / 2;
  thread_local LegacyActs acts;
  prepare_legacy_acts<kOffsetShift, kHasMin>(nb, act, 0, 1, acts);
  const BlockQ8_0* y = acts.rows[0];
  const float* d_a = acts.scales.data();
  const int32_t* offsets = acts.offsets.data();
  const float* min_terms = kHasMin ? acts.min_terms.data() : d_a;
  const BlockPairs<Block, kBits> pairs;
  const int64_t plain_pairs = pairs.plain_pairs(nb);
  // The first two groups, which no group before them prefetches.
  prefetch_share(static_cast<const char*>(w), std::min<int64_t>(rows, 32) * int64_t(w_row_bytes), 0, 1);
  for (int64_t r0 = 0; r0 < rows; r0 += 16) {
    const int count = int(std::min<int64_t>(16, rows - r0));
    const char* row0 = static_cast<const char*>(w) + r0 * w_row_bytes;
    const Block* x[16];
    row_pointers(row0, w_row_bytes, count, x);
    __m512 acc = _mm512_setzero_ps();
    const char* ahead = row0 + 32 * w_row_bytes;  // the group after next (prefetch_share)
    const int64_t ahead_bytes = r0 + 48 <= rows ? int64_t(16 * w_row_bytes) : 0;
    for (int64_t i = 0; i < np; ++i) {
      prefetch_share(ahead, ahead_bytes, i, np);
      const bool both = 2 * i + 1 < nb, plain = both && i < plain_pairs;
      const __m512i a = pair(load_act(y[2 * i]), both ? load_act(y[2 * i + 1]) : _mm256_setzero_si256());
      __m512i s[16];
      for (int r = 0; r < 16; ++r) {
        const Block* b = x[r] + 2 * i;
        const __m512i v = kBits == 8 ? _mm512_setzero_si512() : pairs.load(b, both, plain);
        s[r] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), pairs.quants(b, v, both), a);
      }
      __m512i even, odd;
      sum_rows16(s, even, odd);
      for (int64_t k = 2 * i; k < 2 * i + (both ? 2 : 1); ++k) {
        const RowScales sc = row_scales<Block, kHasMin>(x, k);
        const __m512i isum = _mm512_add_epi32(k == 2 * i ? even : odd, _mm512_set1_epi32(offsets[k]));
        acc = block_step<kHasMin>(acc, isum, sc.d, sc.m, d_a[k], min_terms[k]);
      }
    }
    _mm512_mask_storeu_ps(out + r0, __mmask16((1u << count) - 1), acc);
  }
}

// ---- legacy weights x Q8_0 activations, many activation rows: the int8 GEMM on tiles packed
// from GGUF rows ----

// transpose16x16's result for the 4-bit formats with half the shuffles: the packed bytes are
// transposed before the nibbles are split. Byte m of a block's qs holds element m (low nibble)
// and m + 16 (high), so qs dword d is group d in its low nibbles and group 4 + d in its high.
template <class Block, int kBits>
FERRUM_AVX512_INLINE void transpose_nibbles16(const BlockPairs<Block, kBits>& pairs, const Block* const x[16],
                                              int64_t i, bool both, bool plain, __m512i q[16]) {
  __m512i z[8];  // z[k]: the 8 qs dwords of the pair in row k (lanes 0-7) and row k + 8 (8-15)
  for (int k = 0; k < 8; ++k)
    z[k] = _mm512_permutex2var_epi16(pairs.load(x[k] + 2 * i, both, plain), pairs.qs_words,
                                     pairs.load(x[k + 8] + 2 * i, both, plain));
  // Per 256-bit half, a 4 x 4 dword transpose of rows k..k+3 in each 128-bit chunk: u[j] then
  // holds dword j of rows 0-3 / dword 4 + j of rows 0-3 / the same of rows 8-11, w[j] of rows
  // 4-7 and 12-15.
  __m512i u[4], w[4];
  for (int h = 0; h < 2; ++h) {
    const __m512i* r = z + 4 * h;
    const __m512i a = _mm512_unpacklo_epi32(r[0], r[1]), b = _mm512_unpackhi_epi32(r[0], r[1]);
    const __m512i c = _mm512_unpacklo_epi32(r[2], r[3]), d = _mm512_unpackhi_epi32(r[2], r[3]);
    __m512i* o = h ? w : u;
    o[0] = _mm512_unpacklo_epi64(a, c);
    o[1] = _mm512_unpackhi_epi64(a, c);
    o[2] = _mm512_unpacklo_epi64(b, d);
    o[3] = _mm512_unpackhi_epi64(b, d);
  }
  const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), second = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
  const __m512i low4 = _mm512_set1_epi8(15);
  for (int j = 0; j < 4; ++j) {
    // dword j (block 2i's qs) and dword 4 + j (block 2i + 1's) of all 16 rows
    const __m512i d0 = _mm512_permutex2var_epi64(u[j], first, w[j]), d1 = _mm512_permutex2var_epi64(u[j], second, w[j]);
    q[j] = _mm512_and_si512(d0, low4);
    q[4 + j] = _mm512_and_si512(_mm512_srli_epi16(d0, 4), low4);
    q[8 + j] = _mm512_and_si512(d1, low4);
    q[12 + j] = _mm512_and_si512(_mm512_srli_epi16(d1, 4), low4);
  }
}

// Packs `rows` rows from w (up to kGemmRows).
template <class Block, int kBits, bool kHasMin>
FERRUM_AVX512 void pack_tile(const char* w, size_t w_row_bytes, int64_t rows, int64_t nb, PackedTile& tile) {
  tile.quants.resize(size_t(nb * 8 * kGemmVecs));
  tile.scales.resize(size_t(nb * kGemmRows));
  if (kHasMin) tile.mins.resize(size_t(nb * kGemmRows));
  const BlockPairs<Block, kBits> pairs;
  const int64_t np = (nb + 1) / 2, plain_pairs = pairs.plain_pairs(nb);
  for (int vec = 0; vec < kGemmVecs; ++vec) {
    // Rows past the end repeat the last one (never stored by gemm_block).
    const int count = int(std::clamp<int64_t>(rows - 16 * vec, 1, 16));
    const Block* x[16];
    row_pointers(w + std::min<int64_t>(16 * vec, rows - 1) * w_row_bytes, w_row_bytes, count, x);
    for (int64_t i = 0; i < np; ++i) {
      const bool both = 2 * i + 1 < nb, plain = both && i < plain_pairs;
      __m512i q[16];
      if constexpr (kBits == 4) {
        transpose_nibbles16(pairs, x, i, both, plain, q);
      } else {
        for (int r = 0; r < 16; ++r) {
          const Block* b = x[r] + 2 * i;
          q[r] = pairs.quants(b, kBits == 8 ? _mm512_setzero_si512() : pairs.load(b, both, plain), both);
        }
        transpose16x16(q);
      }
      // q[g]: group g of block 2i, q[8 + g]: of block 2i + 1
      for (int64_t k = 2 * i; k < 2 * i + (both ? 2 : 1); ++k) {
        for (int g = 0; g < 8; ++g) tile.quants[size_t((k * 8 + g) * kGemmVecs + vec)] = q[8 * (k - 2 * i) + g];
        const RowScales sc = row_scales<Block, kHasMin>(x, k);
        _mm512_storeu_ps(&tile.scales[size_t(k * kGemmRows + 16 * vec)], sc.d);
        if constexpr (kHasMin) _mm512_storeu_ps(&tile.mins[size_t(k * kGemmRows + 16 * vec)], sc.m);
      }
    }
  }
}

template <class Block, int kBits, int kOffsetShift, bool kHasMin>
FERRUM_AVX512 void gemm_legacy(int64_t n, const void* w, size_t w_row_bytes, int64_t rows,
                               const void* act, size_t act_row_bytes, int64_t T, float* out,
                               int64_t ldo) {
  const int64_t nb = n / kQK;
  thread_local PackedTile tile;
  thread_local LegacyActs acts;
  prepare_legacy_acts<kOffsetShift, kHasMin>(nb, act, act_row_bytes, T, acts);
  gemm_tiles<kHasMin>(w, w_row_bytes, nb, rows, acts, T, out, ldo, [&](int64_t r0, int64_t tile_rows) {
    pack_tile<Block, kBits, kHasMin>(static_cast<const char*>(w) + r0 * w_row_bytes, w_row_bytes, tile_rows, nb, tile);
    return TileSource{tile};
  });
}

// The batched decode kernel: below 4 activation rows the row kernel once per activation row
// over 256-row tiles (kept in L2 for the next activation row) is faster than packing tiles for
// the GEMM; the results are the same either way.
template <class Block, int kBits, int kOffsetShift, bool kHasMin>
FERRUM_AVX512 void dot_batch_legacy(int64_t n, const void* w, size_t w_row_bytes, int64_t rows,
                                    const void* act, size_t act_row_bytes, int64_t T, float* out,
                                    int64_t ldo) {
  if (T >= 4) return gemm_legacy<Block, kBits, kOffsetShift, kHasMin>(n, w, w_row_bytes, rows, act, act_row_bytes, T, out, ldo);
  constexpr int64_t kTileRows = 256;
  for (int64_t r0 = 0; r0 < rows; r0 += kTileRows)
    for (int64_t t = 0; t < T; ++t)
      dot_rows_legacy<Block, kBits, kOffsetShift, kHasMin>(n, static_cast<const char*>(w) + r0 * w_row_bytes, w_row_bytes,
                                                           std::min(kTileRows, rows - r0),
                                                           static_cast<const char*>(act) + t * act_row_bytes,
                                                           out + t * ldo + r0);
}

// ---- k-quants against Q8_K ----


// sum_j mins[j] * (bsums[2j] + bsums[2j + 1]) as 8 int32 lanes.
FERRUM_AVX512 inline __m256i min_terms(uint64_t mins, const int16_t* bsums) {
  __m256i m32 = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(mins)));
  m32 = _mm256_or_si256(m32, _mm256_slli_epi32(m32, 16));
  return _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bsums)), m32);
}

// int16 lane indices selecting scale 2c for the low 16 words and 2c + 1 for the high 16.
FERRUM_AVX512 inline __m512i scale_pair_index(int c) {
  return _mm512_inserti64x4(_mm512_set1_epi16(short(2 * c)), _mm256_set1_epi16(short(2 * c + 1)),
                            1);
}

// Each 32 bytes of qs are broadcast to both halves and shifted by 0 / 4 per half, which yields
// sub-blocks 2c and 2c + 1 in element order against 64 contiguous activation bytes.
template <bool kFiveBit, class Block>
FERRUM_AVX512 float dot_k4(int64_t n, const void* w, const void* act) {
  const Block* x = static_cast<const Block*>(w);
  const BlockQ8_K* y = static_cast<const BlockQ8_K*>(act);
  const __m512i low4 = _mm512_set1_epi8(15), fifth = _mm512_set1_epi8(0x10);
  const __m512i nibble_shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
  const __m512i index[4] = {scale_pair_index(0), scale_pair_index(1), scale_pair_index(2),
                            scale_pair_index(3)};
  __m512 acc = _mm512_setzero_ps();
  __m256 acc_min = _mm256_setzero_ps();
  for (int64_t i = 0; i < n / kQKK; ++i) {
    uint64_t scales, mins;
    unpack_k4_scales(x[i].scales, scales, mins);
    const __m512i scales16 =
        _mm512_cvtepu8_epi16(_mm256_zextsi128_si256(_mm_cvtsi64_si128(int64_t(scales))));
    __m512i qh;
    if constexpr (kFiveBit) qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[i].qh)));
    __m512i isum = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {
      const __m512i both = _mm512_broadcast_i64x4(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[i].qs + 32 * c)));
      __m512i q = _mm512_and_si512(_mm512_srlv_epi16(both, nibble_shift), low4);
      if constexpr (kFiveBit) {
        const __m512i bit = _mm512_inserti64x4(_mm512_set1_epi8(char(1 << (2 * c))),
                                               _mm256_set1_epi8(char(2 << (2 * c))), 1);
        q = _mm512_mask_or_epi32(q, 0xffff, q,
                                 _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(qh, bit), fifth));
      }
      const __m512i a = _mm512_loadu_si512(y[i].qs + 64 * c);
      const __m512i scale = _mm512_permutexvar_epi16(index[c], scales16);
      isum = _mm512_dpwssd_epi32(isum, _mm512_maddubs_epi16(q, a), scale);
    }
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(h2f(x[i].d) * y[i].d), acc);
    acc_min = _mm256_fmadd_ps(_mm256_cvtepi32_ps(min_terms(mins, y[i].bsums)),
                              _mm256_set1_ps(h2f(x[i].dmin) * y[i].d), acc_min);
  }
  __m256 lo = _mm512_castps512_ps256(acc);
  __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1));
  const __m256 total = _mm256_sub_ps(_mm256_add_ps(lo, hi), acc_min);
  return _mm512_reduce_add_ps(_mm512_zextps256_ps512(total));
}

// Q6_K: per half, 64 ql bytes give groups 0,1 (low nibbles) and 2,3 (high nibbles) in element
// order; qh is paired with qh >> 2 so each group's 2-bit field sits at the same bit position.
FERRUM_AVX512 float dot_q6_k(int64_t n, const void* w, const void* act) {
  const BlockQ6_K* x = static_cast<const BlockQ6_K*>(w);
  const BlockQ8_K* y = static_cast<const BlockQ8_K*>(act);
  const __m512i low4 = _mm512_set1_epi8(15), bits45 = _mm512_set1_epi8(0x30);
  // Word k of a 64-element group belongs to 16-element sub-block k / 8 of that group.
  __m512i index[4];
  for (int k = 0; k < 4; ++k) {
    alignas(64) int16_t idx[32];
    for (int j = 0; j < 32; ++j) idx[j] = int16_t(4 * k + j / 8);
    index[k] = _mm512_load_si512(idx);
  }
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n / kQKK; ++i) {
    const __m256i scales16 =
        _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x[i].scales)));
    const __m256i zero_point = _mm256_slli_epi32(
        _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(y[i].bsums)),
                          scales16),
        5);
    const __m512i scales512 = _mm512_castsi256_si512(scales16);
    __m512i isum = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_zextsi256_si512(zero_point));
    for (int h = 0; h < 2; ++h) {
      const __m512i ql = _mm512_loadu_si512(x[i].ql + 64 * h);
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[i].qh + 32 * h));
      const __m512i qh2 = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
      const __m512i q_lo = _mm512_or_si512(_mm512_and_si512(ql, low4),
                                           _mm512_and_si512(_mm512_slli_epi16(qh2, 4), bits45));
      const __m512i q_hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4),
                                           _mm512_and_si512(qh2, bits45));
      const __m512i a_lo = _mm512_loadu_si512(y[i].qs + 128 * h);
      const __m512i a_hi = _mm512_loadu_si512(y[i].qs + 128 * h + 64);
      isum = _mm512_dpwssd_epi32(isum, _mm512_maddubs_epi16(q_lo, a_lo),
                                 _mm512_permutexvar_epi16(index[2 * h], scales512));
      isum = _mm512_dpwssd_epi32(isum, _mm512_maddubs_epi16(q_hi, a_hi),
                                 _mm512_permutexvar_epi16(index[2 * h + 1], scales512));
    }
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(h2f(x[i].d) * y[i].d), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

}  // namespace

DotBatchFn avx512_dot_batch(DType t) {
  switch (t) {
    case DType::Q4_0: return dot_batch_legacy<BlockQ4_0, 4, 3, false>;
    case DType::Q4_1: return dot_batch_legacy<BlockQ4_1, 4, 0, true>;
    case DType::Q5_0: return dot_batch_legacy<BlockQ5_0, 5, 4, false>;
    case DType::Q5_1: return dot_batch_legacy<BlockQ5_1, 5, 0, true>;
    case DType::Q8_0: return dot_batch_legacy<BlockQ8_0, 8, 7, false>;
    default: return nullptr;
  }
}

DotBatchFn avx512_gemm(DType t) {
  switch (t) {
    case DType::Q4_0: return gemm_legacy<BlockQ4_0, 4, 3, false>;
    case DType::Q4_1: return gemm_legacy<BlockQ4_1, 4, 0, true>;
    case DType::Q5_0: return gemm_legacy<BlockQ5_0, 5, 4, false>;
    case DType::Q5_1: return gemm_legacy<BlockQ5_1, 5, 0, true>;
    case DType::Q8_0: return gemm_legacy<BlockQ8_0, 8, 7, false>;
    default: return avx512_gemm_kquant(t);
  }
}

DotRowsFn avx512_dot_rows(DType t) {
  switch (t) {
    case DType::Q4_0: return dot_rows_legacy<BlockQ4_0, 4, 3, false>;
    case DType::Q4_1: return dot_rows_legacy<BlockQ4_1, 4, 0, true>;
    case DType::Q5_0: return dot_rows_legacy<BlockQ5_0, 5, 4, false>;
    case DType::Q5_1: return dot_rows_legacy<BlockQ5_1, 5, 0, true>;
    case DType::Q8_0: return dot_rows_legacy<BlockQ8_0, 8, 7, false>;
    case DType::Q4_K: return for_each_row<dot_k4<false, BlockQ4_K>>;
    case DType::Q5_K: return for_each_row<dot_k4<true, BlockQ5_K>>;
    case DType::Q6_K: return for_each_row<dot_q6_k>;
    default: return nullptr;
  }
}

}  // namespace ferrum::quant::detail
