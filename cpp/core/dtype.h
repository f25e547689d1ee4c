// Element and block types: the formats weight files store. Quantized types are GGUF block
// formats: a row of n elements is n / block_elems blocks of block_bytes each. A backend that
// keeps a weight in a layout of its own (the CPU's interleaved rows, quant/repack.h) records
// that layout beside the tensor's type, which stays the file's.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace ferrum {

enum class DType : uint8_t {
  F32, F16, BF16, I32, I8,
  Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1,
  Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K,
  IQ4_NL, IQ4_XS,
  I64,  // only read from safetensors (compressed-tensors' weight_shape), never computed on
};
constexpr DType kLastType = DType::I64;

struct DTypeInfo {
  const char* name;
  int block_elems;  // 1 for plain types
  int block_bytes;  // bytes per block (element size for plain types)
  bool quantized;
};

const DTypeInfo& dtype_info(DType t);
inline const char* dtype_name(DType t) { return dtype_info(t).name; }
inline bool is_quantized(DType t) { return dtype_info(t).quantized; }
// Bytes of n elements; n must be a multiple of the block size (checked by callers that parse files).
size_t dtype_bytes(DType t, int64_t n);
DType dtype_from_name(const std::string& name);  // throws ValueError for unknown names

// IEEE half / bfloat16 conversions (scalar; SIMD paths use F16C / AVX-512 BF16 directly).
float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);
inline float bf16_to_f32(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}
uint16_t f32_to_bf16(float f);  // round to nearest even

}  // namespace ferrum
