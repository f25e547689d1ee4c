// A stream is a list of prepared launches: kernels with every argument already set (tensors are
// bound as buffer + offset; dynamic values such as token ids or block tables are read by the
// kernels from device buffers). submit() enqueues the whole list on the in-order queue, without
// waiting for anything, so a recorded step is replayed after the runner rewrites its input
// buffers; where the device has cl_khr_command_buffer, the list is captured once into a command
// buffer and each submit is a single enqueue. Ops whose inputs are host objects chosen per submit
// (LoRA's slots) add a prepare step that runs first and may rebind their launches. With profiling
// on, each launch is enqueued on its own with an event, and kernel_times() reports device time.
#pragma once
#include <CL/cl.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "backend/opencl/cl_command_buffer.h"
#include "backend/opencl/cl_device.h"

namespace ferrum::ocl {

struct Launch {
  Launch() = default;
  Launch(Launch&& o) noexcept { *this = std::move(o); }
  Launch& operator=(Launch&& o) noexcept;
  Launch(const Launch&) = delete;
  ~Launch();

  const char* name = "";
  cl_kernel kernel = nullptr;  // owned
  size_t global = 0, local = 0;
  std::vector<std::shared_ptr<Storage>> keep;  // buffers the launch uses stay alive with it
};

// A launch's f32 output [rows, cols] at (mem, byte_offset) that is also (or can also be) written
// quantized to 8 bits (kernels/quantize.cl): by a quantize_q8_rows launch (xq defined), or by the
// producing kernel itself once its arguments xq_arg .. xq_arg + 2 (xq buffer, offset, enable)
// are set (the gpu family's norms and SwiGLU).
struct QuantizableOutput {
  size_t launch = 0;
  cl_mem mem = nullptr;
  size_t byte_offset = 0;
  int64_t rows = 0, cols = 0;
  cl_uint xq_arg = 0;
  Tensor xq;
};

// What every stream of the process has submitted (for benchmarks: launches per step, host time
// per step): submit() calls, launches they enqueued (a command buffer's count as its launches),
// and the host time spent inside submit().
struct SubmitCounters {
  int64_t submits = 0, launches = 0, command_buffer_submits = 0;
  double host_seconds = 0;
};
SubmitCounters submit_counters();

class ClStream : public Stream {
 public:
  explicit ClStream(std::shared_ptr<DeviceContext> dc) : dc_(std::move(dc)) {}
  ~ClStream() override;
  void submit() override;
  void sync() override;
  void clear() override;
  size_t size() const override { return launches_.size(); }

  // keeps_quantized: the launch only reads the last offered output (a matmul over it), which
  // stays claimable; any other launch ends the offer.
  void add(Launch l, bool keeps_quantized = false);
  // The output of the launch just added can be claimed quantized (until the next add that does
  // not keep it).
  void offer_quantized(QuantizableOutput o);
  // The offered output if it is exactly [rows, cols] at (mem, byte_offset), with its xq set
  // (quantize(xq) is called to make xq when the producer writes it itself); else null.
  const Tensor* claim_quantized(cl_mem mem, size_t byte_offset, int64_t rows, int64_t cols,
                                const std::function<Tensor()>& make_xq);
  // fn runs at each submit, in the order added, before any launch is enqueued (it may enqueue
  // copies of its own); it returns true when it changed a recorded launch's arguments.
  void add_prepare(std::function<bool()> fn) { prepares_.push_back(std::move(fn)); }
  void set_profiling(bool on) { profiling_ = on; }
  // Replay through a command buffer where the device has one (ClBackend::new_stream decides).
  void set_command_buffer(bool on);
  bool uses_command_buffer() const;
  // (launch name, device nanoseconds) for every launch of the submits since the last call.
  std::vector<std::pair<std::string, double>> kernel_times();

 private:
  void release_events();
  std::shared_ptr<DeviceContext> dc_;
  std::vector<Launch> launches_;
  std::vector<std::function<bool()>> prepares_;
  bool profiling_ = false;
  bool command_buffer_on_ = false;
  std::unique_ptr<CommandBuffer> command_buffer_;  // of launches_ as they are; dropped on change
  std::unique_ptr<QuantizableOutput> offered_;
  std::vector<std::pair<const char*, cl_event>> events_;
};

// Sets the arguments of one launch in order. tensor() passes (buffer, offset in elements of the
// tensor's type; bytes for block-quantized types) and keeps the storage alive.
class KernelArgs {
 public:
  // Sets arguments first_index, first_index + 1, ...
  KernelArgs(Launch& l, cl_uint first_index = 0) : l_(l), index_(first_index) {}
  cl_uint next_index() const { return index_; }
  KernelArgs& tensor(const Tensor& t, const char* op);
  KernelArgs& buffer(cl_mem m, int64_t offset, const std::shared_ptr<Storage>& keep);
  KernelArgs& i32(int64_t v);
  KernelArgs& i64(int64_t v);
  KernelArgs& f32(float v);
  // A local-memory buffer of n floats / ints (n >= 1), one per work-group.
  KernelArgs& local_floats(int64_t n);
  KernelArgs& local_ints(int64_t n);

 private:
  template <typename T>
  KernelArgs& raw(const T& v);
  Launch& l_;
  cl_uint index_ = 0;
};

}  // namespace ferrum::ocl
