// Row and element ops: rms_norm, add_rms_norm, swiglu, gather_rows, gather_columns,
// add_group_offsets (the gpu family's norms and swiglu: cl_gpu_rows.cpp).
#include "backend/op_checks.h"
#include "backend/opencl/cl_backend.h"
#include "core/error.h"

namespace ferrum::ocl {

void ClBackend::rms_norm(Stream& s, const Tensor& x, const Tensor& w, float eps, const Tensor& out) {
  checks::rms_norm(x, w, out);
  if (x.rows() == 0) return;
  if (family_ == KernelFamily::Gpu) return gpu_rms_norm(s, nullptr, x, w, eps, out);
  Launch l = launch(elementwise_program(), "rms_norm", x.rows(), 4);
  KernelArgs(l).tensor(x, "rms_norm").tensor(w, "rms_norm").f32(eps).tensor(out, "rms_norm")
      .i32(x.rows()).i32(x.cols());
  record(s, std::move(l));
}

void ClBackend::add_rms_norm(Stream& s, const Tensor& residual, const Tensor& x, const Tensor& w,
                             float eps, const Tensor& out) {
  checks::add_rms_norm(residual, x, w, out);
  if (x.rows() == 0) return;
  if (family_ == KernelFamily::Gpu) return gpu_rms_norm(s, &residual, x, w, eps, out);
  Launch l = launch(elementwise_program(), "add_rms_norm", x.rows(), 4);
  KernelArgs(l).tensor(residual, "add_rms_norm").tensor(x, "add_rms_norm").tensor(w, "add_rms_norm")
      .f32(eps).tensor(out, "add_rms_norm").i32(x.rows()).i32(x.cols());
  record(s, std::move(l));
}

void ClBackend::swiglu(Stream& s, const Tensor& gate_up, const Tensor& out) {
  checks::swiglu(gate_up, out);
  if (out.numel() == 0) return;
  if (family_ == KernelFamily::Gpu) return gpu_swiglu(s, gate_up, out);
  Launch l = launch(elementwise_program(), "swiglu", out.rows() * ((out.cols() + 15) / 16), 64);
  KernelArgs(l).tensor(gate_up, "swiglu").tensor(out, "swiglu").i32(out.rows()).i32(out.cols());
  record(s, std::move(l));
}

void ClBackend::gather_rows(Stream& s, const Tensor& x, const Tensor& idx, const Tensor& out) {
  checks::gather_rows(x, idx, out);
  if (out.numel() == 0) return;
  Launch l = launch(elementwise_program(), "gather_rows", out.numel(), 256);
  KernelArgs(l).tensor(x, "gather_rows").i32(x.rows()).tensor(idx, "gather_rows").tensor(out, "gather_rows")
      .i32(out.rows()).i32(out.cols());
  record(s, std::move(l));
}

void ClBackend::gather_columns(Stream& s, const Tensor& x, const Tensor& idx, const Tensor& out) {
  checks::gather_columns(x, idx, out);
  if (out.numel() == 0) return;
  Launch l = launch(elementwise_program(), "gather_columns", out.numel(), 256);
  KernelArgs(l).tensor(x, "gather_columns").i32(x.cols()).tensor(idx, "gather_columns")
      .tensor(out, "gather_columns").i32(out.rows()).i32(out.cols());
  record(s, std::move(l));
}

Tensor ClBackend::group_sums(Stream& s, const Tensor& x, const Tensor& block_groups, int64_t groups) {
  const Tensor sums = alloc(DType::F32, {x.rows(), groups});
  Launch l = launch(elementwise_program(), "group_sums", x.rows() * groups, 64);
  KernelArgs(l).tensor(x, "group_sums").tensor(block_groups, "group_sums").tensor(sums, "group_sums")
      .i32(x.rows()).i32(x.cols() / 32).i32(groups);
  record(s, std::move(l));
  return sums;
}

void ClBackend::add_group_offsets(Stream& s, const Tensor& x, const Tensor& block_groups, const Tensor& offsets,
                                  const Tensor& out) {
  checks::add_group_offsets(x, block_groups, offsets, out);
  const int64_t T = x.rows(), G = offsets.dim(0), N = offsets.dim(1);
  if (T == 0 || N == 0 || G == 0) return;
  const Tensor sums = group_sums(s, x, block_groups, G);
  Launch a = launch(elementwise_program(), "add_group_offsets", T * N, 64);
  KernelArgs(a).tensor(sums, "add_group_offsets").tensor(offsets, "add_group_offsets")
      .tensor(out, "add_group_offsets").i32(out.cols()).i32(T).i32(N).i32(G);
  record(s, std::move(a));
}

}  // namespace ferrum::ocl
