#include "backend/opencl/cl_stream.h"

#include <algorithm>
#include <climits>

#include "backend/opencl/cl_error.h"
#include "backend/opencl/cl_memory.h"
#include "core/error.h"

namespace ferrum::ocl {

Launch& Launch::operator=(Launch&& o) noexcept {
  if (this != &o) {
    if (kernel) clReleaseKernel(kernel);
    name = o.name;
    kernel = o.kernel;
    o.kernel = nullptr;
    global = o.global;
    local = o.local;
    keep = std::move(o.keep);
  }
  return *this;
}

Launch::~Launch() {
  if (kernel) clReleaseKernel(kernel);
}

ClStream::~ClStream() {
  sync();
  clear();
}

void ClStream::submit() {
  cl_command_queue q = dc_->queue();
  for (const Launch& l : launches_) {
    cl_event ev = nullptr;
    cl_event* evp = profiling_ ? &ev : nullptr;
    cl_check(clEnqueueNDRangeKernel(q, l.kernel, 1, nullptr, &l.global, &l.local, 0, nullptr, evp), l.name);
    if (ev) events_.emplace_back(l.name, ev);
  }
  clFlush(q);
}

void ClStream::sync() { clFinish(dc_->queue()); }

void ClStream::clear() {
  release_events();
  launches_.clear();
}

void ClStream::release_events() {
  for (auto& [name, ev] : events_) clReleaseEvent(ev);
  events_.clear();
}

std::vector<std::pair<std::string, double>> ClStream::kernel_times() {
  sync();
  std::vector<std::pair<std::string, double>> out;
  for (auto& [name, ev] : events_) {
    cl_ulong start = 0, end = 0;
    clGetEventProfilingInfo(ev, CL_PROFILING_COMMAND_START, sizeof(start), &start, nullptr);
    clGetEventProfilingInfo(ev, CL_PROFILING_COMMAND_END, sizeof(end), &end, nullptr);
    out.emplace_back(name, double(end - start));
  }
  release_events();
  return out;
}

template <typename T>
KernelArgs& KernelArgs::raw(const T& v) {
  cl_check(clSetKernelArg(l_.kernel, index_++, sizeof(T), &v), l_.name);
  return *this;
}

KernelArgs& KernelArgs::tensor(const Tensor& t, const char* op) {
  BufferView b = single_buffer(t, op);
  const size_t unit = is_quantized(t.dtype) ? 1 : size_t(dtype_info(t.dtype).block_bytes);
  if (b.byte_offset % unit != 0)
    throw ValueError(std::string(op) + ": tensor " + t.str() + " is not aligned to its element size");
  return buffer(b.mem, int64_t(b.byte_offset / unit), t.storage);
}

KernelArgs& KernelArgs::buffer(cl_mem m, int64_t offset, const std::shared_ptr<Storage>& keep) {
  raw(m);
  raw(cl_long(offset));
  if (keep) l_.keep.push_back(keep);
  return *this;
}

KernelArgs& KernelArgs::i32(int64_t v) {
  if (v < INT_MIN || v > INT_MAX) throw ValueError(std::string(l_.name) + ": size " + std::to_string(v) + " exceeds 32 bits");
  return raw(cl_int(v));
}
KernelArgs& KernelArgs::i64(int64_t v) { return raw(cl_long(v)); }
KernelArgs& KernelArgs::f32(float v) { return raw(cl_float(v)); }
KernelArgs& KernelArgs::local_floats(int64_t n) {
  cl_check(clSetKernelArg(l_.kernel, index_++, size_t(std::max<int64_t>(n, 1)) * sizeof(cl_float), nullptr), l_.name);
  return *this;
}

KernelArgs& KernelArgs::local_ints(int64_t n) {
  cl_check(clSetKernelArg(l_.kernel, index_++, size_t(std::max<int64_t>(n, 1)) * sizeof(cl_int), nullptr), l_.name);
  return *this;
}

}  // namespace ferrum::ocl
