#include "backend/opencl/cl_backend.h"

#include <algorithm>
#include <cstdlib>

#include "backend/opencl/cl_error.h"
#include "core/error.h"

namespace ferrum {

std::shared_ptr<Backend> make_opencl_backend(const std::string& selector, const std::string& kernels) {
  return std::make_shared<ocl::ClBackend>(selector, kernels);
}

namespace ocl {

namespace {
constexpr size_t kPoolCacheBytes = size_t(256) << 20;

const char* weight_define(DType t) {
  switch (t) {
    case DType::F32: return "-DW_F32";
    case DType::F16: return "-DW_F16";
    case DType::BF16: return "-DW_BF16";
    case DType::Q4_0: return "-DW_Q4_0";
    case DType::Q4_1: return "-DW_Q4_1";
    case DType::Q5_0: return "-DW_Q5_0";
    case DType::Q5_1: return "-DW_Q5_1";
    case DType::Q8_0: return "-DW_Q8_0";
    case DType::Q2_K: return "-DW_Q2_K";
    case DType::Q3_K: return "-DW_Q3_K";
    case DType::Q4_K: return "-DW_Q4_K";
    case DType::Q5_K: return "-DW_Q5_K";
    case DType::Q6_K: return "-DW_Q6_K";
    case DType::IQ4_NL: return "-DW_IQ4_NL";
    case DType::IQ4_XS: return "-DW_IQ4_XS";
    default: return nullptr;
  }
}
}  // namespace

ClBackend::ClBackend(const std::string& selector, const std::string& kernels)
    : dc_(std::make_shared<DeviceContext>(selector)),
      pool_(std::make_shared<BufferPool>(dc_, kPoolCacheBytes)),
      programs_(std::make_unique<ProgramCache>(*dc_)) {
  family_ = choose_family(dc_->info(), kernels);
  if (family_ == KernelFamily::Gpu) tuning_ = gpu_tuning(dc_->info());
  placeholder_ = alloc(DType::F32, {16});
  const char* portable = std::getenv("FERRUM_OPENCL_PORTABLE");
  portable_kernels_ = portable && std::string(portable) == "1";
  if (portable_kernels_) tuning_.nv_asm = false;
}

bool ClBackend::supports(Op op, DType w) const {
  switch (op) {
    case Op::Embedding:
    case Op::Linear:
    case Op::MoeExperts:
      return weight_define(w) != nullptr;
    default:
      return true;
  }
}

Tensor ClBackend::alloc(DType dtype, Shape shape) {
  Tensor t;
  t.dtype = dtype;
  t.shape = std::move(shape);
  for (int64_t d : t.shape) FERRUM_CHECK(d >= 0, "negative dimension in " + shape_str(t.shape));
  FERRUM_CHECK(t.cols() % dtype_info(dtype).block_elems == 0,
               "last dim of " + t.str() + " is not a multiple of the block size");
  t.storage = allocate_storage(this, pool_, dc_->info(), t.nbytes(), t.row_bytes());
  return t;
}

Tensor ClBackend::from_host(const void* data, DType dtype, Shape shape, std::shared_ptr<const void>) {
  Tensor t = alloc(dtype, std::move(shape));  // device memory is not host-addressable: always copy
  upload(t, data, t.nbytes());
  return t;
}

std::unique_ptr<Stream> ClBackend::new_stream() {
  auto s = std::make_unique<ClStream>(dc_);
  s->set_command_buffer(family_ == KernelFamily::Gpu);
  return s;
}

void ClBackend::check_owned(const Tensor& t, const char* op) const {
  FERRUM_CHECK(t.defined(), std::string(op) + ": tensor is undefined");
  if (t.storage->backend != this) throw ValueError(std::string(op) + ": tensor " + t.str() + " belongs to another backend");
}

void ClBackend::upload(const Tensor& dst, const void* src, size_t bytes) {
  check_owned(dst, "upload");
  FERRUM_CHECK(bytes <= dst.nbytes(), "upload of " + std::to_string(bytes) + " bytes into " + dst.str());
  const auto& s = static_cast<const ClStorage&>(*dst.storage);
  const size_t begin = dst.offset, end = dst.offset + bytes;
  for (const BufferChunk& c : s.chunks) {
    size_t lo = std::max(begin, c.begin), hi = std::min(end, c.begin + c.bytes);
    if (lo >= hi) continue;
    // Blocking write on the in-order queue: runs after every command submitted before it.
    cl_check(clEnqueueWriteBuffer(dc_->queue(), c.mem, CL_TRUE, lo - c.begin, hi - lo,
                                  static_cast<const char*>(src) + (lo - begin), 0, nullptr, nullptr),
             "clEnqueueWriteBuffer");
  }
}

size_t ClBackend::memory_available_bytes() const {
  const size_t total = dc_->info().global_mem_bytes, used = pool_->bytes_in_use();
  return used < total ? total - used : 0;
}

void ClBackend::materialize(const Tensor& t) {
  check_owned(t, "materialize");
  const auto& s = static_cast<const ClStorage&>(*t.storage);
  const size_t begin = t.offset, end = t.offset + t.nbytes();
  const cl_uchar zero = 0;
  for (const BufferChunk& c : s.chunks) {
    size_t lo = std::max(begin, c.begin), hi = std::min(end, c.begin + c.bytes);
    if (lo >= hi) continue;
    cl_check(clEnqueueFillBuffer(dc_->queue(), c.mem, &zero, 1, lo - c.begin, hi - lo, 0, nullptr, nullptr),
             "clEnqueueFillBuffer");
  }
  cl_check(clFinish(dc_->queue()), "clFinish");
}

void ClBackend::download(const Tensor& src, void* dst, size_t bytes) {
  check_owned(src, "download");
  FERRUM_CHECK(bytes <= src.nbytes(), "download of " + std::to_string(bytes) + " bytes from " + src.str());
  const auto& s = static_cast<const ClStorage&>(*src.storage);
  const size_t begin = src.offset, end = src.offset + bytes;
  for (const BufferChunk& c : s.chunks) {
    size_t lo = std::max(begin, c.begin), hi = std::min(end, c.begin + c.bytes);
    if (lo >= hi) continue;
    cl_check(clEnqueueReadBuffer(dc_->queue(), c.mem, CL_TRUE, lo - c.begin, hi - lo,
                                 static_cast<char*>(dst) + (lo - begin), 0, nullptr, nullptr),
             "clEnqueueReadBuffer");
  }
}

cl_program ClBackend::elementwise_program() { return programs_->get({"common", "elementwise"}, ""); }

cl_program ClBackend::attention_program(DType kv) {
  const char* def = kv == DType::F32 ? "-DKV_F32" : kv == DType::F16 ? "-DKV_F16" : "-DKV_I8";
  return programs_->get({"common", "kv_pool", "attention"}, std::string(def) + " -DMAX_HEAD_DIM=" + std::to_string(kMaxHeadDim));
}

cl_program ClBackend::linear_program(DType w) {
  const char* def = weight_define(w);
  if (!def) throw ValueError(std::string("the OpenCL backend has no kernels for weights of type ") + dtype_name(w));
  return programs_->get({"common", "weights", "quantize", "linear", "moe", "embedding"},
                        std::string(def) + (portable_kernels_ ? " -DPORTABLE_KERNELS" : ""));
}

Launch ClBackend::launch(cl_program program, const char* kernel, int64_t work_items, int64_t max_local) {
  Launch l;
  l.name = kernel;
  l.kernel = programs_->kernel(program, kernel);
  // Enough work-groups to keep every compute unit busy, each as large as that allows (pocl runs
  // a work-group as one task, so tiny groups cost scheduling overhead).
  const int64_t cu = std::max<int64_t>(1, dc_->info().compute_units);
  int64_t local = std::clamp<int64_t>(work_items / (4 * cu), 1, max_local);
  local = std::min<int64_t>(local, int64_t(dc_->info().max_work_group));
  l.local = size_t(local);
  l.global = size_t((work_items + local - 1) / local * local);
  return l;
}

ClStream& ClBackend::cl_stream(Stream& s) {
  auto* cs = dynamic_cast<ClStream*>(&s);
  if (!cs) throw ValueError("an OpenCL op was recorded into a stream of another backend");
  return *cs;
}

void ClBackend::record(Stream& s, Launch&& l, bool keeps_quantized) { cl_stream(s).add(std::move(l), keeps_quantized); }

}  // namespace ocl
}  // namespace ferrum
