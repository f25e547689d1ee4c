// Portable dot kernels: the reference the SIMD kernels are tested against. Within a block they
// sum integer products exactly and apply the float scales once per (sub-)block, the same
// factorisation the SIMD kernels use. For the legacy formats (Q4_0 .. Q8_0) the float chain,
// fused multiply-adds spelled out, is also the SIMD kernels': every ISA gives the same bits.
#include <cmath>
#include <cstring>

#include "quant/formats.h"
#include "quant/kernels.h"

namespace ferrum::quant::detail {

namespace {

float h2f(uint16_t h) { return f16_to_f32(h); }

uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

float dot_f32(int64_t n, const void* w, const void* a) {
  const float* x = static_cast<const float*>(w);
  const float* y = static_cast<const float*>(a);
  float sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += x[i] * y[i];
  return sum;
}

float dot_f16(int64_t n, const void* w, const void* a) {
  const uint16_t* x = static_cast<const uint16_t*>(w);
  const float* y = static_cast<const float*>(a);
  float sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += f16_to_f32(x[i]) * y[i];
  return sum;
}

float dot_bf16(int64_t n, const void* w, const void* a) {
  const uint16_t* x = static_cast<const uint16_t*>(w);
  const float* y = static_cast<const float*>(a);
  float sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += bf16_to_f32(x[i]) * y[i];
  return sum;
}

// Legacy formats against Q8_0 activations. `offset` is the zero point subtracted from the
// unsigned quant (8 / 16 for the symmetric types, 0 for the ones with a min).
template <class Block, int kBits, int kOffset, bool kHasMin>
float dot_legacy(int64_t n, const void* w, const void* a) {
  const Block* x = static_cast<const Block*>(w);
  const BlockQ8_0* y = static_cast<const BlockQ8_0*>(a);
  float sum = 0;
  for (int64_t i = 0; i < n / kQK; ++i) {
    uint32_t qh = 0;
    if constexpr (kBits == 5) qh = load_u32(x[i].qh);
    int sum_qa = 0, sum_a = 0;
    for (int j = 0; j < kQK / 2; ++j) {
      int lo = x[i].qs[j] & 15, hi = x[i].qs[j] >> 4;
      if constexpr (kBits == 5) {
        lo |= ((qh >> j) & 1) << 4;
        hi |= ((qh >> (j + 16)) & 1) << 4;
      }
      sum_qa += (lo - kOffset) * y[i].qs[j] + (hi - kOffset) * y[i].qs[j + kQK / 2];
      sum_a += y[i].qs[j] + y[i].qs[j + kQK / 2];
    }
    const float da = h2f(y[i].d);
    sum = std::fma(h2f(x[i].d) * da, float(sum_qa), sum);
    if constexpr (kHasMin) sum = std::fma(h2f(x[i].m) * da, float(sum_a), sum);
  }
  return sum;
}

float dot_q8_0(int64_t n, const void* w, const void* a) {
  const BlockQ8_0* x = static_cast<const BlockQ8_0*>(w);
  const BlockQ8_0* y = static_cast<const BlockQ8_0*>(a);
  float sum = 0;
  for (int64_t i = 0; i < n / kQK; ++i) {
    int s = 0;
    for (int j = 0; j < kQK; ++j) s += x[i].qs[j] * y[i].qs[j];
    sum = std::fma(h2f(x[i].d) * h2f(y[i].d), float(s), sum);
  }
  return sum;
}

// 32 IQ4 levels (16 bytes of nibbles: low ones, then high ones) times 32 activations.
int iq4_dot32(const uint8_t* qs, const int8_t* a) {
  int s = 0;
  for (int j = 0; j < 16; ++j) s += kIq4Values[qs[j] & 15] * a[j] + kIq4Values[qs[j] >> 4] * a[j + 16];
  return s;
}

float dot_iq4_nl(int64_t n, const void* w, const void* a) {
  const BlockIQ4_NL* x = static_cast<const BlockIQ4_NL*>(w);
  const BlockQ8_0* y = static_cast<const BlockQ8_0*>(a);
  float sum = 0;
  for (int64_t i = 0; i < n / kQK; ++i) sum = std::fma(h2f(x[i].d) * h2f(y[i].d), float(iq4_dot32(x[i].qs, y[i].qs)), sum);
  return sum;
}

float dot_iq4_xs(int64_t n, const void* w, const void* a) {
  const BlockIQ4_XS* x = static_cast<const BlockIQ4_XS*>(w);
  const BlockQ8_K* y = static_cast<const BlockQ8_K*>(a);
  float sum = 0;
  for (int64_t i = 0; i < n / kQKK; ++i) {
    int sum_scaled = 0;
    for (int s = 0; s < 8; ++s) sum_scaled += iq4xs_scale(x[i], s) * iq4_dot32(x[i].qs + 16 * s, y[i].qs + 32 * s);
    sum = std::fma(float(sum_scaled), h2f(x[i].d) * y[i].d, sum);
  }
  return sum;
}

// A super-block's float step in the k-quant GEMMs' order (gemm_kquant_avx512.cpp, also the R16
// kernels'): sum + isum * (d * d_a) - min_sum * (dmin * d_a), each fused.
float kquant_step(float sum, int isum, int min_sum, float d, float dmin, float d_a) {
  sum = std::fma(float(isum), d * d_a, sum);
  return std::fma(-float(min_sum), dmin * d_a, sum);
}

// Sum of Q8_K activations over 32-element sub-block j (two bsums).
int bsum32(const BlockQ8_K& y, int j) { return y.bsums[2 * j] + y.bsums[2 * j + 1]; }

float dot_q2_k(int64_t n, const void* w, const void* a) {
  const BlockQ2_K* x = static_cast<const BlockQ2_K*>(w);
  const BlockQ8_K* y = static_cast<const BlockQ8_K*>(a);
  float sum = 0;
  for (int64_t i = 0; i < n / kQKK; ++i) {
    int sum_scaled = 0, sum_min = 0;
    for (int s = 0; s < 16; ++s) {
      int sq = 0;
      for (int l = 0; l < 16; ++l) {
        const int e = 16 * s + l;
        const int q = (x[i].qs[32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3;
        sq += q * y[i].qs[e];
      }
      sum_scaled += (x[i].scales[s] & 15) * sq;
      sum_min += (x[i].scales[s] >> 4) * y[i].bsums[s];
    }
    sum = kquant_step(sum, sum_scaled, sum_min, h2f(x[i].d), h2f(x[i].dmin), y[i].d);
  }
  return sum;
}

float dot_q3_k(int64_t n, const void* w, const void* a) {
  const BlockQ3_K* x = static_cast<const BlockQ3_K*>(w);
  const BlockQ8_K* y = static_cast<const BlockQ8_K*>(a);
  float sum = 0;
  for (int64_t i = 0; i < n / kQKK; ++i) {
    int sum_scaled = 0;
    for (int s = 0; s < 16; ++s) {
      int sq = 0;
      for (int l = 0; l < 16; ++l) {
        const int e = 16 * s + l, half = e / 128, field = (e % 128) / 32, k = e % 32;
        const int low = (x[i].qs[32 * half + k] >> (2 * field)) & 3;
        const int high = (x[i].hmask[k] >> (4 * half + field)) & 1;
        sq += (low - (high ? 0 : 4)) * y[i].qs[e];
      }
      sum_scaled += (q3k_scale(x[i].scales, s) - 32) * sq;
    }
    sum = std::fma(float(sum_scaled), h2f(x[i].d) * y[i].d, sum);
  }
  return sum;
}

template <bool kFiveBit, class Block>
float dot_k4(int64_t n, const void* w, const void* a) {  // Q4_K and Q5_K
  const Block* x = static_cast<const Block*>(w);
  const BlockQ8_K* y = static_cast<const BlockQ8_K*>(a);
  float sum = 0;
  for (int64_t i = 0; i < n / kQKK; ++i) {
    int sum_scaled = 0, sum_min = 0;
    for (int j = 0; j < 8; ++j) {
      int sc, m;
      k4_scale_min(x[i].scales, j, sc, m);
      const int c = j / 2, nibble_shift = 4 * (j % 2);
      int sq = 0;
      for (int l = 0; l < 32; ++l) {
        int q = (x[i].qs[32 * c + l] >> nibble_shift) & 15;
        if constexpr (kFiveBit) q |= ((x[i].qh[l] >> j) & 1) << 4;
        sq += q * y[i].qs[32 * j + l];
      }
      sum_scaled += sc * sq;
      sum_min += m * bsum32(y[i], j);
    }
    sum = kquant_step(sum, sum_scaled, sum_min, h2f(x[i].d), h2f(x[i].dmin), y[i].d);
  }
  return sum;
}

float dot_q6_k(int64_t n, const void* w, const void* a) {
  const BlockQ6_K* x = static_cast<const BlockQ6_K*>(w);
  const BlockQ8_K* y = static_cast<const BlockQ8_K*>(a);
  float sum = 0;
  for (int64_t i = 0; i < n / kQKK; ++i) {
    int sum_scaled = 0;
    for (int s = 0; s < 16; ++s) {
      int sq = 0;
      for (int l = 0; l < 16; ++l) {
        const int e = 16 * s + l, h = e / 128, g = (e % 128) / 32, k = e % 32;
        const int low = (x[i].ql[64 * h + 32 * (g & 1) + k] >> (4 * (g >> 1))) & 15;
        const int high = (x[i].qh[32 * h + k] >> (2 * g)) & 3;
        sq += ((low | (high << 4)) - 32) * y[i].qs[e];
      }
      sum_scaled += x[i].scales[s] * sq;
    }
    sum = std::fma(float(sum_scaled), h2f(x[i].d) * y[i].d, sum);
  }
  return sum;
}

}  // namespace

DType dot_act_type(DType weight_type) {
  switch (weight_type) {
    case DType::F32: case DType::F16: case DType::BF16: return DType::F32;
    // Q4_1 / Q5_1 use Q8_0 too: the activation sum their min term needs is summed exactly from
    // the int8 quants instead of Q8_1's f16-rounded d * sum.
    case DType::Q4_0: case DType::Q4_1: case DType::Q5_0: case DType::Q5_1: case DType::Q8_0:
    case DType::IQ4_NL:
      return DType::Q8_0;
    case DType::Q2_K: case DType::Q3_K: case DType::Q4_K: case DType::Q5_K: case DType::Q6_K:
    case DType::IQ4_XS:
      return DType::Q8_K;
    default:  // no kernel (callers check scalar_dot_rows first)
      return weight_type;
  }
}

namespace {

// A type's row kernel and the GEMM made of it.
struct ScalarKernels {
  DotRowsFn dot_rows;
  DotBatchFn gemm;
};

template <float (*Dot)(int64_t, const void*, const void*)>
ScalarKernels kernels_of() {
  return {for_each_row<Dot>, gemm_by_rows<for_each_row<Dot>>};
}

ScalarKernels scalar_kernels(DType t) {
  switch (t) {
    case DType::F32: return kernels_of<dot_f32>();
    case DType::F16: return kernels_of<dot_f16>();
    case DType::BF16: return kernels_of<dot_bf16>();
    case DType::Q4_0: return kernels_of<dot_legacy<BlockQ4_0, 4, 8, false>>();
    case DType::Q4_1: return kernels_of<dot_legacy<BlockQ4_1, 4, 0, true>>();
    case DType::Q5_0: return kernels_of<dot_legacy<BlockQ5_0, 5, 16, false>>();
    case DType::Q5_1: return kernels_of<dot_legacy<BlockQ5_1, 5, 0, true>>();
    case DType::Q8_0: return kernels_of<dot_q8_0>();
    case DType::IQ4_NL: return kernels_of<dot_iq4_nl>();
    case DType::IQ4_XS: return kernels_of<dot_iq4_xs>();
    case DType::Q2_K: return kernels_of<dot_q2_k>();
    case DType::Q3_K: return kernels_of<dot_q3_k>();
    case DType::Q4_K: return kernels_of<dot_k4<false, BlockQ4_K>>();
    case DType::Q5_K: return kernels_of<dot_k4<true, BlockQ5_K>>();
    case DType::Q6_K: return kernels_of<dot_q6_k>();
    default: return {nullptr, nullptr};
  }
}

}  // namespace

DotRowsFn scalar_dot_rows(DType t) { return scalar_kernels(t).dot_rows; }

// Float weights keep sgemm for prefill below AVX512_BF16 (gemm_kernel).
DotBatchFn scalar_gemm(DType t) { return is_quantized(t) ? scalar_kernels(t).gemm : nullptr; }

}  // namespace ferrum::quant::detail
