// The gpu family's row ops (kernels/gpu_rows.cl): rms_norm / add_rms_norm and swiglu, each
// offering its output to the next matmul quantized by the same launch (ClStream::offer_quantized).
#include "backend/opencl/cl_backend.h"
#include "core/error.h"

namespace ferrum::ocl {

namespace {
// Offers out, written by the launch just recorded, whose xq arguments start at xq_arg; only
// rows of whole 32-element chunks can be quantized.
void offer(ClStream& cs, const Tensor& out, cl_uint xq_arg) {
  if (out.cols() % 32 != 0) return;
  const BufferView v = single_buffer(out, "offer");
  QuantizableOutput o;
  o.mem = v.mem;
  o.byte_offset = v.byte_offset;
  o.rows = out.rows();
  o.cols = out.cols();
  o.xq_arg = xq_arg;
  cs.offer_quantized(std::move(o));
}
}  // namespace

cl_program ClBackend::gpu_rows_program() { return gpu_program({"common", "gpu_common", "quantize", "gpu_rows"}, ""); }

void ClBackend::gpu_rms_norm(Stream& s, const Tensor* residual, const Tensor& x, const Tensor& w, float eps,
                             const Tensor& out) {
  ClStream& cs = cl_stream(s);
  Launch l = launch_groups(gpu_rows_program(), "norm_rows", x.rows(), tuning_.row_wg);
  KernelArgs a(l);
  a.tensor(residual ? *residual : placeholder(), "rms_norm").i32(residual ? 1 : 0).tensor(x, "rms_norm")
      .tensor(w, "rms_norm").f32(eps).tensor(out, "rms_norm").i32(x.cols());
  const cl_uint xq_arg = a.next_index();
  a.tensor(placeholder(), "rms_norm").i32(0);
  record(s, std::move(l));
  offer(cs, out, xq_arg);
}

void ClBackend::gpu_swiglu(Stream& s, const Tensor& gate_up, const Tensor& out) {
  ClStream& cs = cl_stream(s);
  const int64_t chunks = (out.cols() + 31) / 32;
  Launch l = launch_groups(gpu_rows_program(), "swiglu_rows", (out.rows() * chunks + 63) / 64, 64);
  KernelArgs a(l);
  a.tensor(gate_up, "swiglu").tensor(out, "swiglu").i32(out.rows()).i32(out.cols());
  const cl_uint xq_arg = a.next_index();
  a.tensor(placeholder(), "swiglu").i32(0);
  record(s, std::move(l));
  offer(cs, out, xq_arg);
}

}  // namespace ferrum::ocl
