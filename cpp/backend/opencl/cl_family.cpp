#include "backend/opencl/cl_family.h"

#include <algorithm>
#include <cstdlib>
#include <iterator>
#include <utility>

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

namespace {

bool power_of_two(int v) { return v > 0 && (v & (v - 1)) == 0; }

// FERRUM_OPENCL_GPU_TUNING: comma-separated NAME=VALUE pairs over t's fields.
void apply_overrides(GpuTuning& t, const std::string& spec) {
  std::pair<const char*, int*> fields[] = {
      {"LANES", &t.lanes}, {"GEMV_GROUPS", &t.gemv_groups}, {"GEMV_ROWS", &t.gemv_rows},
      {"GEMV_TOKENS", &t.gemv_tokens}, {"GEMM_TM", &t.gemm_tm}, {"GEMM_TN", &t.gemm_tn}, {"GEMM_TK", &t.gemm_tk},
      {"GEMM_WM", &t.gemm_wm}, {"GEMM_WN", &t.gemm_wn}, {"ATTN_WG", &t.attn_wg}, {"MAX_GROUP", &t.attn_heads},
      {"ATTN_SPLIT", &t.attn_split}, {"ATTN_SPLIT_TOKENS", &t.attn_split_tokens}, {"ROW_WG", &t.row_wg}};
  size_t start = 0;
  while (start < spec.size()) {
    size_t end = spec.find(',', start);
    if (end == std::string::npos) end = spec.size();
    const std::string item = spec.substr(start, end - start);
    start = end + 1;
    const size_t eq = item.find('=');
    const std::string name = item.substr(0, eq);
    char* stop = nullptr;
    const long value = eq == std::string::npos ? -1 : std::strtol(item.c_str() + eq + 1, &stop, 10);
    if (value < 0 || value > 4096 || !stop || *stop != '\0')
      throw ValueError("FERRUM_OPENCL_GPU_TUNING: bad entry '" + item + "' (expected NAME=VALUE)");
    if (name == "NV_ASM") {
      t.nv_asm = t.nv_asm && value != 0;  // only where the device has it
      continue;
    }
    auto f = std::find_if(std::begin(fields), std::end(fields), [&](const auto& p) { return name == p.first; });
    if (f == std::end(fields)) throw ValueError("FERRUM_OPENCL_GPU_TUNING: unknown size '" + name + "'");
    *f->second = int(value);
  }
  const bool ok = power_of_two(t.lanes) && t.gemv_groups > 0 && t.gemv_rows > 0 && t.gemv_tokens > 0 &&
                  t.gemm_wm > 0 && t.gemm_wn > 0 && t.gemm_tm % t.gemm_wm == 0 && t.gemm_tn % t.gemm_wn == 0 &&
                  t.gemm_tk > 0 && t.gemm_tk % 32 == 0 && power_of_two(t.attn_wg) && power_of_two(t.row_wg) &&
                  t.attn_heads > 0 && t.attn_split > 0 && t.attn_split_tokens >= 0;
  if (!ok)
    throw ValueError("FERRUM_OPENCL_GPU_TUNING: '" + spec + "' breaks a constraint (LANES, ATTN_WG, ROW_WG powers of "
                     "two; GEMM_TM / GEMM_TN multiples of GEMM_WM / GEMM_WN; GEMM_TK a multiple of 32)");
}

}  // namespace

// Starting points for a GPU with 32-wide warps; a tuning run changes them here, per device.
GpuTuning gpu_tuning(const DeviceInfo& info) {
  GpuTuning t;
  t.nv_asm = info.nvidia;
  if (const char* env = std::getenv("FERRUM_OPENCL_GPU_TUNING")) apply_overrides(t, env);
  // Work-groups the device cannot run are shrunk (a device with small ones is rare).
  const int max_wg = int(std::min<size_t>(info.max_work_group, 1024));
  while (t.gemv_wg() > max_wg && t.gemv_groups > 1) t.gemv_groups /= 2;
  while (t.gemm_items() > max_wg && t.gemm_tn % (2 * t.gemm_wn) == 0) t.gemm_wn *= 2;
  while (t.attn_wg > max_wg) t.attn_wg /= 2;
  while (t.row_wg > max_wg) t.row_wg /= 2;
  if (t.gemv_wg() > max_wg || t.gemm_items() > max_wg)
    throw ValueError("the gpu kernels' work-groups exceed the device's " + std::to_string(max_wg) + " work-items");
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
