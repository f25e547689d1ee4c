// GPTQ checkpoints (AutoGPTQ / GPTQModel) kept compressed: each quantized module's packed
// tensors (qweight, qzeros, scales, g_idx) become one tensor `<module>.weight` of a GGUF block
// type that holds exactly the same values, so the rest of the loader (fusion, tensor
// parallelism, the backends' kernels) treats it as any GGUF weight:
//   4-bit, every zero 8 (symmetric):  Q4_0, w = s * (q - 8)
//   4-bit, other zeros (asymmetric):  Q5_0, w = s * ((q - z + 16) - 16)
//   8-bit, every zero 128:            Q8_0, w = s * (q - 128)
// A group (group_size columns sharing a scale and zero) is whole 32-column blocks, each block
// taking its group's fp16 scale as its own.
#pragma once
#include <string>

#include "io/weight_source.h"

namespace ferrum {

// Reads dir's quantization_config (config.json's, else quantize_config.json); a float
// checkpoint (none there) is left as it is. ValueError naming the field or tensor for what is
// not supported (another quant_method or format, bits other than 4 and 8, a group size that is
// not a multiple of 32, act-order, `dynamic`, asymmetric 8-bit) or does not fit the config (a
// packed tensor's shape or dtype, a g_idx entry out of range).
void translate_quantized_weights(const std::string& dir, WeightSource& ws);

}  // namespace ferrum
