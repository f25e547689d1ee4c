// Choosing an OpenCL device from the part of a device spec after "opencl" ("", ":P" or ":P:D":
// platform and device by index or by case-insensitive name substring) and owning its context
// and in-order command queue.
#pragma once
#include <CL/cl.h>

#include <string>

namespace ferrum::ocl {

struct DeviceInfo {
  std::string platform_name, device_name, driver_version, device_version;
  size_t max_alloc_bytes = 0;   // largest single buffer (lowered by FERRUM_OPENCL_MAX_ALLOC_BYTES)
  size_t global_mem_bytes = 0;
  size_t max_work_group = 0;
  cl_uint compute_units = 0;
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

 private:
  cl_device_id device_ = nullptr;
  cl_context context_ = nullptr;
  cl_command_queue queue_ = nullptr;
  DeviceInfo info_;
};

}  // namespace ferrum::ocl
