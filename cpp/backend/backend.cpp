#include "backend/backend.h"

#include "backend/cpu/cpu_backend.h"
#include "core/error.h"

namespace ferrum {

const char* op_name(Op op) {
  static const char* names[] = {"embedding",       "linear", "rms_norm",    "add_rms_norm",
                                "qkv_to_cache",    "paged_attention", "swiglu", "gather_rows",
                                "moe_route",       "moe_experts",     "lora",   "gather_columns",
                                "add_group_offsets"};
  return names[static_cast<int>(op)];
}

void Backend::moe_route(Stream&, const Tensor&, int64_t, bool, const Tensor&, const Tensor&) {
  throw ValueError(std::string("moe_route is not supported by the ") + name() + " backend");
}

void Backend::moe_experts(Stream&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                          const Tensor&, const Tensor&, const Tensor&, const MoeExtras&) {
  throw ValueError(std::string("moe_experts is not supported by the ") + name() + " backend");
}

void Backend::lora(Stream&, const Tensor&, const Tensor&, const Tensor&, std::shared_ptr<const LoraSlots>, int64_t,
                   int64_t, const Tensor&) {
  throw ValueError(std::string("LoRA adapters are not supported by the ") + name() + " backend");
}

#if FERRUM_HAVE_OPENCL
std::shared_ptr<Backend> make_opencl_backend(const std::string& selector, const std::string& kernels);
#endif

std::shared_ptr<Backend> make_backend(const std::string& spec, int num_threads, const std::string& opencl_kernels) {
  if (spec == "cpu") return std::make_shared<CpuBackend>(num_threads);
  if (spec == "opencl" || spec.rfind("opencl:", 0) == 0) {
#if FERRUM_HAVE_OPENCL
    return make_opencl_backend(spec.substr(6), opencl_kernels);  // "" or ":platform[:device]"
#else
    throw ValueError("this build of ferrum has no OpenCL backend");
#endif
  }
  throw ValueError("unknown device '" + spec + "' (expected 'cpu' or 'opencl[:platform[:device]]')");
}

}  // namespace ferrum
