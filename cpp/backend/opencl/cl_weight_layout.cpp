#include "backend/opencl/cl_weight_layout.h"

#include <algorithm>
#include <cstring>

namespace ferrum::ocl {

namespace {
// Largest power of two dividing n, at most 16 (0: 16).
int low_bit(size_t n) { return n == 0 ? 16 : int(std::min<size_t>(n & (~n + 1), 16)); }
}  // namespace

const BlockSplit* block_split(DType t) {
  static const BlockSplit q4_0{2, 16}, q4_1{4, 16}, q5_0{6, 16}, q5_1{8, 16}, q8_0{2, 32}, iq4_nl{2, 16},
      q2_k{16, 64}, q3_k{0, 96}, q4_k{16, 128}, q5_k{16, 160}, q6_k{0, 192}, iq4_xs{8, 128};
  switch (t) {
    case DType::Q4_0: return &q4_0;
    case DType::Q4_1: return &q4_1;
    case DType::Q5_0: return &q5_0;
    case DType::Q5_1: return &q5_1;
    case DType::Q8_0: return &q8_0;
    case DType::IQ4_NL: return &iq4_nl;
    case DType::Q2_K: return &q2_k;
    case DType::Q3_K: return &q3_k;
    case DType::Q4_K: return &q4_k;
    case DType::Q5_K: return &q5_k;
    case DType::Q6_K: return &q6_k;
    case DType::IQ4_XS: return &iq4_xs;
    default: return nullptr;
  }
}

int quant_alignment(DType t, size_t row_bytes, bool flat) {
  const BlockSplit* s = block_split(t);
  if (!s) return 16;
  if (flat) return low_bit(row_bytes);  // q_bytes are multiples of 16
  return std::min(low_bit(size_t(dtype_info(t).block_bytes)), low_bit(size_t(s->q_off)));
}

bool flat_layout_pays(DType t, size_t row_bytes) {
  return block_split(t) && quant_alignment(t, row_bytes, true) > quant_alignment(t, row_bytes, false);
}

void flatten_rows(DType t, const uint8_t* src, uint8_t* dst, int64_t rows, size_t row_bytes) {
  const BlockSplit& s = *block_split(t);
  const size_t bb = size_t(dtype_info(t).block_bytes), nb = row_bytes / bb, qb = size_t(s.q_bytes);
  const size_t before = size_t(s.q_off), after = bb - before - qb;
  for (int64_t r = 0; r < rows; ++r, src += row_bytes, dst += row_bytes) {
    uint8_t* header = dst + nb * qb;
    for (size_t b = 0; b < nb; ++b) {
      const uint8_t* blk = src + b * bb;
      std::memcpy(dst + b * qb, blk + before, qb);
      std::memcpy(header, blk, before);
      std::memcpy(header + before, blk + before + qb, after);
      header += before + after;
    }
  }
}

}  // namespace ferrum::ocl
