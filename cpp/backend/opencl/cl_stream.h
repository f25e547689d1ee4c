// A stream is a list of prepared launches: kernels with every argument already set (tensors are
// bound as buffer + offset; dynamic values such as token ids or block tables are read by the
// kernels from device buffers). submit() enqueues the whole list on the
// in-order queue, so a recorded step is replayed after the runner rewrites its input buffers.
// With profiling on, each launch records an event and kernel_times() reports device time.
#pragma once
#include <CL/cl.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend.h"
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

class ClStream : public Stream {
 public:
  explicit ClStream(std::shared_ptr<DeviceContext> dc) : dc_(std::move(dc)) {}
  ~ClStream() override;
  void submit() override;
  void sync() override;
  void clear() override;
  size_t size() const override { return launches_.size(); }

  void add(Launch l) { launches_.push_back(std::move(l)); }
  void set_profiling(bool on) { profiling_ = on; }
  // (launch name, device nanoseconds) for every launch of the submits since the last call.
  std::vector<std::pair<std::string, double>> kernel_times();

 private:
  void release_events();
  std::shared_ptr<DeviceContext> dc_;
  std::vector<Launch> launches_;
  bool profiling_ = false;
  std::vector<std::pair<const char*, cl_event>> events_;
};

// Sets the arguments of one launch in order. tensor() passes (buffer, offset in elements of the
// tensor's type; bytes for block-quantized types) and keeps the storage alive.
class KernelArgs {
 public:
  KernelArgs(Launch& l) : l_(l) {}
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
