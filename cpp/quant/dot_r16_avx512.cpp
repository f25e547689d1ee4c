// AVX-512 VNNI kernels for the R16 layouts (quant/repack.h): a block of 16 rows loads as
// vpdpbusd-ready registers and 16-lane scale vectors, so the row kernel needs no horizontal
// sums and the GEMM's tile packing is a few unpacks per block. Same float order as the GGUF
// kernels (legacy_gemm_avx512.h), hence the same results bit for bit.
#include "quant/kernels.h"
#include "quant/legacy_gemm_avx512.h"
#include "quant/repack.h"

namespace ferrum::quant::detail {

namespace {

// What a kernel needs to know of one R16 type.
template <class Block, int kBits, int kOffsetShift, bool kHasMin>
struct R16 {
  static constexpr int kChunk = int(kR16Rows * sizeof(Block));  // block b of a group's 16 rows
  static constexpr int kHeader = kHasMin ? 64 : 32;               // the f16 fields
  static constexpr int kOffset = kOffsetShift;
  static constexpr bool kMin = kHasMin;

  // Block b of a group: q[g] = elements 4g..4g+3 of the 16 rows (unsigned), d / m per lane.
  FERRUM_AVX512_INLINE static void unpack(const char* chunk, __m512i q[8], __m512& d, __m512& m) {
    d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk)));
    m = kHasMin ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 32))) : d;
    const char* qs = chunk + kHeader;
    if constexpr (kBits == 8) {
      for (int g = 0; g < 8; ++g) q[g] = _mm512_loadu_si512(qs + 64 * g);
    } else {  // qs bytes 4j..4j+3: group j in the low nibbles, group 4 + j in the high ones
      const __m512i low4 = _mm512_set1_epi8(15);
      for (int j = 0; j < 4; ++j) {
        const __m512i v = _mm512_loadu_si512(qs + 64 * j);
        q[j] = _mm512_and_si512(v, low4);
        q[4 + j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      }
    }
  }
};
using R16Q4_0 = R16<BlockQ4_0, 4, 3, false>;
using R16Q4_1 = R16<BlockQ4_1, 4, 0, true>;
using R16Q8_0 = R16<BlockQ8_0, 8, 7, false>;

// One activation row against `rows` rows (from a group start): 16 rows per pass, one per lane.
template <class F>
FERRUM_AVX512 void dot_rows_r16(int64_t n, const void* w, size_t w_row_bytes, int64_t rows,
                                const void* act, float* out) {
  const int64_t nb = n / kQK;
  thread_local LegacyActs acts;
  prepare_legacy_acts<F::kOffset, F::kMin>(nb, act, 0, 1, acts);
  const BlockQ8_0* y = acts.rows[0];
  const int64_t group_bytes = kR16Rows * int64_t(w_row_bytes);
  prefetch_share(static_cast<const char*>(w), std::min<int64_t>(rows, 2 * kR16Rows) * int64_t(w_row_bytes), 0, 1);
  for (int64_t r0 = 0; r0 < rows; r0 += kR16Rows) {
    const char* group = static_cast<const char*>(w) + r0 * w_row_bytes;
    // The group after next, a share per block (prefetch_share: the same lead as the GGUF kernels).
    const int64_t ahead_bytes = r0 + 3 * kR16Rows <= rows ? group_bytes : 0;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      prefetch_share(group + 2 * group_bytes, ahead_bytes, b, nb);
      __m512i q[8];
      __m512 d, m;
      F::unpack(group + b * F::kChunk, q, d, m);
      __m512i isum = _mm512_set1_epi32(acts.offsets[size_t(b)]);
      for (int g = 0; g < 8; ++g) {
        int32_t a4;
        std::memcpy(&a4, y[b].qs + 4 * g, 4);
        isum = _mm512_dpbusd_epi32(isum, q[g], _mm512_set1_epi32(a4));
      }
      acc = block_step<F::kMin>(acc, isum, d, m, acts.scales[size_t(b)], F::kMin ? acts.min_terms[size_t(b)] : 0.0f);
    }
    const int64_t left = std::min<int64_t>(kR16Rows, rows - r0);
    _mm512_mask_storeu_ps(out + r0, __mmask16((1u << left) - 1), acc);
  }
}

// The GEMM (and batched decode from 2 rows): a tile is two groups unpacked.
template <class F>
FERRUM_AVX512 void gemm_r16(int64_t n, const void* w, size_t w_row_bytes, int64_t rows, const void* act,
                            size_t act_row_bytes, int64_t T, float* out, int64_t ldo) {
  const int64_t nb = n / kQK;
  thread_local PackedTile tile;
  thread_local LegacyActs acts;
  prepare_legacy_acts<F::kOffset, F::kMin>(nb, act, act_row_bytes, T, acts);
  tile.quants.resize(size_t(nb * 8 * kGemmVecs));
  tile.scales.resize(size_t(nb * kGemmRows));
  tile.mins.resize(F::kMin ? size_t(nb * kGemmRows) : 0);
  gemm_tiles<F::kMin>(w, w_row_bytes, nb, rows, acts, T, out, ldo, tile, [&](int64_t r0, int64_t tile_rows, PackedTile& t) {
    const char* tile_start = static_cast<const char*>(w) + r0 * w_row_bytes;
    for (int vec = 0; vec < kGemmVecs; ++vec) {
      // A tile of one group repeats it in the second (those lanes are never stored).
      const char* group = tile_start + (16 * vec < tile_rows ? 16 * vec : 0) * w_row_bytes;
      for (int64_t b = 0; b < nb; ++b) {
        __m512i q[8];
        __m512 d, m;
        F::unpack(group + b * F::kChunk, q, d, m);
        for (int g = 0; g < 8; ++g) t.quants[size_t((b * 8 + g) * kGemmVecs + vec)] = q[g];
        _mm512_storeu_ps(&t.scales[size_t(b * kGemmRows + 16 * vec)], d);
        if constexpr (F::kMin) _mm512_storeu_ps(&t.mins[size_t(b * kGemmRows + 16 * vec)], m);
      }
    }
  });
}

}  // namespace

DotRowsFn avx512_r16_dot_rows(DType t) {
  switch (t) {
    case DType::Q4_0_R16: return dot_rows_r16<R16Q4_0>;
    case DType::Q4_1_R16: return dot_rows_r16<R16Q4_1>;
    case DType::Q8_0_R16: return dot_rows_r16<R16Q8_0>;
    default: return nullptr;
  }
}

DotBatchFn avx512_r16_gemm(DType t) {
  switch (t) {
    case DType::Q4_0_R16: return gemm_r16<R16Q4_0>;
    case DType::Q4_1_R16: return gemm_r16<R16Q4_1>;
    case DType::Q8_0_R16: return gemm_r16<R16Q8_0>;
    default: return nullptr;
  }
}

}  // namespace ferrum::quant::detail
