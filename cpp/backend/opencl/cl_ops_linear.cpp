// linear and embedding: one launch per device buffer of the weight (a weight larger than the
// device's maximum allocation is split by rows; each piece fills its own output columns).
#include "backend/op_checks.h"
#include "backend/opencl/cl_backend.h"
#include "core/error.h"

namespace ferrum::ocl {

namespace {
constexpr int64_t kChunk = 32;       // elements per load_chunk
}  // namespace

void ClBackend::linear(Stream& s, const Tensor& x, const Tensor& w, const Tensor& bias,
                       const Tensor& out, int64_t out_col) {
  checks::linear(x, w, bias, out, out_col);
  const int64_t T = x.rows(), K = x.cols(), N = w.dim(0);
  if (T == 0 || N == 0) return;
  cl_program program = linear_program(w.dtype);
  // One token: the GEMV kernel (a tile of 1 x 4). More: 4 x 4 tiles, dequantizing each weight
  // chunk once for four tokens.
  const bool gemv = T == 1;
  const int64_t token_tiles = gemv ? 1 : (T + 3) / 4;
  const int64_t rows_per_item = gemv ? 1 : 4;  // weight rows per work-item of linear_t1 / linear_t4
  const BufferView o = single_buffer(out, "linear");
  for (const RowSegment& seg : row_segments(w, "linear")) {
    if (seg.rows == 0) continue;
    Launch l = launch(program, gemv ? "linear_t1" : "linear_t4",
                      token_tiles * ((seg.rows + rows_per_item - 1) / rows_per_item), gemv ? 64 : 16);
    KernelArgs a(l);
    a.tensor(x, "linear").i32(T).i32(K);
    a.buffer(seg.mem, int64_t(seg.byte_offset), w.storage).i64(int64_t(w.row_bytes())).i32(seg.rows);
    if (bias.defined()) a.tensor(bias.slice(seg.first_row, seg.rows), "linear").i32(1);
    else a.tensor(placeholder(), "linear").i32(0);
    a.buffer(o.mem, int64_t(o.byte_offset / 4) + out_col + seg.first_row, out.storage).i32(out.cols());
    record(s, std::move(l));
  }
}

void ClBackend::embedding(Stream& s, const Tensor& ids, const Tensor& table, const Tensor& out) {
  checks::embedding(ids, table, out);
  const int64_t T = ids.numel(), H = table.cols();
  if (T == 0 || H == 0) return;
  cl_program program = linear_program(table.dtype);
  const int64_t chunks = (H + kChunk - 1) / kChunk;
  bool first = true;
  for (const RowSegment& seg : row_segments(table, "embedding")) {
    Launch l = launch(program, "embedding_rows", T * chunks, 64);
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
