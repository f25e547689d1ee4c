// The gpu family's mixture-of-experts matmuls (kernels/gpu_moe.cl); moe_experts (cl_ops_moe.cpp)
// drives them as it drives the cpu family's.
#include "backend/opencl/cl_backend.h"
#include "core/error.h"

namespace ferrum::ocl {

void ClBackend::gpu_moe_rows(Stream& s, const Tensor& x, const Tensor& xq, int64_t x_div, const Tensor& w,
                             const Tensor& ids, const Tensor& y, int64_t col) {
  const int64_t P = ids.numel(), E = w.dim(0), N = w.dim(1), K = w.dim(2);
  cl_program program = gpu_linear_program(w);
  const BufferView o = single_buffer(y, "moe_experts");
  const bool q8 = xq.defined();
  const int64_t rows_per_group = int64_t(tuning_.gemv_groups) * tuning_.gemv_rows;
  bool first = true;
  for (const RowSegment& seg : row_segments(w, "moe_experts")) {
    if (seg.rows == 0 && !first) continue;
    Launch l = launch_groups(program, q8 ? "moe_gemv_q8" : "moe_gemv", P * ((N + rows_per_group - 1) / rows_per_group),
                             tuning_.gemv_wg());
    KernelArgs(l)
        .tensor(q8 ? xq : x, "moe_experts").i32(x_div).i32(K)
        .tensor(ids, "moe_experts").i32(P).i32(E).i32(N)
        .buffer(seg.mem, int64_t(seg.byte_offset), w.storage).i64(int64_t(w.row_bytes()))
        .i64(seg.first_row).i64(seg.rows).i32(first ? 1 : 0)
        .buffer(o.mem, int64_t(o.byte_offset / 4) + col, y.storage).i32(y.cols());
    first = false;
    record(s, std::move(l), /*keeps_quantized=*/true);
  }
}

void ClBackend::gpu_moe_tiles(Stream& s, const Tensor& x, int64_t x_div, const Tensor& w, const Tensor& groups,
                              int64_t P, const Tensor& y, int64_t col) {
  const int64_t N = w.dim(1), K = w.dim(2), max_tiles = (groups.numel() - P) / 3;
  cl_program program = gpu_linear_program(w);
  const BufferView o = single_buffer(y, "moe_experts");
  for (const RowSegment& seg : row_segments(w, "moe_experts")) {
    if (seg.rows == 0) continue;
    Launch l = launch_groups(program, "moe_gemm", max_tiles * ((N + tuning_.gemm_tn - 1) / tuning_.gemm_tn),
                             tuning_.gemm_items());
    KernelArgs(l)
        .tensor(x, "moe_experts").i32(x_div).i32(K)
        .tensor(groups, "moe_experts").i32(P).i32(max_tiles).i32(N)
        .buffer(seg.mem, int64_t(seg.byte_offset), w.storage).i64(int64_t(w.row_bytes()))
        .i64(seg.first_row).i64(seg.rows)
        .buffer(o.mem, int64_t(o.byte_offset / 4) + col, y.storage).i32(y.cols());
    record(s, std::move(l));
  }
}

}  // namespace ferrum::ocl
