// cl_khr_command_buffer (0.9.x): a recorded stream's launches captured once, with their kernels
// and arguments, and replayed by one enqueue. The entry points come from the platform
// (clGetExtensionFunctionAddressForPlatform); declared here so any 1.2 header serves.
#pragma once
#include <CL/cl.h>

#include <memory>

namespace ferrum::ocl {

struct CommandBufferApi {
  using Buffer = struct _ferrum_cl_command_buffer*;
  Buffer(CL_API_CALL* create)(cl_uint num_queues, const cl_command_queue* queues,
                              const cl_ulong* properties, cl_int* err) = nullptr;
  cl_int(CL_API_CALL* finalize)(Buffer) = nullptr;
  cl_int(CL_API_CALL* release)(Buffer) = nullptr;
  cl_int(CL_API_CALL* enqueue)(cl_uint num_queues, cl_command_queue* queues, Buffer, cl_uint n_wait,
                               const cl_event* wait, cl_event* event) = nullptr;
  cl_int(CL_API_CALL* ndrange)(Buffer, cl_command_queue, const cl_ulong* properties, cl_kernel,
                               cl_uint work_dim, const size_t* offset, const size_t* global,
                               const size_t* local, cl_uint n_sync, const cl_uint* sync_wait,
                               cl_uint* sync_point, void** mutable_handle) = nullptr;
  bool simultaneous_use = false;  // a buffer may be enqueued again before its last run ends
};

// The API when the device has a usable cl_khr_command_buffer (a 0.9 version, no queue properties
// beyond ours), else null.
std::unique_ptr<CommandBufferApi> load_command_buffer_api(cl_platform_id platform, cl_device_id device,
                                                          cl_command_queue_properties queue_props);

// One recorded stream's command buffer (owned; released with it).
class CommandBuffer {
 public:
  CommandBuffer(const CommandBufferApi& api, cl_command_queue queue);
  ~CommandBuffer();
  CommandBuffer(const CommandBuffer&) = delete;
  CommandBuffer& operator=(const CommandBuffer&) = delete;

  void add(cl_kernel kernel, size_t global, size_t local, const char* name);
  void finalize();
  void enqueue();  // waits for the previous run first unless the device allows simultaneous use

 private:
  const CommandBufferApi& api_;
  cl_command_queue queue_;
  CommandBufferApi::Buffer buffer_ = nullptr;
  cl_event last_run_ = nullptr;
};

}  // namespace ferrum::ocl
