// INTERIM (replaced by the quant branch): scalar float paths only, so the backend links.
#include <cstring>
#include <vector>

#include "core/error.h"
#include "quant/quant.h"

namespace ferrum::quant {

void dequantize_row(DType t, const void* src, float* dst, int64_t n) {
  const uint16_t* h = static_cast<const uint16_t*>(src);
  switch (t) {
    case DType::F32: std::memcpy(dst, src, size_t(n) * 4); return;
    case DType::F16: for (int64_t i = 0; i < n; ++i) dst[i] = f16_to_f32(h[i]); return;
    case DType::BF16: for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(h[i]); return;
    default: throw ValueError("interim: no dequantize for this type");
  }
}

void quantize_row(DType t, const float* src, void* dst, int64_t n) {
  if (t != DType::F32) throw ValueError("interim: no quantize");
  std::memcpy(dst, src, size_t(n) * 4);
}

namespace {
void dot_generic(DType t, int64_t n, const void* w, size_t stride, int64_t rows, const void* act, float* out) {
  std::vector<float> tmp(n);
  const float* a = static_cast<const float*>(act);
  for (int64_t r = 0; r < rows; ++r) {
    dequantize_row(t, static_cast<const char*>(w) + r * stride, tmp.data(), n);
    double s = 0;
    for (int64_t i = 0; i < n; ++i) s += double(tmp[i]) * a[i];
    out[r] = float(s);
  }
}
const DotKernel kF32{DType::F32, [](int64_t n, const void* w, size_t s, int64_t r, const void* a, float* o) { dot_generic(DType::F32, n, w, s, r, a, o); }, "scalar"};
const DotKernel kF16{DType::F32, [](int64_t n, const void* w, size_t s, int64_t r, const void* a, float* o) { dot_generic(DType::F16, n, w, s, r, a, o); }, "scalar"};
const DotKernel kBF16{DType::F32, [](int64_t n, const void* w, size_t s, int64_t r, const void* a, float* o) { dot_generic(DType::BF16, n, w, s, r, a, o); }, "scalar"};
}  // namespace

const DotKernel& dot_kernel(DType t) {
  switch (t) {
    case DType::F32: return kF32;
    case DType::F16: return kF16;
    case DType::BF16: return kBF16;
    default: throw ValueError("interim: no dot kernel");
  }
}
const DotKernel& dot_kernel_scalar(DType t) { return dot_kernel(t); }

}  // namespace ferrum::quant
