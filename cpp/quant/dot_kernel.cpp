// Run-time choice of dot kernel: every ISA's table is built once, and only the ISAs that
// cpu_features() reports are ever handed out.
#include <array>
#include <cstring>

#include "core/cpu_features.h"
#include "core/error.h"
#include "quant/kernels.h"
#include "quant/quant.h"

namespace ferrum::quant {

namespace {

constexpr int kNumTypes = int(kLastType) + 1;
constexpr int kNumLayouts = 2;  // WeightLayout::Plain, R16
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

// One ISA's row kernel for (type, layout), or nullptr; the R16 layout has no scalar kernels.
detail::DotRowsFn isa_dot_rows(int isa, DType type, WeightLayout layout) {
  if (layout == WeightLayout::R16)
    return isa == 0 ? detail::avx512_r16_dot_rows(type) : isa == 1 ? detail::avx2_r16_dot_rows(type) : nullptr;
  switch (isa) {
    case 0: return detail::avx512_dot_rows(type);
    case 1: return detail::avx2_dot_rows(type);
    default: return detail::scalar_dot_rows(type);
  }
}

struct KernelTable {
  // kernels[layout][isa][type]; present[...] is false where there is none or the CPU lacks it.
  std::array<std::array<std::array<DotKernel, kNumTypes>, kNumIsas>, kNumLayouts> kernels{};
  std::array<std::array<std::array<bool, kNumTypes>, kNumIsas>, kNumLayouts> present{};

  KernelTable() {
    for (int l = 0; l < kNumLayouts; ++l) {
      for (int isa = 0; isa < kNumIsas; ++isa) {
        const bool ok = isa_supported(isa);
        for (int t = 0; t < kNumTypes; ++t) {
          detail::DotRowsFn fn = isa_dot_rows(isa, DType(t), WeightLayout(l));
          present[l][isa][t] = ok && fn != nullptr;
          kernels[l][isa][t] = DotKernel{detail::dot_act_type(DType(t)), fn, kIsaNames[isa]};
        }
      }
    }
  }
  const DotKernel* find(DType type, WeightLayout layout, int isa) const {
    const int t = int(type), l = int(layout);
    FERRUM_CHECK(t >= 0 && t < kNumTypes && l >= 0 && l < kNumLayouts, "dot kernel: bad dtype or layout");
    return present[l][isa][t] ? &kernels[l][isa][t] : nullptr;
  }
};

const KernelTable& table() {
  static const KernelTable t;
  return t;
}

[[noreturn]] void no_kernel(DType t) { throw ValueError(std::string("no dot kernel for dtype ") + dtype_name(t)); }

}  // namespace

const DotKernel* dot_kernel_for_isa(DType weight_type, const char* isa, WeightLayout layout) {
  for (int i = 0; i < kNumIsas; ++i)
    if (std::strcmp(isa, kIsaNames[i]) == 0) return table().find(weight_type, layout, i);
  return nullptr;
}

std::vector<const char*> dot_kernel_isas(DType weight_type, WeightLayout layout) {
  std::vector<const char*> out;
  for (int i = 0; i < kNumIsas; ++i)
    if (table().find(weight_type, layout, i)) out.push_back(kIsaNames[i]);
  return out;
}

const DotKernel& dot_kernel(DType weight_type, WeightLayout layout) {
  for (int i = 0; i < kNumIsas; ++i)
    if (const DotKernel* k = table().find(weight_type, layout, i)) return *k;
  no_kernel(weight_type);
}

DotBatchFn dot_batch_kernel(DType weight_type, WeightLayout layout) {
  static const bool avx512 = isa_supported(0);
  if (!avx512) return nullptr;
  if (layout == WeightLayout::R16) {
    if (DotBatchFn gemm = detail::avx512_r16_gemm(weight_type)) return gemm;
    return detail::avx512_float_r16_dot_batch(weight_type);
  }
  return has_dot_batch(weight_type) ? detail::avx512_dot_batch(weight_type) : nullptr;
}

DotBatchFn decode_batch_kernel(DType weight_type, WeightLayout layout, int64_t T) {
  static const bool avx512 = isa_supported(0), avx2 = isa_supported(1);
  if (T < 2) return nullptr;
  if (avx512) return dot_batch_kernel(weight_type, layout);
  // Below AVX-512: the AVX2 GEMM (the row kernel's bits) unpacks each weight block once for all
  // rows; over the row kernel's passes on L1-resident tiles that pays from 4 rows, for Q8_0,
  // whose row kernel unpacks nothing, from 8 (interleaved runs, docs/performance.md).
  // In the R16 layout the GEMM reads each block once for every row from 2 on.
  if (!avx2) return nullptr;
  if (layout == WeightLayout::R16) return gemm_kernel(weight_type, layout);
  if (T < (weight_type == DType::Q8_0 ? 8 : 4)) return nullptr;
  return gemm_kernel(weight_type, layout);
}

bool has_dot_batch(DType weight_type) {
  switch (weight_type) {
    case DType::Q4_0:
    case DType::Q4_1:
    case DType::Q5_0:
    case DType::Q5_1:
    case DType::Q8_0:
      return true;
    default:
      return false;
  }
}

namespace {
bool float_gemm_supported() {
  const CpuFeatures& f = cpu_features();
  return f.avx512f && f.avx512bw && f.avx512vl && f.f16c && f.avx512_bf16;
}

// One ISA's GEMM for (type, layout), or nullptr. Float weights have AVX512_BF16 GEMMs only; the
// quantized types have one on every ISA (file layout; R16: AVX-512, and AVX2 for the legacy types, Q4_K, Q5_K and Q6_K), except IQ4_NL / IQ4_XS,
// whose AVX-512 GEMMs are the R16 layout's only.
bool is_float(DType t) { return t == DType::BF16 || t == DType::F16 || t == DType::F32; }

DotBatchFn isa_gemm(int isa, DType type, WeightLayout layout) {
  if (is_float(type)) {
    static const bool supported = float_gemm_supported();
    return isa == 0 && supported ? detail::avx512_float_gemm(type, layout) : nullptr;
  }
  if (isa == 0) return layout == WeightLayout::R16 ? detail::avx512_r16_gemm(type) : detail::avx512_gemm(type);
  if (layout == WeightLayout::R16) return isa == 1 ? detail::avx2_r16_gemm(type) : nullptr;
  return isa == 1 ? detail::avx2_gemm(type) : detail::scalar_gemm(type);
}
}  // namespace

DotBatchFn gemm_kernel_for_isa(DType weight_type, const char* isa, WeightLayout layout) {
  for (int i = 0; i < kNumIsas; ++i)
    if (std::strcmp(isa, kIsaNames[i]) == 0) return isa_supported(i) ? isa_gemm(i, weight_type, layout) : nullptr;
  return nullptr;
}

DotBatchFn gemm_kernel(DType weight_type, WeightLayout layout) {
  static const bool avx512 = isa_supported(0);
  if (avx512 || is_float(weight_type)) return isa_gemm(0, weight_type, layout);
  // Below AVX-512 VNNI: the GEMM of the row kernel's ISA, which equals it bit for bit.
  for (int i = 1; i < kNumIsas; ++i)
    if (table().find(weight_type, layout, i)) return isa_gemm(i, weight_type, layout);
  return nullptr;
}

DType gemm_act_type(DType weight_type) {
  // bf16 weights' dot kernel takes f32 activations; their GEMM takes bf16 ones.
  return weight_type == DType::BF16 ? DType::BF16 : detail::dot_act_type(weight_type);
}

const DotKernel& dot_kernel_scalar(DType weight_type) {
  if (const DotKernel* k = table().find(weight_type, WeightLayout::Plain, kNumIsas - 1)) return *k;
  no_kernel(weight_type);
}

}  // namespace ferrum::quant
