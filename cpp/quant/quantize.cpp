// Round-to-nearest reference quantizers. The legacy formats and Q8_K follow llama.cpp's
// quantize_row_*_ref step for step (so their output is the same bytes); the Q2_K..Q6_K ones
// are the simple form of llama.cpp's: each sub-block gets its own (scale, min) from its range,
// those are rounded to the format's 4/6/8-bit codes against one f16 super-block scale, and the
// values are then rounded against the decoded (code * f16 scale) step, without llama.cpp's
// iterative error search. IQ4_NL / IQ4_XS: nearest levels of a block scale set by the largest
// magnitude (the same steps as the writer's in python/ferrum/tools/quantize.py).
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>

#include "core/cpu_features.h"
#include "core/error.h"
#include "quant/formats.h"
#include "quant/kernels.h"
#include "quant/quant.h"

namespace ferrum::quant {

namespace {

uint16_t f2h(float f) { return f32_to_f16(f); }
float h2f(uint16_t h) { return f16_to_f32(h); }
int nearest_int(float x) { return int(std::nearbyint(x)); }  // ties to even, like llama.cpp
// Whether the AVX-512 activation quantizers (byte-identical to the reference ones) can run.
bool avx512_quantizer() {
  static const bool ok = cpu_features().avx512f && cpu_features().avx512bw && cpu_features().avx512vl;
  return ok;
}
int clamp_int(int v, int lo, int hi) { return std::min(hi, std::max(lo, v)); }

// The element of largest magnitude, with its sign (the first one on ties).
float signed_absmax(const float* x, int n) {
  float amax = 0, max = 0;
  for (int j = 0; j < n; ++j)
    if (amax < std::fabs(x[j])) {
      amax = std::fabs(x[j]);
      max = x[j];
    }
  return max;
}

void quant_q4_0(const float* x, BlockQ4_0* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += kQK) {
    const float d = signed_absmax(x, kQK) / -8;  // the extreme value maps to q = 0
    const float id = d != 0 ? 1.0f / d : 0.0f;
    y[i].d = f2h(d);
    for (int j = 0; j < kQK / 2; ++j) {
      const int lo = std::min(15, int(int8_t(x[j] * id + 8.5f)));
      const int hi = std::min(15, int(int8_t(x[j + kQK / 2] * id + 8.5f)));
      y[i].qs[j] = uint8_t(lo | (hi << 4));
    }
  }
}

void quant_q4_1(const float* x, BlockQ4_1* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += kQK) {
    float mn = FLT_MAX, mx = -FLT_MAX;
    for (int j = 0; j < kQK; ++j) mn = std::min(mn, x[j]), mx = std::max(mx, x[j]);
    const float d = (mx - mn) / 15;
    const float id = d != 0 ? 1.0f / d : 0.0f;
    y[i].d = f2h(d);
    y[i].m = f2h(mn);
    for (int j = 0; j < kQK / 2; ++j) {
      const int lo = std::min(15, int(int8_t((x[j] - mn) * id + 0.5f)));
      const int hi = std::min(15, int(int8_t((x[j + kQK / 2] - mn) * id + 0.5f)));
      y[i].qs[j] = uint8_t(lo | (hi << 4));
    }
  }
}

void quant_q5_0(const float* x, BlockQ5_0* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += kQK) {
    const float d = signed_absmax(x, kQK) / -16;
    const float id = d != 0 ? 1.0f / d : 0.0f;
    y[i].d = f2h(d);
    uint32_t qh = 0;
    for (int j = 0; j < kQK / 2; ++j) {
      const int lo = std::min(31, int(int8_t(x[j] * id + 16.5f)));
      const int hi = std::min(31, int(int8_t(x[j + kQK / 2] * id + 16.5f)));
      y[i].qs[j] = uint8_t((lo & 15) | ((hi & 15) << 4));
      qh |= uint32_t(lo >> 4) << j;
      qh |= uint32_t(hi >> 4) << (j + kQK / 2);
    }
    std::memcpy(y[i].qh, &qh, 4);
  }
}

void quant_q5_1(const float* x, BlockQ5_1* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += kQK) {
    float mn = FLT_MAX, mx = -FLT_MAX;
    for (int j = 0; j < kQK; ++j) mn = std::min(mn, x[j]), mx = std::max(mx, x[j]);
    const float d = (mx - mn) / 31;
    const float id = d != 0 ? 1.0f / d : 0.0f;
    y[i].d = f2h(d);
    y[i].m = f2h(mn);
    uint32_t qh = 0;
    for (int j = 0; j < kQK / 2; ++j) {
      const int lo = std::min(31, int(uint8_t((x[j] - mn) * id + 0.5f)));
      const int hi = std::min(31, int(uint8_t((x[j + kQK / 2] - mn) * id + 0.5f)));
      y[i].qs[j] = uint8_t((lo & 15) | ((hi & 15) << 4));
      qh |= uint32_t(lo >> 4) << j;
      qh |= uint32_t(hi >> 4) << (j + kQK / 2);
    }
    std::memcpy(y[i].qh, &qh, 4);
  }
}

// Q8_0 and Q8_1: d = absmax / 127, q = round(x / d) (round half away from zero, as roundf).
template <class Block>
void quant_q8(const float* x, Block* y, int64_t nb, bool store_sum) {
  for (int64_t i = 0; i < nb; ++i, x += kQK) {
    float amax = 0;
    for (int j = 0; j < kQK; ++j) amax = std::max(amax, std::fabs(x[j]));
    const float d = amax / 127;
    const float id = d != 0 ? 1.0f / d : 0.0f;
    int sum = 0;
    for (int j = 0; j < kQK; ++j) {
      y[i].qs[j] = int8_t(std::round(x[j] * id));
      sum += y[i].qs[j];
    }
    y[i].d = f2h(d);
    if constexpr (sizeof(Block) == sizeof(BlockQ8_1))
      if (store_sum) y[i].s = f2h(float(sum) * d);
  }
}

void quant_q8_k(const float* x, BlockQ8_K* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += kQKK) {
    const float max = signed_absmax(x, kQKK);
    std::memset(&y[i], 0, sizeof(BlockQ8_K));
    if (max == 0) continue;
    const float iscale = -127.f / max;
    for (int j = 0; j < kQKK; ++j) y[i].qs[j] = int8_t(std::min(127, nearest_int(iscale * x[j])));
    for (int s = 0; s < kQKK / 16; ++s) {
      int sum = 0;
      for (int l = 0; l < 16; ++l) sum += y[i].qs[16 * s + l];
      y[i].bsums[s] = int16_t(sum);
    }
    y[i].d = 1 / iscale;
  }
}

// Asymmetric sub-block parameters: values map to min + step * q, q in 0..levels, with
// min <= 0 so that it is stored as a non-negative offset.
struct Range {
  float step, neg_min;
};
Range sub_range(const float* x, int n, int levels) {
  float mn = 0, mx = x[0];
  for (int j = 0; j < n; ++j) mn = std::min(mn, x[j]), mx = std::max(mx, x[j]);
  return {(mx - mn) / float(levels), -mn};
}

// Rounds a sub-block's step / offset to `bits`-bit codes against a shared scale = max / code_max.
int scale_code(float v, float super_scale, int code_max) {
  return super_scale > 0 ? clamp_int(nearest_int(v / super_scale), 0, code_max) : 0;
}

void quant_q2_k(const float* x, BlockQ2_K* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += kQKK) {
    Range r[16];
    float max_step = 0, max_min = 0;
    for (int s = 0; s < 16; ++s) {
      r[s] = sub_range(x + 16 * s, 16, 3);
      max_step = std::max(max_step, r[s].step), max_min = std::max(max_min, r[s].neg_min);
    }
    std::memset(&y[i], 0, sizeof(BlockQ2_K));
    y[i].d = f2h(max_step / 15);
    y[i].dmin = f2h(max_min / 15);
    const float d = h2f(y[i].d), dmin = h2f(y[i].dmin);
    for (int s = 0; s < 16; ++s) {
      const int sc = scale_code(r[s].step, d, 15), m = scale_code(r[s].neg_min, dmin, 15);
      y[i].scales[s] = uint8_t(sc | (m << 4));
      const float step = d * float(sc), offset = dmin * float(m);
      // Element e = 128 * half + 32 * field + 16 * part + l sits in bits 2 * field of
      // qs[32 * half + 16 * part + l].
      for (int l = 0; l < 16; ++l) {
        const int e = 16 * s + l;
        const int q = step > 0 ? clamp_int(nearest_int((x[e] + offset) / step), 0, 3) : 0;
        const int half = e / 128, field = (e % 128) / 32, k = e % 32;
        y[i].qs[32 * half + k] |= uint8_t(q << (2 * field));
      }
    }
  }
}

void quant_q3_k(const float* x, BlockQ3_K* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += kQKK) {
    float scale[16], max_scale = 0;
    for (int s = 0; s < 16; ++s) {
      scale[s] = signed_absmax(x + 16 * s, 16) / -4;  // q in -4..3: the extreme maps to -4
      if (std::fabs(scale[s]) > std::fabs(max_scale)) max_scale = scale[s];
    }
    std::memset(&y[i], 0, sizeof(BlockQ3_K));
    if (max_scale == 0) continue;
    const float iscale = -32 / max_scale;
    y[i].d = f2h(1 / iscale);
    const float d = h2f(y[i].d);
    for (int s = 0; s < 16; ++s) {
      const int sc = clamp_int(nearest_int(iscale * scale[s]), -32, 31);
      const int code = sc + 32;  // 6 bits: low nibble in byte s % 8, top 2 bits in byte 8 + s % 4
      y[i].scales[s % 8] |= uint8_t((code & 15) << (s < 8 ? 0 : 4));
      y[i].scales[8 + s % 4] |= uint8_t((code >> 4) << (2 * (s / 4)));
      const float step = d * float(sc);
      for (int l = 0; l < 16; ++l) {
        const int e = 16 * s + l;
        const int q = (step != 0 ? clamp_int(nearest_int(x[e] / step), -4, 3) : 0) + 4;
        const int half = e / 128, field = (e % 128) / 32, k = e % 32;
        y[i].qs[32 * half + k] |= uint8_t((q & 3) << (2 * field));
        y[i].hmask[k] |= uint8_t((q >> 2) << (4 * half + field));
      }
    }
  }
}

// Q4_K / Q5_K share the sub-block layout (8 x 32) and the 12-byte scale / min packing.
void pack_k4_scales(uint8_t* packed, const int* sc, const int* m) {
  std::memset(packed, 0, 12);
  for (int j = 0; j < 8; ++j) {
    if (j < 4) {
      packed[j] |= uint8_t(sc[j]);
      packed[j + 4] |= uint8_t(m[j]);
    } else {
      packed[j + 4] = uint8_t((sc[j] & 15) | ((m[j] & 15) << 4));
      packed[j - 4] |= uint8_t((sc[j] >> 4) << 6);
      packed[j] |= uint8_t((m[j] >> 4) << 6);
    }
  }
}

// Fills q[256] (0..levels) and the packed scales of a Q4_K / Q5_K super-block.
void quant_k4_common(const float* x, int levels, uint16_t& d_out, uint16_t& dmin_out,
                     uint8_t* packed, uint8_t* q) {
  Range r[8];
  float max_step = 0, max_min = 0;
  for (int s = 0; s < 8; ++s) {
    r[s] = sub_range(x + 32 * s, 32, levels);
    max_step = std::max(max_step, r[s].step), max_min = std::max(max_min, r[s].neg_min);
  }
  d_out = f2h(max_step / 63);
  dmin_out = f2h(max_min / 63);
  const float d = h2f(d_out), dmin = h2f(dmin_out);
  int sc[8], m[8];
  for (int s = 0; s < 8; ++s) {
    sc[s] = scale_code(r[s].step, d, 63), m[s] = scale_code(r[s].neg_min, dmin, 63);
    const float step = d * float(sc[s]), offset = dmin * float(m[s]);
    for (int l = 0; l < 32; ++l)
      q[32 * s + l] = uint8_t(
          step > 0 ? clamp_int(nearest_int((x[32 * s + l] + offset) / step), 0, levels) : 0);
  }
  pack_k4_scales(packed, sc, m);
}

void quant_q4_k(const float* x, BlockQ4_K* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += kQKK) {
    uint8_t q[kQKK];
    quant_k4_common(x, 15, y[i].d, y[i].dmin, y[i].scales, q);
    for (int c = 0; c < 4; ++c)
      for (int l = 0; l < 32; ++l)
        y[i].qs[32 * c + l] = uint8_t(q[64 * c + l] | (q[64 * c + 32 + l] << 4));
  }
}

void quant_q5_k(const float* x, BlockQ5_K* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += kQKK) {
    uint8_t q[kQKK];
    quant_k4_common(x, 31, y[i].d, y[i].dmin, y[i].scales, q);
    std::memset(y[i].qh, 0, sizeof(y[i].qh));
    for (int c = 0; c < 4; ++c)
      for (int l = 0; l < 32; ++l) {
        const int lo = q[64 * c + l], hi = q[64 * c + 32 + l];
        y[i].qs[32 * c + l] = uint8_t((lo & 15) | ((hi & 15) << 4));
        y[i].qh[l] |= uint8_t(((lo >> 4) << (2 * c)) | ((hi >> 4) << (2 * c + 1)));
      }
  }
}

void quant_q6_k(const float* x, BlockQ6_K* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += kQKK) {
    float scale[16], max_scale = 0;
    for (int s = 0; s < 16; ++s) {
      scale[s] = signed_absmax(x + 16 * s, 16) / -32;  // q in -32..31
      if (std::fabs(scale[s]) > std::fabs(max_scale)) max_scale = scale[s];
    }
    std::memset(&y[i], 0, sizeof(BlockQ6_K));
    if (max_scale == 0) continue;
    const float iscale = -128 / max_scale;
    y[i].d = f2h(1 / iscale);
    const float d = h2f(y[i].d);
    for (int s = 0; s < 16; ++s) {
      const int sc = std::min(127, nearest_int(iscale * scale[s]));
      y[i].scales[s] = int8_t(sc);
      const float step = d * float(sc);
      for (int l = 0; l < 16; ++l) {
        const int e = 16 * s + l;
        const int q = (step != 0 ? clamp_int(nearest_int(x[e] / step), -32, 31) : 0) + 32;
        // Half h = e / 128; group g = (e % 128) / 32 picks the ql nibble (g >> 1), the ql row
        // (g & 1) and the qh bit pair (2 * g).
        const int h = e / 128, g = (e % 128) / 32, k = e % 32;
        y[i].ql[64 * h + 32 * (g & 1) + k] |= uint8_t((q & 15) << (4 * (g >> 1)));
        y[i].qh[32 * h + k] |= uint8_t((q >> 4) << (2 * g));
      }
    }
  }
}

// IQ4: the level nearest v (v already divided by the block's scale).
int iq4_nearest(float v) {
  int best = 0;
  for (int k = 1; k < 16; ++k)
    if (std::fabs(v - kIq4Values[k]) < std::fabs(v - kIq4Values[best])) best = k;
  return best;
}

// IQ4_NL: the largest magnitude maps to the level -127 (d in f16), every value to its nearest
// level (without llama.cpp's scale search).
void quant_iq4_nl(const float* x, BlockIQ4_NL* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += kQK) {
    y[i].d = f2h(signed_absmax(x, kQK) / -127.0f);
    const float d = h2f(y[i].d), id = d != 0 ? 1.0f / d : 0.0f;
    for (int j = 0; j < kQK / 2; ++j)
      y[i].qs[j] = uint8_t(iq4_nearest(x[j] * id) | (iq4_nearest(x[j + kQK / 2] * id) << 4));
  }
}

// IQ4_XS: each 32-element sub-block's scale maps its largest magnitude to -127; the scales are
// rounded to 6-bit codes against one f16 d (the largest at -32), then every value to its nearest
// level of the decoded sub-block scale.
void quant_iq4_xs(const float* x, BlockIQ4_XS* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, x += kQKK) {
    float scale[8];
    for (int s = 0; s < 8; ++s) scale[s] = signed_absmax(x + 32 * s, 32) / -127.0f;
    const uint16_t dh = f2h(signed_absmax(scale, 8) / -32.0f);
    const float d = h2f(dh);
    y[i].d = dh;
    y[i].scales_h = 0;
    std::memset(y[i].scales_l, 0, sizeof y[i].scales_l);
    for (int s = 0; s < 8; ++s) {
      const int ls = d != 0 ? clamp_int(nearest_int(scale[s] / d), -32, 31) : 0;
      const int code = ls + 32;
      y[i].scales_l[s / 2] |= uint8_t((code & 15) << (4 * (s % 2)));
      y[i].scales_h |= uint16_t((code >> 4) << (2 * s));
      const float eff = d * float(ls), ie = eff != 0 ? 1.0f / eff : 0.0f;
      for (int j = 0; j < 16; ++j)
        y[i].qs[16 * s + j] = uint8_t(iq4_nearest(x[32 * s + j] * ie) | (iq4_nearest(x[32 * s + j + 16] * ie) << 4));
    }
  }
}

}  // namespace

void quantize_row(DType t, const float* src, void* dst, int64_t n) {
  const int block = dtype_info(t).block_elems;
  FERRUM_CHECK(n >= 0 && n % block == 0, "quantize: n=" + std::to_string(n) +
                                             " is not a multiple of the " + dtype_name(t) +
                                             " block size " + std::to_string(block));
  const int64_t nb = n / block;
  switch (t) {
    case DType::F32: std::memcpy(dst, src, size_t(n) * 4); return;
    case DType::F16: {
      uint16_t* h = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) h[i] = f32_to_f16(src[i]);
      return;
    }
    case DType::BF16: {  // the bf16 GEMM's activation type: hot
      uint16_t* h = static_cast<uint16_t*>(dst);
      static const bool avx512 = cpu_features().avx512f && cpu_features().avx512bw && cpu_features().avx512vl;
      if (avx512) detail::avx512_f32_to_bf16(src, h, n);
      else for (int64_t i = 0; i < n; ++i) h[i] = f32_to_bf16(src[i]);
      return;
    }
    case DType::Q4_0: quant_q4_0(src, static_cast<BlockQ4_0*>(dst), nb); return;
    case DType::Q4_1: quant_q4_1(src, static_cast<BlockQ4_1*>(dst), nb); return;
    case DType::Q5_0: quant_q5_0(src, static_cast<BlockQ5_0*>(dst), nb); return;
    case DType::Q5_1: quant_q5_1(src, static_cast<BlockQ5_1*>(dst), nb); return;
    case DType::Q8_0: {  // the activation type of every legacy-format dot kernel: hot
      if (avx512_quantizer()) detail::avx512_quantize_q8_0(src, dst, nb);
      else quant_q8(src, static_cast<BlockQ8_0*>(dst), nb, false);
      return;
    }
    case DType::Q8_1: quant_q8(src, static_cast<BlockQ8_1*>(dst), nb, true); return;
    case DType::Q2_K: quant_q2_k(src, static_cast<BlockQ2_K*>(dst), nb); return;
    case DType::Q3_K: quant_q3_k(src, static_cast<BlockQ3_K*>(dst), nb); return;
    case DType::Q4_K: quant_q4_k(src, static_cast<BlockQ4_K*>(dst), nb); return;
    case DType::Q5_K: quant_q5_k(src, static_cast<BlockQ5_K*>(dst), nb); return;
    case DType::Q6_K: quant_q6_k(src, static_cast<BlockQ6_K*>(dst), nb); return;
    case DType::Q8_K:  // the k-quants' activation type: as hot
      if (avx512_quantizer()) detail::avx512_quantize_q8_k(src, dst, nb);
      else quant_q8_k(src, static_cast<BlockQ8_K*>(dst), nb);
      return;
    case DType::IQ4_NL: quant_iq4_nl(src, static_cast<BlockIQ4_NL*>(dst), nb); return;
    case DType::IQ4_XS: quant_iq4_xs(src, static_cast<BlockIQ4_XS*>(dst), nb); return;
    default: break;
  }
  throw ValueError(std::string("quantize: unsupported dtype ") + dtype_name(t));
}

}  // namespace ferrum::quant
