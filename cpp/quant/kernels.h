// Internal: the per-ISA dot kernel tables that dot_kernel.cpp dispatches between.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "core/dtype.h"
#include "quant/quant.h"

namespace ferrum::quant::detail {

using DotRowsFn = void (*)(int64_t n, const void* w, size_t w_row_bytes, int64_t rows,
                           const void* act, float* out);

// The Q8_0 quantizer (nb blocks), byte-identical to quantize_row's reference; AVX-512 F/BW/VL
// only (quantize_row picks it when the CPU has them).
void avx512_quantize_q8_0(const float* x, void* dst, int64_t nb);
// The same for Q8_K (nb super-blocks).
void avx512_quantize_q8_k(const float* x, void* dst, int64_t nb);

// Batched kernels (nullptr where there is none); only with the ISA present.
DotBatchFn avx512_dot_batch(DType weight_type);
DotBatchFn avx512_gemm(DType weight_type);
DotBatchFn avx512_gemm_kquant(DType weight_type);  // Q2_K .. Q6_K; avx512_gemm returns it
// Weights of type weight_type in the R16 layout (dot_r16_avx512.cpp). Their GEMM is also their
// batched decode kernel, from 2 rows.
DotRowsFn avx512_r16_dot_rows(DType weight_type);
DotBatchFn avx512_r16_gemm(DType weight_type);
// F16 / BF16 weights in the R16 layout: their row kernels (float_r16_avx512.cpp;
// avx512_r16_dot_rows returns them), and F16's batched row kernel (a verify step, a batch of
// decodes), equal to its row kernel bit for bit (nullptr for BF16). Their GEMM is
// avx512_float_gemm's.
DotRowsFn avx512_float_r16_dot_rows(DType weight_type);
DotBatchFn avx512_float_r16_dot_batch(DType weight_type);
// The float-weight GEMMs (gemm_float_avx512.cpp), over the file layout (F32, F16, BF16) and the
// R16 one (F16, BF16), nullptr for other types: BF16 weights take bf16 activations, F16 / F32
// weights f32 ones. AVX-512 F/BW/VL + F16C + BF16 only.
DotBatchFn avx512_float_gemm(DType weight_type, WeightLayout layout);

// f16 -> f32 and f32 -> bf16, bit-identical to the scalar reference (signaling NaNs aside, see
// convert_avx512.cpp); AVX-512 F/BW/VL + F16C only.
void avx512_f16_to_f32(const uint16_t* src, float* dst, int64_t n);
void avx512_f32_to_bf16(const float* src, uint16_t* dst, int64_t n);

// The activation format each weight type is dotted with (the same for every ISA).
DType dot_act_type(DType weight_type);

// nullptr where that ISA file has no kernel for the type. The SIMD tables must only be called
// when cpu_features() reports the ISA.
DotRowsFn scalar_dot_rows(DType weight_type);
DotRowsFn avx2_dot_rows(DType weight_type);
DotRowsFn avx512_dot_rows(DType weight_type);

// The GEMMs of the ISAs below AVX-512 VNNI, for the quantized types: each equals its ISA's row
// kernel bit for bit, whatever T (nullptr for other types). The scalar one runs the row kernel
// over tiles of weight rows (gemm_by_rows).
DotBatchFn scalar_gemm(DType weight_type);
DotBatchFn avx2_gemm(DType weight_type);

// The AVX2 int8 kernels of one weight type: a GEMM and its single-activation-row case, the row
// kernel ({nullptr, nullptr} where the file has none): gemm_legacy_avx2.cpp for the types dotted
// with Q8_0 activations, gemm_kquant_avx2.cpp for those dotted with Q8_K ones.
struct Avx2Kernels {
  DotRowsFn dot_rows;
  DotBatchFn gemm;
};
Avx2Kernels avx2_q8_0_kernels(DType weight_type);
// The AVX2 kernels in the R16 layout (dot_r16_avx2.cpp: the legacy types; nullptr for types
// without one): the scalar float order, so every ISA's bits; the GEMM is also the batched decode
// kernel. The k-quants' and IQ4_XS's (dot_r16_kquant_avx2.cpp) come through
// avx2_r16_kquant_kernels.
DotRowsFn avx2_r16_dot_rows(DType weight_type);
DotBatchFn avx2_r16_gemm(DType weight_type);
Avx2Kernels avx2_r16_kquant_kernels(DType weight_type);
Avx2Kernels avx2_q8_k_kernels(DType weight_type);

// Applies a one-row dot function to each of `rows` rows.
template <float (*DotRow)(int64_t, const void*, const void*)>
void for_each_row(int64_t n, const void* w, size_t w_row_bytes, int64_t rows, const void* act,
                  float* out) {
  const char* row = static_cast<const char*>(w);
  for (int64_t r = 0; r < rows; ++r, row += w_row_bytes) out[r] = DotRow(n, row, act);
}

// A GEMM from a row kernel: tiles of weight rows, each dotted with every activation row while
// it stays in L1; a result is the row kernel's.
template <DotRowsFn kDotRows>
void gemm_by_rows(int64_t n, const void* w, size_t w_row_bytes, int64_t rows, const void* act, size_t act_row_bytes,
                  int64_t T, float* out, int64_t ldo) {
  constexpr size_t kTileBytes = 16 * 1024;
  const int64_t tile = std::max<int64_t>(1, int64_t(kTileBytes / w_row_bytes));
  for (int64_t r0 = 0; r0 < rows; r0 += tile)
    for (int64_t t = 0; t < T; ++t)
      kDotRows(n, static_cast<const char*>(w) + r0 * w_row_bytes, w_row_bytes, std::min(tile, rows - r0),
               static_cast<const char*>(act) + t * act_row_bytes, out + t * ldo + r0);
}

}  // namespace ferrum::quant::detail
