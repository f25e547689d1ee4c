// Reference dequantizers: these define the formats. Each expression keeps the operation order of
// the format definition (and this file is compiled with -ffp-contract=off), so results are bit
// for bit those of llama.cpp's dequantize_row_* and gguf-py.
#include <immintrin.h>
#include <cstring>

#include "core/cpu_features.h"
#include "core/error.h"
#include "quant/formats.h"
#include "quant/kernels.h"
#include "quant/quant.h"

namespace ferrum::quant {

namespace {

float h2f(uint16_t h) { return f16_to_f32(h); }

void dequant_q4_0(const BlockQ4_0* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += kQK) {
    const float d = h2f(b[i].d);
    for (int j = 0; j < kQK / 2; ++j) {
      y[j] = float((b[i].qs[j] & 15) - 8) * d;
      y[j + kQK / 2] = float((b[i].qs[j] >> 4) - 8) * d;
    }
  }
}

void dequant_q4_1(const BlockQ4_1* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += kQK) {
    const float d = h2f(b[i].d), m = h2f(b[i].m);
    for (int j = 0; j < kQK / 2; ++j) {
      y[j] = float(b[i].qs[j] & 15) * d + m;
      y[j + kQK / 2] = float(b[i].qs[j] >> 4) * d + m;
    }
  }
}

uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

void dequant_q5_0(const BlockQ5_0* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += kQK) {
    const float d = h2f(b[i].d);
    const uint32_t qh = load_u32(b[i].qh);
    for (int j = 0; j < kQK / 2; ++j) {
      const int lo = (b[i].qs[j] & 15) | (((qh >> j) & 1) << 4);
      const int hi = (b[i].qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
      y[j] = float(lo - 16) * d;
      y[j + kQK / 2] = float(hi - 16) * d;
    }
  }
}

void dequant_q5_1(const BlockQ5_1* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += kQK) {
    const float d = h2f(b[i].d), m = h2f(b[i].m);
    const uint32_t qh = load_u32(b[i].qh);
    for (int j = 0; j < kQK / 2; ++j) {
      const int lo = (b[i].qs[j] & 15) | (((qh >> j) & 1) << 4);
      const int hi = (b[i].qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
      y[j] = float(lo) * d + m;
      y[j + kQK / 2] = float(hi) * d + m;
    }
  }
}

template <class Block>
void dequant_q8(const Block* b, float* y, int64_t nb) {  // Q8_0 and Q8_1
  for (int64_t i = 0; i < nb; ++i, y += kQK) {
    const float d = h2f(b[i].d);
    for (int j = 0; j < kQK; ++j) y[j] = float(b[i].qs[j]) * d;
  }
}

// 32 IQ4 levels (16 bytes of nibbles: low ones, then high ones) times d.
void dequant_iq4_32(const uint8_t* qs, float d, float* y) {
  for (int j = 0; j < 16; ++j) {
    y[j] = d * float(kIq4Values[qs[j] & 15]);
    y[j + 16] = d * float(kIq4Values[qs[j] >> 4]);
  }
}

void dequant_iq4_nl(const BlockIQ4_NL* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += kQK) dequant_iq4_32(b[i].qs, h2f(b[i].d), y);
}

void dequant_iq4_xs(const BlockIQ4_XS* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i)
    for (int s = 0; s < 8; ++s, y += 32) dequant_iq4_32(b[i].qs + 16 * s, h2f(b[i].d) * float(iq4xs_scale(b[i], s)), y);
}

void dequant_q2_k(const BlockQ2_K* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i) {
    const float d = h2f(b[i].d), dmin = h2f(b[i].dmin);
    const uint8_t* q = b[i].qs;
    int sub = 0;
    // Each 32 bytes of qs hold 4 x 32 elements, 2 bits each (lowest bits first); every 16
    // elements have their own scale / min nibble pair.
    for (int half = 0; half < 2; ++half, q += 32) {
      for (int shift = 0; shift < 8; shift += 2) {
        for (int part = 0; part < 2; ++part, ++sub) {
          const float dl = d * float(b[i].scales[sub] & 15);
          const float ml = dmin * float(b[i].scales[sub] >> 4);
          for (int l = 0; l < 16; ++l) *y++ = dl * float((q[16 * part + l] >> shift) & 3) - ml;
        }
      }
    }
  }
}

void dequant_q3_k(const BlockQ3_K* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i) {
    const float d = h2f(b[i].d);
    const uint8_t* q = b[i].qs;
    int sub = 0;
    uint8_t hbit = 1;  // hmask bit of the current 32-element group (8 groups)
    for (int half = 0; half < 2; ++half, q += 32) {
      for (int shift = 0; shift < 8; shift += 2, hbit <<= 1) {
        for (int part = 0; part < 2; ++part, ++sub) {
          const float dl = d * float(q3k_scale(b[i].scales, sub) - 32);
          for (int l = 0; l < 16; ++l) {
            const int k = 16 * part + l;
            const int v = ((q[k] >> shift) & 3) - ((b[i].hmask[k] & hbit) ? 0 : 4);
            *y++ = dl * float(v);
          }
        }
      }
    }
  }
}

void dequant_q4_k(const BlockQ4_K* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i) {
    const float d = h2f(b[i].d), dmin = h2f(b[i].dmin);
    const uint8_t* q = b[i].qs;
    // Each 32 bytes of qs: sub-block 2c in the low nibbles, 2c + 1 in the high ones.
    for (int c = 0; c < 4; ++c, q += 32) {
      int sc, m;
      k4_scale_min(b[i].scales, 2 * c, sc, m);
      const float d1 = d * float(sc), m1 = dmin * float(m);
      k4_scale_min(b[i].scales, 2 * c + 1, sc, m);
      const float d2 = d * float(sc), m2 = dmin * float(m);
      for (int l = 0; l < 32; ++l) *y++ = d1 * float(q[l] & 15) - m1;
      for (int l = 0; l < 32; ++l) *y++ = d2 * float(q[l] >> 4) - m2;
    }
  }
}

void dequant_q5_k(const BlockQ5_K* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i) {
    const float d = h2f(b[i].d), dmin = h2f(b[i].dmin);
    const uint8_t* q = b[i].qs;
    for (int c = 0; c < 4; ++c, q += 32) {
      int sc, m;
      k4_scale_min(b[i].scales, 2 * c, sc, m);
      const float d1 = d * float(sc), m1 = dmin * float(m);
      k4_scale_min(b[i].scales, 2 * c + 1, sc, m);
      const float d2 = d * float(sc), m2 = dmin * float(m);
      const uint8_t lo_bit = uint8_t(1 << (2 * c)), hi_bit = uint8_t(2 << (2 * c));
      for (int l = 0; l < 32; ++l)
        *y++ = d1 * float((q[l] & 15) + ((b[i].qh[l] & lo_bit) ? 16 : 0)) - m1;
      for (int l = 0; l < 32; ++l)
        *y++ = d2 * float((q[l] >> 4) + ((b[i].qh[l] & hi_bit) ? 16 : 0)) - m2;
    }
  }
}

void dequant_q6_k(const BlockQ6_K* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i) {
    const float d = h2f(b[i].d);
    const uint8_t* ql = b[i].ql;
    const uint8_t* qh = b[i].qh;
    const int8_t* sc = b[i].scales;
    // Each half (128 elements) uses 64 bytes of ql and 32 of qh: four 32-element groups take
    // the low / high nibbles of ql[0..31] / ql[32..63] and successive 2-bit fields of qh.
    for (int half = 0; half < 2; ++half, y += 128, ql += 64, qh += 32, sc += 8) {
      for (int l = 0; l < 32; ++l) {
        const int s = l / 16;
        const int q1 = ((ql[l] & 15) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q2 = ((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        y[l] = d * float(sc[s]) * float(q1);
        y[l + 32] = d * float(sc[s + 2]) * float(q2);
        y[l + 64] = d * float(sc[s + 4]) * float(q3);
        y[l + 96] = d * float(sc[s + 6]) * float(q4);
      }
    }
  }
}

void dequant_q8_k(const BlockQ8_K* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, y += kQKK)
    for (int j = 0; j < kQKK; ++j) y[j] = b[i].d * float(b[i].qs[j]);
}

}  // namespace

void dequantize_row(DType t, const void* src, float* dst, int64_t n) {
  const int block = dtype_info(t).block_elems;
  FERRUM_CHECK(n >= 0 && n % block == 0,
               "dequantize: n=" + std::to_string(n) + " is not a multiple of the " +
                   dtype_name(t) + " block size " + std::to_string(block));
  const int64_t nb = n / block;
  switch (t) {
    case DType::F32: std::memcpy(dst, src, size_t(n) * 4); return;
    case DType::F16: {  // prefill dequantizes f16 weights a tile at a time: hot
      const uint16_t* h = static_cast<const uint16_t*>(src);
      static const bool avx512 = cpu_features().avx512f && cpu_features().avx512bw &&
                                 cpu_features().avx512vl && cpu_features().f16c;
      if (avx512) {
        detail::avx512_f16_to_f32(h, dst, n);
        return;
      }
      int64_t i = 0;
#if defined(__F16C__)  // exact, as f16_to_f32 (LoRA adapters kept in f16 convert a block per step)
      static const bool f16c = cpu_features().f16c;
      if (f16c)
        for (; i + 8 <= n; i += 8)
          _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
#endif
      for (; i < n; ++i) dst[i] = f16_to_f32(h[i]);
      return;
    }
    case DType::BF16: {
      const uint16_t* h = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(h[i]);
      return;
    }
    case DType::Q4_0: dequant_q4_0(static_cast<const BlockQ4_0*>(src), dst, nb); return;
    case DType::Q4_1: dequant_q4_1(static_cast<const BlockQ4_1*>(src), dst, nb); return;
    case DType::Q5_0: dequant_q5_0(static_cast<const BlockQ5_0*>(src), dst, nb); return;
    case DType::Q5_1: dequant_q5_1(static_cast<const BlockQ5_1*>(src), dst, nb); return;
    case DType::Q8_0: dequant_q8(static_cast<const BlockQ8_0*>(src), dst, nb); return;
    case DType::Q8_1: dequant_q8(static_cast<const BlockQ8_1*>(src), dst, nb); return;
    case DType::Q2_K: dequant_q2_k(static_cast<const BlockQ2_K*>(src), dst, nb); return;
    case DType::Q3_K: dequant_q3_k(static_cast<const BlockQ3_K*>(src), dst, nb); return;
    case DType::Q4_K: dequant_q4_k(static_cast<const BlockQ4_K*>(src), dst, nb); return;
    case DType::Q5_K: dequant_q5_k(static_cast<const BlockQ5_K*>(src), dst, nb); return;
    case DType::Q6_K: dequant_q6_k(static_cast<const BlockQ6_K*>(src), dst, nb); return;
    case DType::Q8_K: dequant_q8_k(static_cast<const BlockQ8_K*>(src), dst, nb); return;
    case DType::IQ4_NL: dequant_iq4_nl(static_cast<const BlockIQ4_NL*>(src), dst, nb); return;
    case DType::IQ4_XS: dequant_iq4_xs(static_cast<const BlockIQ4_XS*>(src), dst, nb); return;
    default: break;
  }
  throw ValueError(std::string("dequantize: unsupported dtype ") + dtype_name(t));
}

}  // namespace ferrum::quant
