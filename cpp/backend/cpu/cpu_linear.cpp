// linear on the CPU: out[T, N] = x[T, K] @ w[N, K]^T (+ bias).
//   - few rows (up to kMaxDotTokens, or a batch of decodes): each thread owns a contiguous range of
//     output rows, whose tail a thread done early may take (RowClaims), and runs the weight type's
//     dot kernel straight from the stored (possibly quantized) rows, the batched kernel where
//     there is one; activations are first quantized once to the kernel's activation type (a
//     single row by every thread inside the dot command).
//   - many rows (prefill): quantized weights with a GEMM kernel go to it (activations quantized
//     once, as for the dot kernels): the AVX-512 VNNI int8 GEMMs, or below AVX-512 VNNI the
//     GEMM of the row kernel's ISA (AVX2 int8, or the scalar row kernel over tiles), which
//     gives the row kernel's bits, so a row's result does not depend on how many rows share
//     the call. bf16 weights go to the vdpbf16ps GEMM (activations rounded to bf16 once), f16 /
//     f32 weights to the f32-FMA GEMM (f16 converted as it packs a tile; f32 activations) on
//     AVX512_BF16 CPUs; elsewhere f32 weights go to sgemm on each thread's slice of N; other
//     types (f16 / bf16 there, IQ4 weights left in the file layout on AVX-512) are dequantized a
//     tile of rows at a time into per-thread scratch, then sgemm. Two to eight rows of f32
//     weights: sgemm.
//   - a scoring step (Stream::float_activations) never quantizes activations: every matmul over
//     weights whose kernels would is dequantize + an f32 GEMM whose rows do not depend on how
//     many there are (quant::gemm_f32_exact), one row or many, so scores agree with a float
//     reference and do not depend on chunking or batching.
// Weights in the R16 layout (pack_weight) take the same paths; threads split them at 16-row
// group starts.
#include <cblas.h>
#include <immintrin.h>

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

// One linear call as its commands see it.
struct Matmul {
  Tensor x, w, bias, out;
  int64_t out_col, T, K, N, ldo;
  size_t w_row_bytes;
  quant::WeightLayout layout;
  int64_t unit;  // rows that go to one thread together: a 16-row group of R16 weights, else 1
  bool exact_rows;  // a scoring step's: results must not depend on T (Stream::float_activations)

  float* out_cols() const { return host_ptr<float>(out) + out_col; }  // column 0 of this weight's
  const char* weight_rows(int64_t r) const { return host_ptr<char>(w) + r * w_row_bytes; }
};

Matmul describe(const Stream& s, const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& out,
                int64_t out_col) {
  const quant::WeightLayout layout = layout_of(w);
  return {x, w, bias, out, out_col, x.rows(), x.cols(), w.dim(0), out.cols(), w.row_bytes(), layout,
          layout == quant::WeightLayout::R16 ? quant::kR16Rows : 1, s.float_activations};
}

// The path a call takes: the chosen kernels and whether it is prefill-sized.
struct LinearPath {
  const quant::DotKernel* kernel;  // the weights' row kernel (ValueError for unsupported types)
  bool many_rows;                  // prefill-sized: not a decode, nor a batch of decodes
  quant::DotBatchFn gemm;          // the weights' GEMM for many rows, or nullptr
  bool sgemm;                      // dequantize tiles of weight rows, then sgemm on f32 activations
};

LinearPath choose_path(const Stream& s, const Matmul& m) {
  LinearPath p;
  p.kernel = &quant::dot_kernel(m.w.dtype, m.layout);
  const bool decodes = m.T <= std::min(s.decode_rows, kMaxDecodeRows);
  p.many_rows = m.T > kMaxDotTokens && !decodes;
  // Never in a scoring step, also where the dot kernel takes f32 (bf16 weights: bf16 activations).
  p.gemm = p.many_rows && !s.float_activations ? quant::gemm_kernel(m.w.dtype, m.layout) : nullptr;
  const bool scoring_keeps_f32 = s.float_activations && p.kernel->act_type != DType::F32;
  p.sgemm = (p.many_rows && !p.gemm) || scoring_keeps_f32 || (m.w.dtype == DType::F32 && m.T > 1 && !p.gemm);
  return p;
}

// Part ith of nth of w's N rows, at whole units.
void split_rows(const Matmul& m, int ith, int nth, int64_t* r0, int64_t* r1) {
  split_range((m.N + m.unit - 1) / m.unit, ith, nth, r0, r1);
  *r0 = std::min(*r0 * m.unit, m.N);
  *r1 = std::min(*r1 * m.unit, m.N);
}

// out points at column 0 of this weight's columns.
void add_bias(const Matmul& m, float* out, int64_t r0, int64_t r1) {
  if (!m.bias.defined()) return;
  const float* b = host_ptr<float>(m.bias);
  for (int64_t t = 0; t < m.T; ++t)
    for (int64_t r = r0; r < r1; ++r) out[t * m.ldo + r] += b[r];
}

// ---- the sgemm path: f32 weights used in place, others dequantized a tile of rows at a time ----

bool dequantizes(const Matmul& m) { return m.w.dtype != DType::F32; }
size_t sgemm_scratch_bytes(const Matmul& m, int threads) {
  return dequantizes(m) ? size_t(threads * kTileRows * m.K) * 4 : 0;
}

// Weight rows [r0, r0 + rows) as f32: in place, or dequantized into tile.
const float* weight_rows_f32(const Matmul& m, int64_t r0, int64_t rows, float* tile) {
  if (!dequantizes(m)) return host_ptr<float>(m.w) + r0 * m.K;
  quant::dequantize_rows(m.w.dtype, m.layout, host_ptr<char>(m.w), r0, rows, m.K, tile);
  return tile;
}

// f32 weight rows times f32 activations: gemm_f32_exact, whose results do not depend on the
// number of activation rows (sgemm's do, for small counts), where the CPU has its AVX-512 form or
// the step is a scoring one (a score's rows then come out the same however its sequence is
// chunked or batched); else sgemm.
void f32_matmul(const Matmul& m, const float* w_rows, int64_t rows, float* out) {
  static const bool fast_exact = quant::gemm_kernel(DType::F32, quant::WeightLayout::Plain) != nullptr;
  if (fast_exact || m.exact_rows) {
    quant::gemm_f32_exact(m.K, w_rows, rows, host_ptr<float>(m.x), m.T, out, m.ldo);
    return;
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(m.T), int(rows), int(m.K), 1.0f, host_ptr<float>(m.x),
              int(m.K), w_rows, int(m.K), 0.0f, out, int(m.ldo));
}

void record_dequantize_sgemm(CpuStream& cs, const Matmul& m, std::shared_ptr<std::vector<char>> tiles) {
  cs.record("linear_gemm", [m, tiles](int ith, int nth) {
    int64_t r0, r1;
    split_rows(m, ith, nth, &r0, &r1);
    float* tile = dequantizes(m) ? reinterpret_cast<float*>(tiles->data()) + size_t(ith) * kTileRows * m.K : nullptr;
    float* op = m.out_cols();
    for (int64_t t0 = r0; t0 < r1; t0 += kTileRows) {
      const int64_t rows = std::min(kTileRows, r1 - t0);
      f32_matmul(m, weight_rows_f32(m, t0, rows, tile), rows, op + t0);
    }
    add_bias(m, op, r0, r1);
  });
}

// ---- the dot path: the row kernel, the batched decode kernel or the GEMM ----

// The activation rows the dot command reads: x itself (f32), or x quantized once by a command of
// its own, or, when they are few (a decode or a small batch of decodes), by every thread into its
// own copy inside the dot command: a microsecond or two of redundant work instead of a command
// and a barrier between the two.
struct Activations {
  DType type;
  size_t row_bytes;
  bool quantized;     // else the kernels read x
  bool per_thread;    // quantized by every thread inside the dot command
  std::shared_ptr<std::vector<char>> rows;  // the quantized rows (per_thread: one copy a thread)
  const void* row(const Matmul& m, const char* quantized_rows, int64_t t) const {
    return quantized ? static_cast<const void*>(quantized_rows + t * row_bytes)
                     : static_cast<const void*>(host_ptr<float>(m.x) + t * m.K);
  }
};

Activations choose_activations(const Matmul& m, const LinearPath& p) {
  Activations a;
  a.type = p.gemm ? quant::gemm_act_type(m.w.dtype) : p.kernel->act_type;  // the GEMM may take another
  a.row_bytes = dtype_bytes(a.type, m.K);
  a.quantized = a.type != DType::F32;
  a.per_thread = a.quantized && m.T * m.K <= kMaxInlineQuantize;
  return a;
}

void quantize_rows(const Matmul& m, const Activations& a, int64_t t0, int64_t t1, char* dst) {
  for (int64_t t = t0; t < t1; ++t)
    quant::quantize_row(a.type, host_ptr<float>(m.x) + t * m.K, dst + t * a.row_bytes, m.K);
}

void record_quantize_activations(CpuStream& cs, const Matmul& m, const Activations& a) {
  cs.record("quantize_act", [m, a](int ith, int nth) {
    int64_t b, e;
    split_range(m.T, ith, nth, &b, &e);
    quantize_rows(m, a, b, e, a.rows->data());
  });
}

// How the dot command deals the weight rows to threads and walks them.
struct DotSplit {
  // All activation rows at once (the GEMM, or the batched kernel, which unpacks each weight
  // block once for all rows and equals the row kernel bit for bit; one row is faster without
  // it), or nullptr: the row kernel.
  quant::DotBatchFn batch;
  // Row kernel: weight rows dotted with every activation row while they stay in L1; one
  // activation row takes the thread's rows in one call (the kernel prepares it once per call).
  int64_t tile_rows;
  int64_t units;      // N in units of m.unit rows
  int64_t min_piece;  // the smallest piece a thread claims, in units
  bool reverse;       // threads take their parts in reverse order (CpuStream::reverse_threads)
};

DotSplit split_dot(CpuStream& cs, const Matmul& m, const LinearPath& p, const Activations& a, int threads) {
  DotSplit d;
  d.batch = p.gemm ? p.gemm : quant::decode_batch_kernel(m.w.dtype, m.layout, m.T);
  d.tile_rows = m.T == 1 ? m.N : std::max<int64_t>(1, int64_t(kDotTileBytes / m.w_row_bytes) / m.unit) * m.unit;
  d.reverse = cs.reverse_threads(host_ptr<char>(m.w), m.w.nbytes());
  d.units = (m.N + m.unit - 1) / m.unit;  // R16 row counts are whole groups
  FERRUM_CHECK(d.units < RowClaims::kMaxUnits, "linear: " + m.w.str() + " has too many rows");
  // Prefill's GEMM is compute-bound and prepares its activation tiles once per call: one piece
  // a thread.
  d.min_piece = p.many_rows ? (d.units + threads - 1) / threads
                            : std::max<int64_t>(1, int64_t(kMinPieceBytes / m.w_row_bytes) / m.unit);
  return d;
}

// out rows' columns [r0, r1) for every activation row.
void dot_row_range(const Matmul& m, const LinearPath& p, const DotSplit& d, const Activations& a, const char* acts,
                   int64_t r0, int64_t r1) {
  float* op = m.out_cols();
  if (d.batch) {
    d.batch(m.K, m.weight_rows(r0), m.w_row_bytes, r1 - r0, a.row(m, acts, 0), a.row_bytes, m.T, op + r0, m.ldo);
  } else {
    for (int64_t tr = r0; tr < r1; tr += d.tile_rows) {
      const int64_t rows = std::min(d.tile_rows, r1 - tr);
      // With several activation rows a tile's passes are compute-bound: the next tile is fetched
      // into L2 meanwhile, a share before each pass, so memory and arithmetic overlap.
      const char* next = m.weight_rows(tr + rows);
      const int64_t next_bytes = std::min(d.tile_rows, r1 - tr - rows) * int64_t(m.w_row_bytes);
      const int64_t share = m.T > 1 ? (next_bytes / m.T + 64) & ~int64_t(63) : 0;
      for (int64_t t = 0; t < m.T; ++t) {
        for (int64_t at = t * share, end = std::min(next_bytes, at + share); at < end; at += 64)
          _mm_prefetch(next + at, _MM_HINT_T1);
        p.kernel->dot_rows(m.K, m.weight_rows(tr), m.w_row_bytes, rows, a.row(m, acts, t), op + t * m.ldo + tr);
      }
    }
  }
  add_bias(m, op, r0, r1);
}

void record_dot(CpuStream& cs, const Matmul& m, const LinearPath& p, const Activations& a, const DotSplit& d,
                int threads) {
  auto claims = std::make_shared<RowClaims>(threads);
  cs.record("linear_dot", [m, p, a, d, claims](int ith, int nth) {
    const char* acts = a.quantized ? a.rows->data() : nullptr;
    if (a.per_thread) {
      char* own = a.rows->data() + size_t(ith * m.T) * a.row_bytes;
      quantize_rows(m, a, 0, m.T, own);
      acts = own;
    }
    const auto owner_part = [&](int i) { return d.reverse ? nth - 1 - i : i; };
    claims->run(ith, nth, owner_part, d.units, d.min_piece, [&](int64_t u0, int64_t u1) {
      dot_row_range(m, p, d, a, acts, u0 * m.unit, std::min(u1 * m.unit, m.N));
    });
  });
}
}  // namespace

void CpuBackend::linear(Stream& s, const Tensor& x, const Tensor& w, const Tensor& bias,
                        const Tensor& out, int64_t out_col) {
  own({&x, &w, &bias, &out});
  checks::linear(x, w, bias, out, out_col);
  CpuStream& cs = static_cast<CpuStream&>(s);
  const Matmul m = describe(s, x, w, bias, out, out_col);
  const LinearPath path = choose_path(s, m);
  if (path.sgemm) {
    record_dequantize_sgemm(cs, m, scratch(Scratch::GemmTiles, sgemm_scratch_bytes(m, pool_.size())));
    return;
  }
  Activations acts = choose_activations(m, path);
  if (acts.quantized)
    acts.rows = scratch(Scratch::Activations, size_t(acts.per_thread ? pool_.size() * m.T : m.T) * acts.row_bytes);
  if (acts.quantized && !acts.per_thread) record_quantize_activations(cs, m, acts);
  const DotSplit split = split_dot(cs, m, path, acts, pool_.size());
  if (!path.many_rows) cs.warm_before({host_ptr<char>(w), size_t(m.unit) * m.w_row_bytes, split.units, split.reverse});
  record_dot(cs, m, path, acts, split, pool_.size());
}

}  // namespace ferrum
