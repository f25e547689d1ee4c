// The LoRA shrink and expand kernels (cpu_lora.cpp) as function pointers, so that a copy for
// AVX-512 (cpu_lora_avx512.cpp), computing the same floats in the same order on twice the lanes,
// can stand in for the AVX2 one: a row's result is the same bits on either.
#pragma once
#include <cstdint>

#include "core/dtype.h"

namespace ferrum::cpu {

// out[r][i] = x[r] . a[i] for R rows x[r] and n (1 .. 4) rows a[i] (K apart, stored as f32, f16
// or bf16): each product one 8-lane FMA chain over k, its lanes summed as
// ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)), then the tail (K % 8) fused in, in order.
using LoraShrinkFn = void (*)(const float* const* x, const uint8_t* a, int64_t K, float* const* out);
// out[r][n] += scale[r] * sum_j v[r][j] b[j][n] for R rows and the first `width` (<= 16) columns
// n of one 16-column chunk of B^T, b [rank][16] (f32, f16 or bf16): for each column one FMA chain
// over j from 0, then one FMA with the scale.
using LoraExpandFn = void (*)(const float* const* v, const uint8_t* b, int64_t rank, int64_t width,
                              const float* scale, float* const* out);

struct LoraKernels {
  int shrink_rows, expand_rows;  // the rows of a block call (the rest go one at a time)
  LoraShrinkFn (*shrink)(DType a, int rows, int64_t n);  // rows: shrink_rows or 1
  LoraExpandFn (*expand)(DType b, int rows);             // rows: expand_rows or 1
};

const LoraKernels& lora_kernels_avx2();
// The AVX-512 copy: only where the CPU reports AVX-512 F/BW/VL (avx512_copies()).
const LoraKernels& lora_kernels_avx512();

}  // namespace ferrum::cpu
