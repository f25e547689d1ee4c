// The OpenCL backend's two kernel families and the one place where each device's choice of family,
// work-group sizes and tile sizes is made.
//   cpu  kernels/{weights,linear,moe,attention,elementwise}.cl: shaped for pocl on CPUs (a weight
//        row per work-item read front to back, x86 builtins, one work-item per attention head).
//   gpu  kernels/gpu_*.cl: shaped for GPUs (lane groups striding a row with coalesced loads and
//        tree reductions, local-memory tiled GEMM, split-KV attention, fused row kernels).
// A GPU device (CL_DEVICE_TYPE_GPU) gets the gpu family, any other the cpu one; the backend option
// or FERRUM_OPENCL_KERNELS=gpu|cpu forces either on any device (tests run both on pocl).
// ValueError (from both functions) for bad values of their environment variables.
#pragma once
#include <string>

#include "backend/opencl/cl_device.h"

namespace ferrum::ocl {

enum class KernelFamily { Cpu, Gpu };
const char* family_name(KernelFamily f);

// requested: "" or "auto" (then FERRUM_OPENCL_KERNELS, then the device type decide), "gpu", "cpu".
// ValueError for anything else.
KernelFamily choose_family(const DeviceInfo& info, const std::string& requested);

// The gpu family's sizes, passed to its programs as -D defines (kernels/gpu_common.cl lists them).
// FERRUM_OPENCL_GPU_TUNING="LANES=16,GEMV_ROWS=4,..." (the define names) overrides them, for tuning
// runs without a rebuild; NV_ASM=0 turns the inline PTX off.
struct GpuTuning {
  int lanes = 32;        // work-items sharing one weight row in a GEMV (a warp on NVIDIA)
  int gemv_groups = 4;   // lane groups per GEMV work-group
  int gemv_rows = 2;     // weight rows per lane group: they share each activation load
  int gemv_tokens = 8;   // tokens per pass of the batched GEMV (each weight chunk decoded once)
  int gemm_tm = 64, gemm_tn = 64, gemm_tk = 32;  // GEMM work-group tile: tokens x rows, K step
  int gemm_wm = 4, gemm_wn = 4;                  // register block of one work-item
  int attn_wg = 64;      // work-items of an attention work-group (KV positions per tile)
  int attn_heads = 8;    // query heads (of one KV head) per attention work-group
  int attn_split = 256;  // KV positions per split of the split-KV (flash-decoding) attention
  int attn_split_tokens = 16;  // steps of up to this many tokens split the KV positions
  int row_wg = 256;      // work-items of the row kernels (norms, QK-norm + RoPE)
  bool nv_asm = false;   // NVIDIA: warp shuffles and dp4a as inline PTX (dropped if a build fails)

  int gemv_wg() const { return lanes * gemv_groups; }
  int gemm_items() const { return (gemm_tm / gemm_wm) * (gemm_tn / gemm_wn); }
  std::string defines() const;
};
GpuTuning gpu_tuning(const DeviceInfo& info);

}  // namespace ferrum::ocl
