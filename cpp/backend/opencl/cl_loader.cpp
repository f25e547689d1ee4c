// The OpenCL entry points the backend calls, defined here as forwarders to the ICD loader
// (libOpenCL.so.1) opened with dlopen on first use, instead of linking it: ferrum then imports on
// machines without OpenCL, and only device="opencl" reports what is missing. A function the
// backend starts calling goes in the list below (until then the import fails: undefined symbol).
#include <dlfcn.h>

#include <string>

// Hidden: these definitions serve ferrum alone, never a library loaded after it.
#pragma GCC visibility push(hidden)
#include <CL/cl.h>
#pragma GCC visibility pop

#include "core/error.h"

namespace ferrum::ocl {
namespace {

constexpr const char* kLoaderName = "libOpenCL.so.1";

struct IcdLoader {
  void* handle = nullptr;
  std::string error;  // dlerror() when handle is null
  IcdLoader() {
    handle = dlopen(kLoaderName, RTLD_NOW | RTLD_LOCAL);
    if (!handle) error = dlerror();
  }
};

const IcdLoader& icd_loader() {
  static const IcdLoader loader;
  return loader;
}

// The loader's function `name`; ValueError when there is no loader or it lacks the function.
template <class Fn>
Fn* resolve(const char* name) {
  const IcdLoader& loader = icd_loader();
  if (!loader.handle)
    throw ValueError(std::string("OpenCL is not available: ") + kLoaderName +
                     " could not be loaded (" + loader.error +
                     "); install an OpenCL ICD loader and a driver (Debian / Ubuntu: "
                     "ocl-icd-libopencl1 and e.g. pocl-opencl-icd)");
  void* fn = dlsym(loader.handle, name);
  if (!fn) throw ValueError(std::string("OpenCL: ") + kLoaderName + " has no " + name);
  return reinterpret_cast<Fn*>(fn);
}

}  // namespace
}  // namespace ferrum::ocl

// `ret name params` calling the loader's `name` with `args`.
#define FERRUM_CL_FORWARD(ret, name, params, args)                                   \
  ret CL_API_CALL name params {                                                      \
    static decltype(name)* const real = ferrum::ocl::resolve<decltype(name)>(#name); \
    return real args;                                                                \
  }

FERRUM_CL_FORWARD(cl_int, clGetPlatformIDs, (cl_uint n, cl_platform_id* ids, cl_uint* count),
                  (n, ids, count))
FERRUM_CL_FORWARD(cl_int, clGetPlatformInfo,
                  (cl_platform_id p, cl_platform_info what, size_t size, void* value, size_t* size_ret),
                  (p, what, size, value, size_ret))
FERRUM_CL_FORWARD(cl_int, clGetDeviceIDs,
                  (cl_platform_id p, cl_device_type type, cl_uint n, cl_device_id* ids, cl_uint* count),
                  (p, type, n, ids, count))
FERRUM_CL_FORWARD(cl_int, clGetDeviceInfo,
                  (cl_device_id d, cl_device_info what, size_t size, void* value, size_t* size_ret),
                  (d, what, size, value, size_ret))
FERRUM_CL_FORWARD(cl_context, clCreateContext,
                  (const cl_context_properties* props, cl_uint n, const cl_device_id* devices,
                   void(CL_CALLBACK* notify)(const char*, const void*, size_t, void*), void* user,
                   cl_int* err),
                  (props, n, devices, notify, user, err))
FERRUM_CL_FORWARD(cl_int, clReleaseContext, (cl_context c), (c))
FERRUM_CL_FORWARD(cl_command_queue, clCreateCommandQueue,
                  (cl_context c, cl_device_id d, cl_command_queue_properties props, cl_int* err),
                  (c, d, props, err))
FERRUM_CL_FORWARD(cl_int, clReleaseCommandQueue, (cl_command_queue q), (q))
FERRUM_CL_FORWARD(cl_int, clFlush, (cl_command_queue q), (q))
FERRUM_CL_FORWARD(cl_int, clFinish, (cl_command_queue q), (q))
FERRUM_CL_FORWARD(cl_mem, clCreateBuffer,
                  (cl_context c, cl_mem_flags flags, size_t size, void* host, cl_int* err),
                  (c, flags, size, host, err))
FERRUM_CL_FORWARD(cl_int, clReleaseMemObject, (cl_mem m), (m))
FERRUM_CL_FORWARD(cl_int, clEnqueueReadBuffer,
                  (cl_command_queue q, cl_mem m, cl_bool blocking, size_t offset, size_t size, void* dst,
                   cl_uint n_wait, const cl_event* wait, cl_event* event),
                  (q, m, blocking, offset, size, dst, n_wait, wait, event))
FERRUM_CL_FORWARD(cl_int, clEnqueueWriteBuffer,
                  (cl_command_queue q, cl_mem m, cl_bool blocking, size_t offset, size_t size,
                   const void* src, cl_uint n_wait, const cl_event* wait, cl_event* event),
                  (q, m, blocking, offset, size, src, n_wait, wait, event))
FERRUM_CL_FORWARD(cl_int, clEnqueueFillBuffer,
                  (cl_command_queue q, cl_mem m, const void* pattern, size_t pattern_size, size_t offset,
                   size_t size, cl_uint n_wait, const cl_event* wait, cl_event* event),
                  (q, m, pattern, pattern_size, offset, size, n_wait, wait, event))
FERRUM_CL_FORWARD(cl_int, clEnqueueCopyBuffer,
                  (cl_command_queue q, cl_mem src, cl_mem dst, size_t src_offset, size_t dst_offset, size_t size,
                   cl_uint n_wait, const cl_event* wait, cl_event* event),
                  (q, src, dst, src_offset, dst_offset, size, n_wait, wait, event))
FERRUM_CL_FORWARD(cl_program, clCreateProgramWithSource,
                  (cl_context c, cl_uint n, const char** strings, const size_t* lengths, cl_int* err),
                  (c, n, strings, lengths, err))
FERRUM_CL_FORWARD(cl_program, clCreateProgramWithBinary,
                  (cl_context c, cl_uint n, const cl_device_id* devices, const size_t* lengths,
                   const unsigned char** binaries, cl_int* status, cl_int* err),
                  (c, n, devices, lengths, binaries, status, err))
FERRUM_CL_FORWARD(cl_int, clBuildProgram,
                  (cl_program p, cl_uint n, const cl_device_id* devices, const char* options,
                   void(CL_CALLBACK* notify)(cl_program, void*), void* user),
                  (p, n, devices, options, notify, user))
FERRUM_CL_FORWARD(cl_int, clGetProgramInfo,
                  (cl_program p, cl_program_info what, size_t size, void* value, size_t* size_ret),
                  (p, what, size, value, size_ret))
FERRUM_CL_FORWARD(cl_int, clGetProgramBuildInfo,
                  (cl_program p, cl_device_id d, cl_program_build_info what, size_t size, void* value,
                   size_t* size_ret),
                  (p, d, what, size, value, size_ret))
FERRUM_CL_FORWARD(cl_int, clReleaseProgram, (cl_program p), (p))
FERRUM_CL_FORWARD(cl_kernel, clCreateKernel, (cl_program p, const char* name, cl_int* err),
                  (p, name, err))
FERRUM_CL_FORWARD(cl_int, clReleaseKernel, (cl_kernel k), (k))
FERRUM_CL_FORWARD(cl_int, clSetKernelArg, (cl_kernel k, cl_uint index, size_t size, const void* value),
                  (k, index, size, value))
FERRUM_CL_FORWARD(cl_int, clEnqueueNDRangeKernel,
                  (cl_command_queue q, cl_kernel k, cl_uint dims, const size_t* offset,
                   const size_t* global, const size_t* local, cl_uint n_wait, const cl_event* wait,
                   cl_event* event),
                  (q, k, dims, offset, global, local, n_wait, wait, event))
FERRUM_CL_FORWARD(cl_int, clGetEventProfilingInfo,
                  (cl_event e, cl_profiling_info what, size_t size, void* value, size_t* size_ret),
                  (e, what, size, value, size_ret))
FERRUM_CL_FORWARD(cl_int, clReleaseEvent, (cl_event e), (e))
FERRUM_CL_FORWARD(cl_int, clWaitForEvents, (cl_uint n, const cl_event* events), (n, events))
FERRUM_CL_FORWARD(void*, clGetExtensionFunctionAddressForPlatform, (cl_platform_id p, const char* name),
                  (p, name))
