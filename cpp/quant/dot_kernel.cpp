// Run-time choice of dot kernel: every ISA's table is built once, and only the ISAs that
// cpu_features() reports are ever handed out.
#include <array>
#include <cstring>

#include "core/cpu_features.h"
#include "core/error.h"
#include "quant/kernels.h"
#include "quant/quant.h"
#include "quant/repack.h"

namespace ferrum::quant {

namespace {

constexpr int kNumTypes = int(kLastType) + 1;
constexpr const char* kIsaNames[] = {"avx512", "avx2", "scalar"};  // fastest first
constexpr int kNumIsas = 3;

bool isa_supported(int isa) {
  const CpuFeatures& f = cpu_features();
  switch (isa) {
    case 0: return f.avx512f && f.avx512bw && f.avx512vl && f.avx512_vnni && f.avx2 && f.fma &&
                   f.f16c;
    case 1: return f.avx2 && f.fma && f.f16c;
    default: return true;
  }
}

struct KernelTable {
  // kernels[isa][type]; present[isa][type] is false where there is none or the CPU lacks it.
  std::array<std::array<DotKernel, kNumTypes>, kNumIsas> kernels{};
  std::array<std::array<bool, kNumTypes>, kNumIsas> present{};

  KernelTable() {
    for (int isa = 0; isa < kNumIsas; ++isa) {
      const bool ok = isa_supported(isa);
      for (int t = 0; t < kNumTypes; ++t) {
        const DType type = DType(t);
        detail::DotRowsFn fn = isa == 0   ? detail::avx512_dot_rows(type)
                               : isa == 1 ? detail::avx2_dot_rows(type)
                                          : detail::scalar_dot_rows(type);
        present[isa][t] = ok && fn != nullptr;
        kernels[isa][t] = DotKernel{detail::dot_act_type(type), fn, kIsaNames[isa]};
      }
    }
  }
};

const KernelTable& table() {
  static const KernelTable t;
  return t;
}

int type_index(DType t) {
  const int i = int(t);
  FERRUM_CHECK(i >= 0 && i < kNumTypes, "dot kernel: bad dtype");
  return i;
}

}  // namespace

const DotKernel* dot_kernel_for_isa(DType weight_type, const char* isa) {
  const int t = type_index(weight_type);
  for (int i = 0; i < kNumIsas; ++i)
    if (std::strcmp(isa, kIsaNames[i]) == 0)
      return table().present[i][t] ? &table().kernels[i][t] : nullptr;
  return nullptr;
}

std::vector<const char*> dot_kernel_isas(DType weight_type) {
  const int t = type_index(weight_type);
  std::vector<const char*> out;
  for (int i = 0; i < kNumIsas; ++i)
    if (table().present[i][t]) out.push_back(kIsaNames[i]);
  return out;
}

const DotKernel& dot_kernel(DType weight_type) {
  const int t = type_index(weight_type);
  for (int i = 0; i < kNumIsas; ++i)
    if (table().present[i][t]) return table().kernels[i][t];
  throw ValueError(std::string("no dot kernel for dtype ") + dtype_name(weight_type));
}

DotBatchFn dot_batch_kernel(DType weight_type) {
  type_index(weight_type);
  static const bool avx512 = isa_supported(0);
  return avx512 ? detail::avx512_dot_batch(weight_type) : nullptr;
}

namespace {
bool float_gemm_supported() {
  const CpuFeatures& f = cpu_features();
  return f.avx512f && f.avx512bw && f.avx512vl && f.f16c && f.avx512_bf16;
}
}  // namespace

DotBatchFn gemm_kernel(DType weight_type) {
  type_index(weight_type);
  const DType file_type = r16_source(weight_type);
  if (file_type == DType::BF16 || file_type == DType::F16 || file_type == DType::F32) {
    static const bool supported = float_gemm_supported();
    return supported ? detail::avx512_float_gemm(weight_type) : nullptr;
  }
  static const bool avx512 = isa_supported(0);
  return avx512 ? detail::avx512_gemm(weight_type) : nullptr;
}

DType gemm_act_type(DType weight_type) {
  // bf16 weights' dot kernel takes f32 activations; their GEMM takes bf16 ones.
  return r16_source(weight_type) == DType::BF16 ? DType::BF16 : detail::dot_act_type(weight_type);
}

const DotKernel& dot_kernel_scalar(DType weight_type) {
  const int t = type_index(weight_type);
  if (!table().present[kNumIsas - 1][t])
    throw ValueError(std::string("no dot kernel for dtype ") + dtype_name(weight_type));
  return table().kernels[kNumIsas - 1][t];
}

}  // namespace ferrum::quant
