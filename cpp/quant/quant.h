// GGUF block formats: the reference (de)quantizers, which define the formats, and the fast dot
// kernels the CPU backend's linear op is built from.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/dtype.h"

namespace ferrum::quant {

// How a weight matrix's rows lie in memory: as the file stores them (Plain), or in the CPU
// backend's own interleaving of the same type's blocks (R16: 16 rows at a time, the same bytes
// per row in another order; repack.h). A kernel is chosen by the weight's type and layout.
// C16T (F32 / F16 / BF16 only; repack.h): the rows in chunks of 16, each chunk transposed, a
// LoRA update's B as the CPU's expand reads it.
enum class WeightLayout : uint8_t { Plain, R16, C16T };

// Format definition: n elements (a multiple of the block size) of type t -> f32.
// Supports F32, F16, BF16 and every quantized DType.
void dequantize_row(DType t, const void* src, float* dst, int64_t n);
// Rows r0 .. r0 + rows - 1 of a weight matrix at w (rows of n elements of type t, in `layout`)
// -> f32 dst [rows, n].
void dequantize_rows(DType t, WeightLayout layout, const void* w, int64_t r0, int64_t rows, int64_t n,
                     float* dst);

// Round-to-nearest quantization of n floats into type t (the activation types Q8_0 / Q8_1 /
// Q8_K, plus F16 / BF16 / F32 and the weight types the test-model writer uses).
void quantize_row(DType t, const float* src, void* dst, int64_t n);

// out = dot(w_row, act_row) over n elements, where w_row is in the weight type and act_row was
// produced by quantize_row(act_type, ...). act_type is what makes the dot fast for that weight
// type (Q8_0 for Q4_0/Q8_0..., Q8_K for k-quants, F32 for float weights).
// dot_rows computes `rows` consecutive weight rows (row stride w_row_bytes) against one
// activation row: out[r] = dot(w + r * w_row_bytes, act).
struct DotKernel {
  DType act_type;
  void (*dot_rows)(int64_t n, const void* w, size_t w_row_bytes, int64_t rows,
                   const void* act, float* out);
  const char* isa;  // "avx512", "avx2", "scalar": what was chosen at run time
};

// The fastest kernel this CPU supports for weights of type t in that layout; throws ValueError
// when there is none (the R16 layout has AVX-512 kernels, and AVX2 ones for the legacy types).
const DotKernel& dot_kernel(DType weight_type, WeightLayout layout = WeightLayout::Plain);
// The portable scalar kernel (the reference the SIMD kernels are tested against).
const DotKernel& dot_kernel_scalar(DType weight_type);
// The kernel of one ISA ("avx512", "avx2", "scalar"), or nullptr when this CPU lacks the ISA or
// that ISA has no kernel for t: lets tests and benchmarks run every variant the CPU supports.
const DotKernel* dot_kernel_for_isa(DType weight_type, const char* isa, WeightLayout layout = WeightLayout::Plain);
// ISAs with a kernel for t on this CPU, fastest first (empty when t has no dot kernel).
std::vector<const char*> dot_kernel_isas(DType weight_type, WeightLayout layout = WeightLayout::Plain);

// Many activation rows (a batch of decodes) against `rows` weight rows, each weight block
// unpacked once for all of them: out[t * ldo + r] = dot(w row r, act row t) for t < T, with act
// rows quantized to dot_kernel(t).act_type at stride act_row_bytes. A result equals dot_rows'
// bit for bit, whatever T. nullptr when this CPU / weight type has none (then call dot_rows
// once per activation row).
using DotBatchFn = void (*)(int64_t n, const void* w, size_t w_row_bytes, int64_t rows,
                            const void* act, size_t act_row_bytes, int64_t T, float* out, int64_t ldo);
DotBatchFn dot_batch_kernel(DType weight_type, WeightLayout layout = WeightLayout::Plain);
// The kernel for a batch of T decode rows (the CPU backend's choice), or nullptr: the row kernel
// once per row. With AVX-512 VNNI dot_batch_kernel's, from 2 rows; with AVX2 the GEMM of the
// row kernel's ISA (its bits) from the few rows where it is the faster; results as dot_rows'.
DotBatchFn decode_batch_kernel(DType weight_type, WeightLayout layout, int64_t T);
// Whether weights of type t (file layout) have a batched kernel on CPUs with AVX-512 VNNI: the
// legacy formats Q4_0 .. Q8_0. A caller that sizes its paths by this, rather than by whether
// dot_batch_kernel returns one here, takes the same paths on every CPU (without the kernel,
// dot_rows once per activation row gives the same results).
bool has_dot_batch(DType weight_type);
// The same contract for many activation rows (prefill), register-tiled over weight rows and
// activation rows, except that act rows are in gemm_act_type(t). A result does not depend on T
// or the row's place in a tile; for the legacy formats (Q4_0 .. Q8_0) it also equals the row
// kernel's bit for bit (one float order; their dot_batch_kernel is this GEMM from 4 rows), and
// below AVX-512 VNNI it does for every quantized type (the GEMM of the row kernel's ISA).
// nullptr when this CPU / weight type / layout has none (AVX-512 VNNI: the legacy formats and
// Q2_K .. Q6_K, in either layout, and the IQ4 types in R16; AVX2 and scalar: every quantized type
// in the file layout, and AVX2 the legacy types and IQ4_NL in R16 too; AVX512_BF16: BF16, with vdpbf16ps on bf16 activations, and F16 / F32, with
// f32 FMAs on f32 ones). Faster than dequantize + sgemm for prefill on AVX-512 and near it on
// AVX2; linear() uses it there but not for scoring steps (Stream::float_activations), where
// 8-bit activations would move a model's perplexity away from a float reference's.
DotBatchFn gemm_kernel(DType weight_type, WeightLayout layout = WeightLayout::Plain);
// The GEMM of one ISA ("avx512", "avx2", "scalar"), or nullptr when this CPU lacks the ISA or that
// ISA has none for t: lets tests check every variant the CPU supports.
DotBatchFn gemm_kernel_for_isa(DType weight_type, const char* isa, WeightLayout layout = WeightLayout::Plain);
// The activation format gemm_kernel(t, any layout) takes: dot_kernel(t).act_type, but BF16 for
// BF16 weights.
DType gemm_act_type(DType weight_type);

// out[t * ldo + r] = x[t, :] . w[r, :] for f32 rows of K (w [rows, K], x [T, K]), each result one
// dot product in one fixed order whatever T and the row's place (gemm_f32_exact.cpp): the AVX-512
// f32 GEMM of gemm_kernel(F32) where the CPU has it, else a portable one.
void gemm_f32_exact(int64_t K, const float* w, int64_t rows, const float* x, int64_t T, float* out, int64_t ldo);

}  // namespace ferrum::quant
