#include "quant/repack.h"

#include <cstring>
#include <vector>

#include "core/error.h"
#include "quant/formats.h"
#include "quant/quant.h"

namespace ferrum::quant {

namespace {

// One file type's block as the R16 layout sees it: `fields` 16-bit fields (f16 scales; IQ4_XS's
// scales_h) and the quant bytes (the rest), the fields first in the file but for Q2_K, Q3_K and Q6_K.
struct BlockShape {
  int fields, block_bytes;
  uint32_t quant_xor;        // Q8_0: + 128 in every byte
  bool fields_last = false;  // Q2_K, Q3_K, Q6_K: d (and dmin) follow the quants
  bool whole = false;        // F16 / BF16: a row's 64-byte block stays whole, at lane * 64
  const uint8_t* slots = nullptr;  // Q6_K: quant dword k goes to slot slots[k] (else k)
  int header() const { return 32 * fields; }
  int slot(int k) const { return slots ? slots[k] : k; }
  int field_at(int k) const { return (fields_last ? block_bytes - 2 * fields : 0) + 2 * k; }
  int quant_at(int k) const { return (fields_last ? 0 : 2 * fields) + 4 * k; }
};

// Every type with an R16 layout, and how the layout sees its block.
struct R16Type {
  DType type;
  BlockShape shape;
};
const R16Type kR16Types[] = {
    {DType::Q4_0, {1, int(sizeof(BlockQ4_0)), 0}},
    {DType::Q4_1, {2, int(sizeof(BlockQ4_1)), 0}},
    {DType::Q5_0, {1, int(sizeof(BlockQ5_0)), 0}},  // qh, then qs, as quant bytes
    {DType::Q5_1, {2, int(sizeof(BlockQ5_1)), 0}},
    {DType::Q8_0, {1, int(sizeof(BlockQ8_0)), 0x80808080u}},
    {DType::Q4_K, {2, int(sizeof(BlockQ4_K)), 0}},        // d, dmin; scales, qs
    {DType::Q5_K, {2, int(sizeof(BlockQ5_K)), 0}},        // d, dmin; scales, qh, qs
    {DType::Q6_K, {1, int(sizeof(BlockQ6_K)), 0, true, false, kQ6KSlots.data()}},  // ql, qh, scales; d
    {DType::Q2_K, {2, int(sizeof(BlockQ2_K)), 0, true}},  // scales, qs; d, dmin
    {DType::Q3_K, {1, int(sizeof(BlockQ3_K)), 0, true}},  // hmask, qs, scales; d
    {DType::IQ4_NL, {1, int(sizeof(BlockIQ4_NL)), 0}},    // d; qs
    {DType::IQ4_XS, {2, int(sizeof(BlockIQ4_XS)), 0}},    // d, scales_h; scales_l, qs
    {DType::F16, {0, 64, 0, false, true}},
    {DType::BF16, {0, 64, 0, false, true}},
};

// The entry of type t; nullptr if t has no R16 layout.
const R16Type* find_r16(DType t) {
  for (const R16Type& e : kR16Types)
    if (e.type == t) return &e;
  return nullptr;
}

BlockShape block_shape(DType t) {
  const R16Type* e = find_r16(t);
  if (!e) throw ValueError(std::string("no R16 layout for dtype ") + dtype_name(t));
  return e->shape;
}

// Copies a block between its file layout and lane `lane` of an R16 chunk, piece by piece: each
// f16 field, then each 4 quant bytes.
void move_block(const BlockShape& s, int lane, const uint8_t* from, uint8_t* to, bool to_chunk) {
  if (s.whole) {
    std::memcpy(to + (to_chunk ? lane * s.block_bytes : 0), from + (to_chunk ? 0 : lane * s.block_bytes), size_t(s.block_bytes));
    return;
  }
  auto piece = [&](int file_at, int chunk_at, size_t bytes, uint32_t x) {
    uint32_t v = 0;
    std::memcpy(&v, from + (to_chunk ? file_at : chunk_at), bytes);
    v ^= x;
    std::memcpy(to + (to_chunk ? chunk_at : file_at), &v, bytes);
  };
  for (int k = 0; k < s.fields; ++k) piece(s.field_at(k), 32 * k + 2 * lane, 2, 0);
  for (int k = 0; k < (s.block_bytes - 2 * s.fields) / 4; ++k)
    piece(s.quant_at(k), s.header() + 64 * s.slot(k) + 4 * lane, 4, s.quant_xor);
}

}  // namespace

bool has_r16_layout(DType t) { return find_r16(t) != nullptr; }

int64_t r16_block_elems(DType t) {
  const BlockShape s = block_shape(t);
  return s.whole ? s.block_bytes / dtype_info(t).block_bytes : dtype_info(t).block_elems;
}

void repack_r16(DType t, const void* src, void* dst, int64_t rows, int64_t n) {
  const BlockShape s = block_shape(t);
  const int64_t block_elems = r16_block_elems(t);
  FERRUM_CHECK(rows % kR16Rows == 0 && n % block_elems == 0, "repack_r16: rows must be a multiple of 16");
  const int64_t nb = n / block_elems, row_bytes = nb * s.block_bytes;
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* row = static_cast<const uint8_t*>(src) + r * row_bytes;
    uint8_t* group = static_cast<uint8_t*>(dst) + (r - r % kR16Rows) * row_bytes;
    for (int64_t b = 0; b < nb; ++b)
      move_block(s, int(r % kR16Rows), row + b * s.block_bytes, group + b * kR16Rows * s.block_bytes, true);
  }
}

void unpack_r16_row(DType t, const void* w, int64_t r, int64_t n, void* dst) {
  const BlockShape s = block_shape(t);
  const int64_t nb = n / r16_block_elems(t), row_bytes = nb * s.block_bytes;
  const uint8_t* group = static_cast<const uint8_t*>(w) + (r - r % kR16Rows) * row_bytes;
  for (int64_t b = 0; b < nb; ++b)
    move_block(s, int(r % kR16Rows), group + b * kR16Rows * s.block_bytes,
               static_cast<uint8_t*>(dst) + b * s.block_bytes, false);
}

void repack_c16t(DType t, const void* src, void* dst, int64_t rows, int64_t n) {
  FERRUM_CHECK(t == DType::F32 || t == DType::F16 || t == DType::BF16, "repack_c16t: a float type");
  const size_t elem = dtype_bytes(t, 1);
  std::memset(dst, 0, size_t(c16t_elements(rows, n)) * elem);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < n; ++j)
      std::memcpy(static_cast<char*>(dst) + size_t(c16t_index(r, j, n)) * elem,
                  static_cast<const char*>(src) + size_t(r * n + j) * elem, elem);
}

void dequantize_rows(DType t, WeightLayout layout, const void* w, int64_t r0, int64_t rows, int64_t n,
                     float* dst) {
  const size_t row_bytes = dtype_bytes(t, n);
  if (layout == WeightLayout::Plain) {
    for (int64_t r = 0; r < rows; ++r) dequantize_row(t, static_cast<const char*>(w) + (r0 + r) * row_bytes, dst + r * n, n);
    return;
  }
  if (layout == WeightLayout::C16T) {
    const size_t elem = row_bytes / size_t(n);
    std::vector<char> row(row_bytes);
    for (int64_t r = r0; r < r0 + rows; ++r) {
      for (int64_t j = 0; j < n; ++j)
        std::memcpy(row.data() + size_t(j) * elem, static_cast<const char*>(w) + size_t(c16t_index(r, j, n)) * elem,
                    elem);
      dequantize_row(t, row.data(), dst + (r - r0) * n, n);
    }
    return;
  }
  thread_local std::vector<char> row;
  row.resize(row_bytes);
  for (int64_t r = 0; r < rows; ++r) {
    unpack_r16_row(t, w, r0 + r, n, row.data());
    dequantize_row(t, row.data(), dst + r * n, n);
  }
}

}  // namespace ferrum::quant
