// Where a weight row's quants sit, for the gpu family's wide loads (kernels/gpu_weights.cl, whose
// W_Q_OFF / W_Q_BYTES per type are the table in cl_weight_layout.cpp). The flat row layout keeps
// each row's bytes but puts its blocks' quants first and their headers (scales, mins) after, so
// a row whose size is a multiple of 16 has its quants 16-byte aligned; the backend repacks the
// types whose GGUF blocks leave them only 2- (or 4-) byte aligned.
#pragma once
#include <cstddef>
#include <cstdint>

#include "core/dtype.h"

namespace ferrum::ocl {

// The quants of a block: bytes [q_off, q_off + q_bytes).
struct BlockSplit {
  int q_off, q_bytes;
};
// Null for the types without blocks (floats) or without gpu kernels.
const BlockSplit* block_split(DType t);

// The alignment in bytes (2 .. 16) of every block's quants in rows of row_bytes bytes (row
// starts are multiples of row_bytes from a well-aligned buffer).
int quant_alignment(DType t, size_t row_bytes, bool flat);
// Whether flat rows of this type align its quants more than GGUF rows do.
bool flat_layout_pays(DType t, size_t row_bytes);

// rows GGUF rows at src -> flat rows at dst (row_bytes each; src and dst must not overlap).
void flatten_rows(DType t, const uint8_t* src, uint8_t* dst, int64_t rows, size_t row_bytes);

}  // namespace ferrum::ocl
