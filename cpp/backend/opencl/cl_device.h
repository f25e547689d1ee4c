// Choosing an OpenCL device from the part of a device spec after "opencl" ("", ":P" or ":P:D":
// platform and device by index or by case-insensitive name substring) and owning its context
// and in-order command queue.
#pragma once
#include <CL/cl.h>

#include <memory>
#include <string>

#include "backend/opencl/cl_command_buffer.h"

namespace ferrum::ocl {

struct DeviceInfo {
  std::string platform_name, device_name, vendor, driver_version, device_version, extensions;
  size_t max_alloc_bytes = 0;   // largest single buffer (lowered by FERRUM_OPENCL_MAX_ALLOC_BYTES)
  size_t global_mem_bytes = 0;
  size_t local_mem_bytes = 0;
  size_t max_work_group = 0;
  cl_uint compute_units = 0;
  bool gpu = false;             // CL_DEVICE_TYPE_GPU
  bool nvidia = false;          // NVIDIA's driver: its compiler takes inline PTX
  bool command_buffer = false;  // cl_khr_command_buffer 0.9.x (recorded streams replay as one)
  bool has_extension(const std::string& name) const;
};

// A context and a profiling-enabled in-order queue on one device.
class DeviceContext {
 public:
  // Throws ValueError when no platform / device exists or the selector matches none.
  explicit DeviceContext(const std::string& selector);
  ~DeviceContext();
  DeviceContext(const DeviceContext&) = delete;
  DeviceContext& operator=(const DeviceContext&) = delete;

  cl_context context() const { return context_; }
  cl_command_queue queue() const { return queue_; }
  cl_device_id device() const { return device_; }
  const DeviceInfo& info() const { return info_; }
  // cl_khr_command_buffer's entry points, or null where the device has none usable.
  const CommandBufferApi* command_buffer_api() const { return command_buffers_.get(); }

 private:
  cl_device_id device_ = nullptr;
  std::unique_ptr<CommandBufferApi> command_buffers_;
  cl_context context_ = nullptr;
  cl_command_queue queue_ = nullptr;
  DeviceInfo info_;
};

}  // namespace ferrum::ocl
