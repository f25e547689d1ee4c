#include "backend/cpu/cpu_kernels.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/row_kernels.h"
#include "core/cpu_features.h"
#include "quant/quant.h"

namespace ferrum::cpu {

namespace {
const RowKernels& row_kernels() {
  static const RowKernels& k = avx512_copies() ? row_kernels_avx512() : impl::kRowKernels;
  return k;
}
}  // namespace

bool avx512_copies() {
  const CpuFeatures& f = cpu_features();
  return f.avx512f && f.avx512bw && f.avx512vl;
}

float dot_f32(const float* a, const float* b, int64_t n) { return row_kernels().dot_f32(a, b, n); }
void axpy_f32(float a, const float* x, float* y, int64_t n) { row_kernels().axpy_f32(a, x, y, n); }
void rms_norm_row(const float* x, const float* w, float eps, float* out, int64_t d) {
  row_kernels().rms_norm_row(x, w, eps, out, d);
}
void rope_head(float* x, const float* cos, const float* sin, int64_t rot_half, RopeLayout layout) {
  row_kernels().rope_head(x, cos, sin, rot_half, layout);
}
void silu_mul(const float* gate, const float* up, float* out, int64_t n) { row_kernels().silu_mul(gate, up, out, n); }

namespace {

// The pool row of (slot, kv_head); pools are [blocks, kv_heads, block_size, hd].
inline int64_t pool_row(const KvLayer& kv, int64_t slot, int64_t kv_head) {
  int64_t bs = kv.k.dim(2), kvh = kv.k.dim(1);
  return ((slot / bs) * kvh + kv_head) * bs + slot % bs;
}

}  // namespace

void kv_store_row(const KvLayer& kv, bool is_k, int64_t slot, int64_t kv_head, const float* row) {
  const Tensor& pool = is_k ? kv.k : kv.v;
  const int64_t hd = pool.dim(3), r = pool_row(kv, slot, kv_head);
  const bool panels = is_k && k_in_panels(kv);
  const int64_t at = row_start(r, hd, panels), step = row_stride(panels);
  switch (pool.dtype) {
    case DType::F32: {
      float* dst = host_ptr<float>(pool) + at;
      for (int64_t i = 0; i < hd; ++i) dst[i * step] = row[i];
      break;
    }
    case DType::F16: {
      uint16_t* dst = host_ptr<uint16_t>(pool) + at;
      int64_t i = 0;
#if defined(__F16C__)  // round to nearest even, as f32_to_f16 (a NaN may keep more payload)
      for (; i + 8 <= hd; i += 8) {
        const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(row + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        if (step == 1) {
          _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
          continue;
        }
        alignas(16) uint16_t e[8];
        _mm_store_si128(reinterpret_cast<__m128i*>(e), h);
        for (int64_t j = 0; j < 8; ++j) dst[(i + j) * step] = e[j];
      }
#endif
      for (; i < hd; ++i) dst[i * step] = f32_to_f16(row[i]);
      break;
    }
    case DType::I8: {
      // Symmetric int8 with one scale per row: the row's max magnitude maps to 127.
      float amax = 0.0f;
      for (int64_t i = 0; i < hd; ++i) amax = std::max(amax, std::fabs(row[i]));
      float scale = amax / 127.0f;
      float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
      int8_t* dst = host_ptr<int8_t>(pool) + at;
      for (int64_t i = 0; i < hd; ++i) dst[i * step] = int8_t(std::lrint(row[i] * inv));
      host_ptr<float>(is_k ? kv.k_scale : kv.v_scale)[r] = scale;
      break;
    }
    default:
      break;
  }
}

}  // namespace ferrum::cpu
