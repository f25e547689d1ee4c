// Row kernels of the CPU backend. Each works on a range of rows so the stream can split a
// command across threads; they assume validated shapes (backend/op_checks.h).
#pragma once
#include <cstdint>

#include "backend/backend.h"

namespace ferrum::cpu {

void rms_norm_row(const float* x, const float* w, float eps, float* out, int64_t d);
void rope_head(float* x, const float* cos, const float* sin, int64_t rot_half, RopeLayout layout);
void silu_mul(const float* gate, const float* up, float* out, int64_t n);
float dot_f32(const float* a, const float* b, int64_t n);
void axpy_f32(float a, const float* x, float* y, int64_t n);  // y += a * x
// The five above, and paged attention, have a copy compiled for AVX-512 (files *_avx512*): run
// where the CPU reports AVX-512 F/BW/VL, FERRUM_CPU_ISA permitting.
bool avx512_copies();

// K pools whose block size is a multiple of kKeyPanel keep their rows in panels of kKeyPanel
// consecutive rows stored dimension-major: element d of row r at (r / 16 * hd + d) * 16 + r % 16.
// Attention then reads dimension d of 16 keys as one vector instead of transposing every key
// block. V pools, and K pools of other block sizes, hold plain rows.
constexpr int64_t kKeyPanel = 16;
inline bool k_in_panels(const KvLayer& kv) { return kv.block_size() % kKeyPanel == 0; }
// Index of element 0 of pool row `row` and the distance between its elements.
inline int64_t row_start(int64_t row, int64_t hd, bool panels) {
  return panels ? row / kKeyPanel * kKeyPanel * hd + row % kKeyPanel : row * hd;
}
inline int64_t row_stride(bool panels) { return panels ? kKeyPanel : 1; }

// Writes one head row (head_dim floats) into the pool at slot / kv head.
void kv_store_row(const KvLayer& kv, bool is_k, int64_t slot, int64_t kv_head, const float* row);

}  // namespace ferrum::cpu
