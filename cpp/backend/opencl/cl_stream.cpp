#include "backend/opencl/cl_stream.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <mutex>

#include "backend/opencl/cl_error.h"
#include "backend/opencl/cl_memory.h"
#include "core/error.h"

namespace ferrum::ocl {

namespace {
std::mutex counters_mu;
SubmitCounters counters;

// Adds one submit of `launches` launches to the counters when it goes out of scope.
struct CountedSubmit {
  size_t launches;
  bool command_buffer = false;
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  ~CountedSubmit() {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::lock_guard<std::mutex> lock(counters_mu);
    counters.submits++;
    counters.launches += int64_t(launches);
    counters.command_buffer_submits += command_buffer ? 1 : 0;
    counters.host_seconds += s;
  }
};
}  // namespace

SubmitCounters submit_counters() {
  std::lock_guard<std::mutex> lock(counters_mu);
  return counters;
}

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

void ClStream::add(Launch l, bool keeps_quantized) {
  if (!keeps_quantized) offered_.reset();
  command_buffer_.reset();
  launches_.push_back(std::move(l));
}

void ClStream::offer_quantized(QuantizableOutput o) {
  FERRUM_CHECK(!launches_.empty(), "offer_quantized: no launch");
  o.launch = launches_.size() - 1;
  offered_ = std::make_unique<QuantizableOutput>(std::move(o));
}

const Tensor* ClStream::claim_quantized(cl_mem mem, size_t byte_offset, int64_t rows, int64_t cols,
                                        const std::function<Tensor()>& make_xq) {
  QuantizableOutput* o = offered_.get();
  if (!o || o->mem != mem || o->byte_offset != byte_offset || o->rows != rows || o->cols != cols) return nullptr;
  if (!o->xq.defined()) {
    o->xq = make_xq();
    Launch& l = launches_[o->launch];
    KernelArgs a(l, o->xq_arg);
    a.tensor(o->xq, l.name).i32(1);
    command_buffer_.reset();
  }
  return &o->xq;
}

void ClStream::set_command_buffer(bool on) {
  command_buffer_on_ = on;
  command_buffer_.reset();
}

bool ClStream::uses_command_buffer() const { return command_buffer_on_ && !profiling_ && dc_->command_buffer_api(); }

void ClStream::submit() {
  cl_command_queue q = dc_->queue();
  if (launches_.empty()) return;
  bool rebound = false;
  for (const auto& prepare : prepares_) rebound = prepare() || rebound;
  if (rebound) command_buffer_.reset();
  CountedSubmit counted{launches_.size()};
  if (uses_command_buffer()) {
    counted.command_buffer = true;
    if (!command_buffer_) {
      auto cb = std::make_unique<CommandBuffer>(*dc_->command_buffer_api(), q);
      for (const Launch& l : launches_) cb->add(l.kernel, l.global, l.local, l.name);
      cb->finalize();
      command_buffer_ = std::move(cb);
    }
    command_buffer_->enqueue();
    clFlush(q);
    return;
  }
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
  command_buffer_.reset();
  offered_.reset();
  launches_.clear();
  prepares_.clear();
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
