// Internal: the row kernels of cpu_kernels.h, compiled twice, as attention_kernel.h is:
// cpu_kernels.cpp holds the baseline copy and hands out a copy per call, cpu_kernels_avx512.cpp
// holds the AVX-512 one (the compiler vectorizes these loops for the file's ISA). Both copies
// compute the same floats in the same order. The functions have internal linkage, so each file
// keeps its own.
#pragma once
#include <cmath>
#include <cstdint>

#include "backend/backend.h"
#include "backend/cpu/fast_math.h"

namespace ferrum::cpu {

struct RowKernels {
  void (*rms_norm_row)(const float* x, const float* w, float eps, float* out, int64_t d);
  void (*rope_head)(float* x, const float* cos, const float* sin, int64_t rot_half, RopeLayout layout);
  void (*silu_mul)(const float* gate, const float* up, float* out, int64_t n);
  float (*dot_f32)(const float* a, const float* b, int64_t n);
  void (*axpy_f32)(float a, const float* x, float* y, int64_t n);
};

// The AVX-512 copy (AVX-512 F/BW/VL CPUs only).
const RowKernels& row_kernels_avx512();

namespace impl {
namespace {

// Two chains of 16 lanes, then hsum.
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

// 16 at a time spelled out: the compiler leaves fast_exp's clamps as branches in a scalar loop
// it vectorizes for AVX2.
void silu_mul(const float* gate, const float* up, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const f32x16 g = load16(gate + i);
    store16(out + i, g / (1.0f + fast_exp(-g)) * load16(up + i));
  }
  for (; i < n; ++i) {
    const float g = gate[i];
    out[i] = g / (1.0f + fast_exp(-g)) * up[i];
  }
}

constexpr RowKernels kRowKernels{rms_norm_row, rope_head, silu_mul, dot_f32, axpy_f32};

}  // namespace
}  // namespace impl
}  // namespace ferrum::cpu
