// OpenCL status codes as exceptions: allocation failures become ResourceError (MemoryError in
// Python), everything else a runtime_error naming the call and the code.
#pragma once
#include <CL/cl.h>

#include <string>

namespace ferrum::ocl {

const char* cl_status_name(cl_int status);
[[noreturn]] void throw_cl_error(cl_int status, const char* what);

inline void cl_check(cl_int status, const char* what) {
  if (status != CL_SUCCESS) throw_cl_error(status, what);
}

}  // namespace ferrum::ocl
