// linear and embedding: one launch per device buffer of the weight (a weight larger than the
// device's maximum allocation is split by rows; each piece fills its own output columns).
#include "backend/op_checks.h"
#include "backend/opencl/cl_backend.h"
#include "core/error.h"

namespace ferrum::ocl {

namespace {
constexpr int64_t kChunk = 32;  // elements per block_chunk
}  // namespace

// The legacy 4/5-bit types cost the most to dequantize: an 8 tokens x 2 rows tile shares each
// dequantized chunk among 8 tokens, while for the others the 4 x 4 tile's reuse of activation
// loads wins.
MatmulTile matmul_tile(DType w, int64_t tokens) {
  const bool wide = tokens >= 8 && (w == DType::Q4_0 || w == DType::Q4_1 || w == DType::Q5_0 || w == DType::Q5_1);
  return wide ? MatmulTile{8, 2, "linear_t8", "moe_tiles_t8"} : MatmulTile{4, 4, "linear_t4", "moe_tiles_t4"};
}

// The linear kernels' arguments after (x, T, K) for the rows of one device buffer of w: its
// blocks, their bias and the output columns they fill.
void ClBackend::segment_args(KernelArgs& a, const RowSegment& seg, const Tensor& w, const Tensor& bias,
                             const BufferView& o, const Tensor& out, int64_t out_col) const {
  a.buffer(seg.mem, int64_t(seg.byte_offset), w.storage).i64(int64_t(w.row_bytes())).i32(seg.rows);
  if (bias.defined()) a.tensor(bias.slice(seg.first_row, seg.rows), "linear").i32(1);
  else a.tensor(placeholder(), "linear").i32(0);
  a.buffer(o.mem, int64_t(o.byte_offset / 4) + out_col + seg.first_row, out.storage).i32(out.cols());
}

void ClBackend::linear(Stream& s, const Tensor& x, const Tensor& w, const Tensor& bias,
                       const Tensor& out, int64_t out_col) {
  checks::linear(x, w, bias, out, out_col);
  const int64_t T = x.rows(), K = x.cols(), N = w.dim(0);
  if (T == 0 || N == 0) return;
  if (family_ == KernelFamily::Gpu) return gpu_linear(s, x, w, bias, out, out_col);
  cl_program program = linear_program(w.dtype);
  // Decodes (one token, or a batch of them) over quantized weights: x to 8 bits, integer dots.
  if (dot_q8(w.dtype) && !s.float_activations && (T == 1 || s.decode_rows > 0)) {
    linear_q8(s, program, x, w, bias, out, out_col);
    return;
  }
  // One token: the GEMV kernel (a row per work-item). More: register tiles of tokens x rows,
  // dequantizing each weight chunk once per tile.
  const bool gemv = T == 1;
  const MatmulTile tile = gemv ? MatmulTile{1, 1, "linear_t1", ""} : matmul_tile(w.dtype, T);
  const int64_t tokens_per_item = tile.tokens, rows_per_item = tile.rows;
  const int64_t token_tiles = (T + tokens_per_item - 1) / tokens_per_item;
  const BufferView o = single_buffer(out, "linear");
  for (const RowSegment& seg : row_segments(w, "linear")) {
    if (seg.rows == 0) continue;
    Launch l = launch(program, tile.linear_kernel,
                      token_tiles * ((seg.rows + rows_per_item - 1) / rows_per_item), gemv ? 64 : 16);
    KernelArgs a(l);
    a.tensor(x, "linear").i32(T).i32(K);
    segment_args(a, seg, w, bias, o, out, out_col);
    if (gemv) a.local_floats(K / kChunk);  // linear_t1's sums of x per 32-element chunk
    record(s, std::move(l));
  }
}

// The types with block_dot_q8 in kernels/weights.cl.
bool dot_q8(DType w) {
  switch (w) {
    case DType::Q4_0: case DType::Q4_1: case DType::Q5_0: case DType::Q5_1: case DType::Q8_0:
    case DType::Q4_K: case DType::Q5_K: case DType::Q6_K: case DType::IQ4_NL: case DType::IQ4_XS:
      return true;
    default:
      return false;
  }
}

int64_t xq_row_bytes(int64_t K) { return (K + K / 4 + 15) / 16 * 16; }

Tensor ClBackend::quantize_q8(Stream& s, cl_program program, const Tensor& x) {
  const int64_t T = x.rows(), K = x.cols();
  Tensor xq = alloc(DType::I8, {T, xq_row_bytes(K)});  // kernels/quantize.cl
  Launch l = launch(program, "quantize_q8_rows", T * (K / kChunk), 64);
  KernelArgs(l).tensor(x, "linear").i32(T).i32(K).tensor(xq, "linear");
  record(s, std::move(l));
  return xq;
}

// As the CPU backend does for decodes: x quantized to int8 per 32 elements once, then integer
// dot products against the stored blocks; on pocl far fewer vector instructions than
// converting every weight to a float (kernels/README.md).
void ClBackend::linear_q8(Stream& s, cl_program program, const Tensor& x, const Tensor& w,
                          const Tensor& bias, const Tensor& out, int64_t out_col) {
  const int64_t T = x.rows(), K = x.cols();
  const Tensor xq = quantize_q8(s, program, x);
  // A batch of decodes: four tokens per work-item share each weight block's unpacking.
  const int64_t tokens_per_item = T == 1 ? 1 : 4;
  const char* kernel = T == 1 ? "linear_q8" : "linear_q8_t4";
  const BufferView o = single_buffer(out, "linear");
  for (const RowSegment& seg : row_segments(w, "linear")) {
    if (seg.rows == 0) continue;
    Launch l = launch(program, kernel, (T + tokens_per_item - 1) / tokens_per_item * seg.rows, 64);
    KernelArgs a(l);
    a.tensor(xq, "linear").i32(T).i32(K);
    segment_args(a, seg, w, bias, o, out, out_col);
    record(s, std::move(l));
  }
}

void ClBackend::embedding(Stream& s, const Tensor& ids, const Tensor& table, const Tensor& out) {
  checks::embedding(ids, table, out);
  const int64_t T = ids.numel(), H = table.cols();
  if (T == 0 || H == 0) return;
  const bool gpu = family_ == KernelFamily::Gpu;
  cl_program program = gpu ? gpu_linear_program(table) : linear_program(table.dtype);
  const int64_t chunks = (H + kChunk - 1) / kChunk;
  bool first = true;
  for (const RowSegment& seg : row_segments(table, "embedding")) {
    Launch l = gpu ? launch_groups(program, "embedding_rows", (T * chunks + 63) / 64, 64)
                   : launch(program, "embedding_rows", T * chunks, 64);
    KernelArgs(l)
        .tensor(ids, "embedding").i32(T)
        .buffer(seg.mem, int64_t(seg.byte_offset), table.storage).i64(int64_t(table.row_bytes()))
        .i32(seg.first_row).i32(seg.rows).i32(table.dim(0)).i32(H)
        .i32(first ? 1 : 0)  // one launch writes the zero rows of out-of-range ids
        .tensor(out, "embedding");
    first = false;
    record(s, std::move(l));
  }
}

}  // namespace ferrum::ocl
