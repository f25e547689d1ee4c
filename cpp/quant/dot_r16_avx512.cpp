// AVX-512 VNNI kernels for the R16 layouts (quant/repack.h): a block of 16 rows loads as
// vpdpbusd-ready registers and 16-lane scale vectors, so the GEMM (legacy_gemm_avx512.h) reads
// its tiles in place instead of packing them, and the row kernel is that GEMM at T = 1 (no
// horizontal sums). Same float order as the GGUF kernels, hence the same results bit for bit.
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

  // Field f (0: d, 1: m) of block `chunk` in the 16 rows, one per lane.
  FERRUM_AVX512_INLINE static __m512 scales(const char* chunk, int f) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 32 * f)));
  }
  // Elements 4g..4g+3 of block `chunk` in the 16 rows, unsigned. 4-bit: bytes 4j..4j+3 of the
  // qs hold group j in their low nibbles and group 4 + j in the high ones.
  FERRUM_AVX512_INLINE static __m512i quant_group(const char* chunk, int g) {
    if constexpr (kBits == 8) return _mm512_loadu_si512(chunk + kHeader + 64 * g);
    const __m512i v = _mm512_loadu_si512(chunk + kHeader + 64 * (g % 4));
    return _mm512_and_si512(g < 4 ? v : _mm512_srli_epi16(v, 4), _mm512_set1_epi8(15));
  }
};
using R16Q4_0 = R16<BlockQ4_0, 4, 3, false>;
using R16Q4_1 = R16<BlockQ4_1, 4, 0, true>;
using R16Q8_0 = R16<BlockQ8_0, 8, 7, false>;

// Two groups read in place as a GEMM tile (gemm_block's source, see TileSource): the layout is
// the packed form but for the 4-bit formats' nibble split, done as the quants are used.
template <class F>
struct R16Source {
  const char* group[kGemmVecs];
  FERRUM_AVX512_INLINE __m512i q(int64_t b, int g, int v) const { return F::quant_group(group[v] + b * F::kChunk, g); }
  FERRUM_AVX512_INLINE __m512 d(int64_t b, int v) const { return F::scales(group[v] + b * F::kChunk, 0); }
  FERRUM_AVX512_INLINE __m512 m(int64_t b, int v) const { return F::scales(group[v] + b * F::kChunk, 1); }
};

// The GEMM (and batched decode from 2 rows).
template <class F>
FERRUM_AVX512 void gemm_r16(int64_t n, const void* w, size_t w_row_bytes, int64_t rows, const void* act,
                            size_t act_row_bytes, int64_t T, float* out, int64_t ldo) {
  const int64_t nb = n / kQK;
  thread_local LegacyActs acts;
  prepare_legacy_acts<F::kOffset, F::kMin>(nb, act, act_row_bytes, T, acts);
  gemm_tiles<F::kMin>(w, w_row_bytes, nb, rows, acts, T, out, ldo, [&](int64_t r0, int64_t tile_rows) {
    R16Source<F> src;
    for (int vec = 0; vec < kGemmVecs; ++vec)  // a tile of one group repeats it (lanes never stored)
      src.group[vec] = static_cast<const char*>(w) + (r0 + (16 * vec < tile_rows ? 16 * vec : 0)) * w_row_bytes;
    return src;
  });
}

// One activation row: the GEMM at T = 1.
template <class F>
FERRUM_AVX512 void dot_rows_r16(int64_t n, const void* w, size_t w_row_bytes, int64_t rows, const void* act,
                                float* out) {
  gemm_r16<F>(n, w, w_row_bytes, rows, act, 0, 1, out, rows);
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
