// The CPU backend's row-interleaved layout (WeightLayout::R16) of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
// IQ4_NL, IQ4_XS, every k-quant (Q2_K .. Q6_K), F16 and BF16 weights. A weight in it keeps its
// file type (DType); the layout is recorded beside it (the CPU backend's storage).
//
// Batched decode and prefill dot 16 weight rows at once, one per 32-bit lane, so they need each
// block's quants as "bytes 4k..4k+3 of 16 rows" registers and its scales as 16-lane vectors.
// Transposing GGUF's row-major blocks into that form at every call would take a large part of the
// int8 GEMM's time; the R16 layout stores it once, at load:
//
//   rows in groups of 16; group g starts at row 16g (row stride as in the file format), and
//   holds block b of its 16 rows together, for b = 0 .. nb - 1, in 16 * block_bytes bytes:
//     the 16-bit fields: d of rows 0..15 (32 bytes), then m (Q4_1, Q5_1) / dmin (Q2_K, Q4_K,
//     Q5_K) / scales_h (IQ4_XS);
//     the other bytes: for k = 0, 1, ..., bytes 4k..4k+3 of the 16 rows' rest of the block
//     (64 bytes each), in file order: Q5's qh, then qs; Q4_K / Q5_K's 12 packed scale bytes
//     (k = 0..2), Q5_K's qh, then qs; Q6_K's ql, qh, scales; Q2_K's scales, qs; Q3_K's hmask, qs,
//     scales (the last three's d / dmin, last in the file, are the fields); IQ4_NL's qs; IQ4_XS's
//     scales_l, then qs.
//   Q8_0's quants are stored + 128 (unsigned, as vpdpbusd takes them).
//   Q6_K's 52 dwords (ql 0..31, qh 32..47, scales 48..51) go in the order its kernel first reads
//   them, slot kQ6KSlots[k] for dword k (below): read in file order they are three streams in
//   each super-block, which one thread reads from DRAM far slower than a plain read.
//   F16 / BF16 (blocks of 32 elements, 64 bytes): row r's block whole, at 64 * (r % 16). A
//   decode's row kernel then loads a block's activations once for 16 rows while it reads the
//   weights in address order; in the file layout, the activations loaded again for every
//   short row hold one thread's stream well below a plain read's pace, and here it keeps up
//   with one (quant_dot_bench read). (F32 rows stay in their file layout, where their kernel
//   reads faster than this layout's 256-bit one did.)
//
// Every byte of a block keeps its meaning, so sizes and row strides (at group starts) are those
// of the file format. The legacy types' R16 kernels give their GGUF row kernels' results bit for
// bit; the k-quants' give their GGUF GEMMs' (whose float order their row kernels do not share);
// the IQ4 types have AVX-512 kernels only in R16. The AVX2 R16 kernels (every quantized type) give
// the scalar kernels' bits.
#pragma once
#include <array>
#include <cstdint>

#include "core/dtype.h"

namespace ferrum::quant {

constexpr int64_t kR16Rows = 16;

// Q6_K in R16: the slot of quant dword k of a super-block, in the order the kernel reads them: for
// sub-block s = 0..15 (groups g = 32h + 8q + m, h = s / 8, q = s % 8 / 2, m = 4 (s % 2) + 0..3),
// each group's ql dword 16h + 8 (q % 2) + m and qh dword 32 + 8h + m, then the scale dword
// 48 + s / 4; a dword read again keeps its first slot.
inline constexpr std::array<uint8_t, 52> kQ6KSlots = [] {
  std::array<uint8_t, 52> slot{};
  std::array<bool, 52> placed{};
  int next = 0;
  const auto place = [&](int k) {
    if (!placed[size_t(k)]) slot[size_t(k)] = uint8_t(next++), placed[size_t(k)] = true;
  };
  for (int s = 0; s < 16; ++s) {
    const int h = s / 8, q = s % 8 / 2;
    for (int m = 4 * (s % 2); m < 4 * (s % 2) + 4; ++m) {
      place(16 * h + 8 * (q % 2) + m);
      place(32 + 8 * h + m);
    }
    place(48 + s / 4);
  }
  return slot;
}();

// Whether type t has an R16 layout (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K .. Q6_K, IQ4_NL, IQ4_XS,
// F16, BF16).
bool has_r16_layout(DType t);
// Elements of one block of type t in the R16 layout (a row holds whole blocks): the file's
// block, or 32 for F16 / BF16, whose rows go in 64-byte blocks.
int64_t r16_block_elems(DType t);

// rows (a multiple of 16) rows of n elements of type t at src, in the file's layout -> the R16
// layout at dst (the same number of bytes; no overlap).
void repack_r16(DType t, const void* src, void* dst, int64_t rows, int64_t n);
// Row r of the R16 matrix of type t at w (rows of n elements), back in the file's layout at dst.
void unpack_r16_row(DType t, const void* w, int64_t r, int64_t n, void* dst);

// The C16T layout (WeightLayout::C16T) of a [rows, n] matrix of F32, F16 or BF16: its rows in
// chunks of 16, each chunk transposed ([n][16]) so that column j of 16 rows is one vector, the
// last chunk's missing rows zero (the storage is whole chunks: c16t_elements). Element (row, j)
// lies at c16t_index(row, j, n).
constexpr int64_t kC16TRows = 16;
inline int64_t c16t_index(int64_t row, int64_t j, int64_t n) {
  return (row / kC16TRows * n + j) * kC16TRows + row % kC16TRows;
}
inline int64_t c16t_elements(int64_t rows, int64_t n) { return (rows + kC16TRows - 1) / kC16TRows * kC16TRows * n; }
// A row-major [rows, n] matrix of type t at src -> C16T at dst (c16t_elements of t; no overlap).
void repack_c16t(DType t, const void* src, void* dst, int64_t rows, int64_t n);

}  // namespace ferrum::quant
