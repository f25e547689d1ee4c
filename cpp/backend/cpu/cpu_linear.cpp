// linear on the CPU: out[T, N] = x[T, K] @ w[N, K]^T (+ bias).
//   - few rows (up to kMaxDotTokens, or a batch of decodes): each thread owns a contiguous range of
//     output rows, whose tail a thread done early may take (RowClaims), and runs the weight type's
//     dot kernel straight from the stored (possibly quantized) rows, the batched kernel where
//     there is one; activations are first quantized once to the kernel's activation type (a
//     single row by every thread inside the dot command).
//   - many rows (prefill): quantized weights with an int8 GEMM kernel (Q4_0 ... Q8_0, Q2_K ...
//     Q6_K) go to it (activations quantized once, as for the dot kernels; 2-3x the
//     multiply-adds per second of sgemm), bf16 weights to the vdpbf16ps GEMM (activations
//     rounded to bf16 once), f16 / f32 weights to the f32-FMA GEMM (f16 converted as it packs
//     a tile; f32 activations) on AVX512_BF16 CPUs; elsewhere f32 weights go to sgemm on each
//     thread's slice of N; other types are dequantized a tile of rows at a time into
//     per-thread scratch, then sgemm. Two to eight rows of f32 weights: sgemm.
//   - a scoring step (Stream::float_activations) never quantizes activations: every matmul over
//     weights whose kernels would is dequantize + sgemm, one row or many, so scores agree with a
//     float reference.
// Weights in the R16 layout (pack_weight) take the same paths; threads split them at 16-row
// group starts.
#include <cblas.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/row_claims.h"
#include "backend/op_checks.h"
#include "core/error.h"
#include "quant/quant.h"
#include "quant/repack.h"

namespace ferrum {

namespace {
// Up to this many rows the integer dot kernels are used for any matmul; a batch of decodes
// (Stream::decode_rows) uses them up to kMaxDecodeRows, where the batched kernel, unpacking each
// weight block once for all rows, still beats a tile dequantize + sgemm.
constexpr int64_t kMaxDotTokens = 8;
constexpr int64_t kMaxDecodeRows = 64;
constexpr int64_t kTileRows = 128;
constexpr size_t kDotTileBytes = 16 * 1024;  // weight rows dotted with every activation row at once
constexpr int64_t kMaxInlineQuantize = 16384;  // activation elements quantized by every thread (see below)
constexpr size_t kMinPieceBytes = 32 * 1024;  // smallest piece of a decode matmul a thread claims (RowClaims)

// Part ith of nth of w's N rows; R16 weights split at group starts.
void split_rows(const Tensor& w, int ith, int nth, int64_t* r0, int64_t* r1) {
  const int64_t unit = layout_of(w) == quant::WeightLayout::R16 ? quant::kR16Rows : 1;
  split_range((w.dim(0) + unit - 1) / unit, ith, nth, r0, r1);
  *r0 = std::min(*r0 * unit, w.dim(0));
  *r1 = std::min(*r1 * unit, w.dim(0));
}

// out points at column 0 of this weight's columns; ldo is the row stride of out.
void add_bias(const Tensor& bias, float* out, int64_t tokens, int64_t ldo, int64_t r0, int64_t r1) {
  if (!bias.defined()) return;
  const float* b = host_ptr<float>(bias);
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t r = r0; r < r1; ++r) out[t * ldo + r] += b[r];
}
}  // namespace

void CpuBackend::linear(Stream& s, const Tensor& x, const Tensor& w, const Tensor& bias,
                        const Tensor& out, int64_t out_col) {
  own({&x, &w, &bias, &out});
  checks::linear(x, w, bias, out, out_col);
  CpuStream& cs = static_cast<CpuStream&>(s);
  const int64_t T = x.rows(), K = x.cols(), N = w.dim(0), ldo = out.cols();
  const size_t w_row_bytes = w.row_bytes();

  const quant::DotKernel* kernel = &quant::dot_kernel(w.dtype, layout_of(w));
  const bool decodes = T <= std::min(s.decode_rows, kMaxDecodeRows);
  const bool many_rows = T > kMaxDotTokens && !decodes;
  const bool float_act = s.float_activations && kernel->act_type != DType::F32;
  // Never in a scoring step, also where the dot kernel takes f32 (bf16 weights: bf16 activations).
  const quant::DotBatchFn gemm = many_rows && !s.float_activations ? quant::gemm_kernel(w.dtype, layout_of(w)) : nullptr;
  if ((many_rows && !gemm) || float_act || (w.dtype == DType::F32 && T > 1 && !gemm)) {
    // GEMM path. f32 weights are used in place; others are dequantized per tile.
    const bool dequant = w.dtype != DType::F32;
    auto tiles = scratch(Scratch::GemmTiles, dequant ? size_t(pool_.size() * kTileRows * K) * 4 : 0);
    cs.record("linear_gemm", [=](int ith, int nth) {
      int64_t r0, r1;
      split_rows(w, ith, nth, &r0, &r1);
      const float* xp = host_ptr<float>(x);
      float* op = host_ptr<float>(out) + out_col;
      for (int64_t t0 = r0; t0 < r1; t0 += kTileRows) {
        int64_t rows = std::min(kTileRows, r1 - t0);
        const float* wt;
        if (dequant) {
          float* tile = reinterpret_cast<float*>(tiles->data()) + size_t(ith) * kTileRows * K;
          quant::dequantize_rows(w.dtype, layout_of(w), host_ptr<char>(w), t0, rows, K, tile);
          wt = tile;
        } else {
          wt = host_ptr<float>(w) + t0 * K;
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(T), int(rows), int(K), 1.0f, xp,
                    int(K), wt, int(K), 0.0f, op + t0, int(ldo));
      }
      add_bias(bias, op, T, ldo, r0, r1);
    });
    return;
  }

  // Dot-kernel path (or the GEMM kernel, which may take another activation type). Activations
  // are quantized once by a command of their own, or, when they are few (a decode or a small
  // batch of decodes), by every thread into its own copy inside the dot command: a microsecond
  // or two of redundant work instead of a command and a barrier between the two.
  const DType act_type = gemm ? quant::gemm_act_type(w.dtype) : kernel->act_type;
  const size_t act_row_bytes = dtype_bytes(act_type, K);
  const bool quantize = act_type != DType::F32;
  const bool quantize_in_dot = quantize && T * K <= kMaxInlineQuantize;
  std::shared_ptr<std::vector<char>> act;
  if (quantize_in_dot) {
    act = scratch(Scratch::Activations, size_t(pool_.size() * T) * act_row_bytes);
  } else if (quantize) {
    act = scratch(Scratch::Activations, size_t(T) * act_row_bytes);
    cs.record("quantize_act", [=](int ith, int nth) {
      int64_t b, e;
      split_range(T, ith, nth, &b, &e);
      for (int64_t t = b; t < e; ++t)
        quant::quantize_row(act_type, host_ptr<float>(x) + t * K, act->data() + t * act_row_bytes, K);
    });
  }
  // Several rows: the batched kernel unpacks each weight block once for all of them (its results
  // equal the single-row kernel's bit for bit, and one row is faster without it). Else weight
  // rows go in tiles that stay in L1 while every activation row is dotted with them.
  const quant::DotBatchFn batch = gemm ? gemm : act && T > 1 ? quant::dot_batch_kernel(w.dtype, layout_of(w)) : nullptr;
  // One activation row: a single call over the thread's rows (the kernel prepares the
  // activation once per call).
  const int64_t unit = layout_of(w) == quant::WeightLayout::R16 ? quant::kR16Rows : 1;  // R16: whole groups
  const int64_t tile_rows = T == 1 ? N : std::max<int64_t>(1, int64_t(kDotTileBytes / w_row_bytes) / unit) * unit;
  const bool reverse = cs.reverse_threads(host_ptr<char>(w), w.nbytes());
  const int64_t units = (N + unit - 1) / unit;  // R16 row counts are whole groups
  FERRUM_CHECK(units < RowClaims::kMaxUnits, "linear: " + w.str() + " has too many rows");
  if (!many_rows) cs.warm_before({host_ptr<char>(w), size_t(unit) * w_row_bytes, units, reverse});
  auto claims = std::make_shared<RowClaims>(pool_.size());
  // Prefill's GEMM is compute-bound and prepares its activation tiles once per call: one piece
  // a thread.
  const int64_t min_piece = many_rows ? (units + pool_.size() - 1) / pool_.size()
                                      : std::max<int64_t>(1, int64_t(kMinPieceBytes / w_row_bytes) / unit);
  cs.record("linear_dot", [=](int ith, int nth) {
    float* op = host_ptr<float>(out) + out_col;
    char* acts = act ? act->data() : nullptr;
    if (quantize_in_dot) {
      acts += size_t(ith * T) * act_row_bytes;
      for (int64_t t = 0; t < T; ++t)
        quant::quantize_row(act_type, host_ptr<float>(x) + t * K, acts + t * act_row_bytes, K);
    }
    const auto owner_part = [&](int i) { return reverse ? nth - 1 - i : i; };
    claims->run(ith, nth, owner_part, units, min_piece, [&](int64_t u0, int64_t u1) {
      const int64_t r0 = u0 * unit, r1 = std::min(u1 * unit, N);
      if (batch) {
        const void* a = acts ? static_cast<const void*>(acts) : static_cast<const void*>(host_ptr<float>(x));
        batch(K, host_ptr<char>(w) + r0 * w_row_bytes, w_row_bytes, r1 - r0, a, act_row_bytes, T, op + r0, ldo);
      } else {
        for (int64_t tr = r0; tr < r1; tr += tile_rows) {
          const int64_t rows = std::min(tile_rows, r1 - tr);
          const char* wp = host_ptr<char>(w) + tr * w_row_bytes;
          for (int64_t t = 0; t < T; ++t) {
            const void* a = act ? static_cast<const void*>(acts + t * act_row_bytes)
                                : static_cast<const void*>(host_ptr<float>(x) + t * K);
            kernel->dot_rows(K, wp, w_row_bytes, rows, a, op + t * ldo + tr);
          }
        }
      }
      add_bias(bias, op, T, ldo, r0, r1);
    });
  });
}

}  // namespace ferrum
