// The gpu family's programs, linear (kernels/gpu_linear.cl) and its weight packing.
#include <algorithm>
#include <vector>

#include "backend/opencl/cl_backend.h"
#include "backend/opencl/cl_weight_layout.h"
#include "core/error.h"

namespace ferrum::ocl {

namespace {
constexpr int64_t kChunk = 32;
constexpr size_t kRepackBytes = size_t(32) << 20;  // host staging per piece of a repacked weight

std::string weight_options(DType t) {
  switch (t) {
    case DType::F32: return "-DW_F32";
    case DType::F16: return "-DW_F16";
    case DType::BF16: return "-DW_BF16";
    default: return std::string("-DW_") + dtype_name(t);
  }
}
}  // namespace

cl_program ClBackend::gpu_program(const std::vector<std::string>& sources, const std::string& options) {
  if (tuning_.nv_asm) {
    try {
      return programs_->get(sources, options + tuning_.defines());
    } catch (const std::runtime_error&) {
      tuning_.nv_asm = false;  // a driver without inline PTX: the portable forms from now on
    }
  }
  return programs_->get(sources, options + tuning_.defines());
}

cl_program ClBackend::gpu_linear_program(const Tensor& w) {
  if (!supports(Op::Linear, w.dtype))
    throw ValueError(std::string("the OpenCL backend has no kernels for weights of type ") + dtype_name(w.dtype));
  std::string options = weight_options(w.dtype);
  for (char& c : options) c = char(std::toupper(static_cast<unsigned char>(c)));
  if (block_split(w.dtype)) {
    const bool flat = cl_storage(w, "linear").flat_rows;
    options += " -DW_QALIGN=" + std::to_string(quant_alignment(w.dtype, w.row_bytes(), flat));
    if (flat) options += " -DW_FLAT";
  }
  return gpu_program({"common", "gpu_common", "quantize", "gpu_weights", "gpu_linear", "gpu_moe", "embedding"}, options);
}

Launch ClBackend::launch_groups(cl_program program, const char* kernel, int64_t groups, int64_t local) {
  Launch l;
  l.name = kernel;
  l.kernel = programs_->kernel(program, kernel);
  l.local = size_t(local);
  l.global = size_t(std::max<int64_t>(groups, 1) * local);
  return l;
}

Tensor ClBackend::gpu_quantized(Stream& s, cl_program program, const Tensor& x) {
  ClStream& cs = cl_stream(s);
  const int64_t T = x.rows(), K = x.cols();
  const BufferView v = single_buffer(x, "linear");
  auto make_xq = [&] { return alloc(DType::I8, {T, xq_row_bytes(K)}); };
  if (const Tensor* xq = cs.claim_quantized(v.mem, v.byte_offset, T, K, make_xq)) return *xq;
  Tensor xq = make_xq();
  Launch l = launch(program, "quantize_q8_rows", T * (K / kChunk), 64);
  KernelArgs(l).tensor(x, "linear").i32(T).i32(K).tensor(xq, "linear");
  record(s, std::move(l));
  QuantizableOutput o;
  o.mem = v.mem;
  o.byte_offset = v.byte_offset;
  o.rows = T;
  o.cols = K;
  o.xq = xq;
  cs.offer_quantized(std::move(o));
  return xq;
}

// Decodes over the dot_q8 types: 8-bit activations (as the cpu family); up to GEMV_TOKENS other
// tokens: the f32 GEMV; more: the tiled GEMM.
void ClBackend::gpu_linear(Stream& s, const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& out,
                           int64_t out_col) {
  const int64_t T = x.rows(), K = x.cols();
  cl_program program = gpu_linear_program(w);
  const bool q8 = dot_q8(w.dtype) && !s.float_activations && (T == 1 || s.decode_rows > 0);
  const bool gemv = q8 || T <= tuning_.gemv_tokens;
  const Tensor xin = q8 ? gpu_quantized(s, program, x) : x;
  const char* kernel = q8 ? (T == 1 ? "gemv_q8_t1" : "gemv_q8_tn") : !gemv ? "gemm" : T == 1 ? "gemv_f32_t1" : "gemv_f32_tn";
  const int64_t rows_per_group = gemv ? int64_t(tuning_.gemv_groups) * tuning_.gemv_rows : tuning_.gemm_tn;
  const int64_t token_tiles = gemv ? 1 : (T + tuning_.gemm_tm - 1) / tuning_.gemm_tm;
  const BufferView o = single_buffer(out, "linear");
  for (const RowSegment& seg : row_segments(w, "linear")) {
    if (seg.rows == 0) continue;
    const int64_t groups = token_tiles * ((seg.rows + rows_per_group - 1) / rows_per_group);
    Launch l = launch_groups(program, kernel, groups, gemv ? tuning_.gemv_wg() : tuning_.gemm_items());
    KernelArgs a(l);
    a.tensor(xin, "linear").i32(T).i32(K);
    segment_args(a, seg, w, bias, o, out, out_col);
    record(s, std::move(l), /*keeps_quantized=*/true);
  }
}

// The repack runs on the host, a few rows at a time through a staging buffer: a weight is read
// and written once, in place (no second device copy).
Tensor ClBackend::pack_weight(const Tensor& w, const Consumed&) {
  if (family_ != KernelFamily::Gpu || w.shape.size() != 2 || !flat_layout_pays(w.dtype, w.row_bytes())) return w;
  auto& storage = const_cast<ClStorage&>(cl_storage(w, "pack_weight"));
  if (storage.flat_rows || w.offset != 0 || w.nbytes() != storage.bytes) return w;  // a view: leave it
  const size_t row_bytes = w.row_bytes();
  const int64_t rows_per_piece = std::max<int64_t>(1, int64_t(kRepackBytes / row_bytes));
  std::vector<uint8_t> gguf, flat;
  for (int64_t r = 0; r < w.rows(); r += rows_per_piece) {
    const int64_t n = std::min(rows_per_piece, w.rows() - r);
    const Tensor piece = w.slice(r, n);
    gguf.resize(size_t(n) * row_bytes);
    flat.resize(gguf.size());
    download(piece, gguf.data(), gguf.size());
    flatten_rows(w.dtype, gguf.data(), flat.data(), n, row_bytes);
    upload(piece, flat.data(), flat.size());
  }
  storage.flat_rows = true;
  return w;
}

}  // namespace ferrum::ocl
