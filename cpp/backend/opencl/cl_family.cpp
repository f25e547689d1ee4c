#include "backend/opencl/cl_family.h"

#include <algorithm>
#include <cstdlib>

#include "core/error.h"

namespace ferrum::ocl {

const char* family_name(KernelFamily f) { return f == KernelFamily::Gpu ? "gpu" : "cpu"; }

KernelFamily choose_family(const DeviceInfo& info, const std::string& requested) {
  std::string want = requested;
  if (want.empty() || want == "auto") {
    const char* env = std::getenv("FERRUM_OPENCL_KERNELS");
    want = env && *env ? env : "auto";
    if (want != "auto" && want != "gpu" && want != "cpu")
      throw ValueError("FERRUM_OPENCL_KERNELS must be gpu, cpu or auto, got '" + want + "'");
  } else if (want != "gpu" && want != "cpu") {
    throw ValueError("opencl_kernels must be 'gpu', 'cpu' or 'auto', got '" + requested + "'");
  }
  if (want == "auto") return info.gpu ? KernelFamily::Gpu : KernelFamily::Cpu;
  return want == "gpu" ? KernelFamily::Gpu : KernelFamily::Cpu;
}

// Starting points for a GPU with 32-wide warps; a tuning run changes them here, per device.
GpuTuning gpu_tuning(const DeviceInfo& info) {
  GpuTuning t;
  t.nv_asm = info.nvidia;
  // A device with small work-groups (rare) still gets valid launches.
  const int max_wg = int(std::min<size_t>(info.max_work_group, 1024));
  while (t.gemv_wg() > max_wg && t.gemv_groups > 1) t.gemv_groups /= 2;
  while (t.gemm_items() > max_wg) t.gemm_wn *= 2;
  t.attn_wg = std::min(t.attn_wg, max_wg);
  t.row_wg = std::min(t.row_wg, max_wg);
  return t;
}

std::string GpuTuning::defines() const {
  auto d = [](const char* name, int v) { return std::string(" -D") + name + "=" + std::to_string(v); };
  return d("LANES", lanes) + d("GEMV_GROUPS", gemv_groups) + d("GEMV_ROWS", gemv_rows) +
         d("GEMV_TOKENS", gemv_tokens) + d("GEMM_TM", gemm_tm) + d("GEMM_TN", gemm_tn) +
         d("GEMM_TK", gemm_tk) + d("GEMM_WM", gemm_wm) + d("GEMM_WN", gemm_wn) + d("ATTN_WG", attn_wg) +
         d("MAX_GROUP", attn_heads) + d("ATTN_SPLIT", attn_split) + d("ROW_WG", row_wg) + (nv_asm ? " -DNV_ASM" : "");
}

}  // namespace ferrum::ocl
