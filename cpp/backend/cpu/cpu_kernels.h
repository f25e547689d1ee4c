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

// Writes one head row (head_dim floats) into the pool at slot / kv head.
void kv_store_row(const KvLayer& kv, bool is_k, int64_t slot, int64_t kv_head, const float* row);

}  // namespace ferrum::cpu
