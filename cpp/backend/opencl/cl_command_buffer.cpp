#include "backend/opencl/cl_command_buffer.h"

#include <string>

#include "backend/opencl/cl_error.h"

namespace ferrum::ocl {

namespace {
constexpr cl_device_info kCapabilities = 0x12A9;            // CL_DEVICE_COMMAND_BUFFER_CAPABILITIES_KHR
constexpr cl_device_info kRequiredQueueProps = 0x12AA;      // ..._REQUIRED_QUEUE_PROPERTIES_KHR
constexpr cl_bitfield kSimultaneousUseCapability = 1 << 2;  // CL_COMMAND_BUFFER_CAPABILITY_SIMULTANEOUS_USE_KHR
constexpr cl_ulong kFlagsProperty = 0x1293;                 // CL_COMMAND_BUFFER_FLAGS_KHR
constexpr cl_ulong kSimultaneousUseFlag = 1 << 0;           // CL_COMMAND_BUFFER_SIMULTANEOUS_USE_KHR

template <class Fn>
bool resolve(cl_platform_id p, const char* name, Fn& fn) {
  fn = reinterpret_cast<Fn>(clGetExtensionFunctionAddressForPlatform(p, name));
  return fn != nullptr;
}
}  // namespace

std::unique_ptr<CommandBufferApi> load_command_buffer_api(cl_platform_id platform, cl_device_id device,
                                                          cl_command_queue_properties queue_props) {
  cl_bitfield required = 0, caps = 0;
  if (clGetDeviceInfo(device, kRequiredQueueProps, sizeof(required), &required, nullptr) != CL_SUCCESS ||
      clGetDeviceInfo(device, kCapabilities, sizeof(caps), &caps, nullptr) != CL_SUCCESS)
    return nullptr;
  if ((required & ~cl_bitfield(queue_props)) != 0) return nullptr;
  auto api = std::make_unique<CommandBufferApi>();
  if (!resolve(platform, "clCreateCommandBufferKHR", api->create) ||
      !resolve(platform, "clFinalizeCommandBufferKHR", api->finalize) ||
      !resolve(platform, "clReleaseCommandBufferKHR", api->release) ||
      !resolve(platform, "clEnqueueCommandBufferKHR", api->enqueue) ||
      !resolve(platform, "clCommandNDRangeKernelKHR", api->ndrange))
    return nullptr;
  api->simultaneous_use = (caps & kSimultaneousUseCapability) != 0;
  return api;
}

CommandBuffer::CommandBuffer(const CommandBufferApi& api, cl_command_queue queue) : api_(api), queue_(queue) {
  const cl_ulong props[] = {kFlagsProperty, kSimultaneousUseFlag, 0};
  cl_int st = CL_SUCCESS;
  buffer_ = api_.create(1, &queue_, api_.simultaneous_use ? props : nullptr, &st);
  cl_check(st, "clCreateCommandBufferKHR");
}

CommandBuffer::~CommandBuffer() {
  if (last_run_) {
    clWaitForEvents(1, &last_run_);
    clReleaseEvent(last_run_);
  }
  if (buffer_) api_.release(buffer_);
}

void CommandBuffer::add(cl_kernel kernel, size_t global, size_t local, const char* name) {
  cl_check(api_.ndrange(buffer_, nullptr, nullptr, kernel, 1, nullptr, &global, &local, 0, nullptr, nullptr, nullptr),
           (std::string("clCommandNDRangeKernelKHR(") + name + ")").c_str());
}

void CommandBuffer::finalize() { cl_check(api_.finalize(buffer_), "clFinalizeCommandBufferKHR"); }

void CommandBuffer::enqueue() {
  if (last_run_) {
    if (!api_.simultaneous_use) clWaitForEvents(1, &last_run_);
    clReleaseEvent(last_run_);
    last_run_ = nullptr;
  }
  cl_check(api_.enqueue(1, &queue_, buffer_, 0, nullptr, &last_run_), "clEnqueueCommandBufferKHR");
}

}  // namespace ferrum::ocl
