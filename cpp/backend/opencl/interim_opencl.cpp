// INTERIM: replaced by the OpenCL backend.
#include "backend/backend.h"
#include "core/error.h"
namespace ferrum {
std::shared_ptr<Backend> make_opencl_backend(const std::string&) { throw ValueError("OpenCL backend not built yet"); }
}
