#include "backend/cpu/cpu_kernels.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/fast_math.h"
#include "quant/quant.h"

namespace ferrum::cpu {

// Two chains of 16 lanes, then hsum: the same floats in the same order on every ISA and build.
float dot_f32(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  f32x16 acc0 = {}, acc1 = {};
  for (; i + 32 <= n; i += 32) {
    acc0 = fmadd(load16(a + i), load16(b + i), acc0);
    acc1 = fmadd(load16(a + i + 16), load16(b + i + 16), acc1);
  }
  for (; i + 16 <= n; i += 16) acc0 = fmadd(load16(a + i), load16(b + i), acc0);
  float sum = hsum(acc0 + acc1);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

void axpy_f32(float a, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

void rms_norm_row(const float* x, const float* w, float eps, float* out, int64_t d) {
  float ss = dot_f32(x, x, d);
  float inv = 1.0f / std::sqrt(ss / float(d) + eps);
  for (int64_t i = 0; i < d; ++i) out[i] = x[i] * inv * w[i];
}

void rope_head(float* x, const float* cos, const float* sin, int64_t rot_half, RopeLayout layout) {
  if (layout == RopeLayout::HalfSplit) {
    for (int64_t i = 0; i < rot_half; ++i) {
      float a = x[i], b = x[i + rot_half];
      x[i] = a * cos[i] - b * sin[i];
      x[i + rot_half] = b * cos[i] + a * sin[i];
    }
  } else {
    for (int64_t i = 0; i < rot_half; ++i) {
      float a = x[2 * i], b = x[2 * i + 1];
      x[2 * i] = a * cos[i] - b * sin[i];
      x[2 * i + 1] = b * cos[i] + a * sin[i];
    }
  }
}

void silu_mul(const float* gate, const float* up, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    out[i] = g / (1.0f + fast_exp(-g)) * up[i];
  }
}

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
