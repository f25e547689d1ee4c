// GPTQ checkpoints (AutoGPTQ / GPTQModel) kept compressed: each quantized module's packed
// tensors (qweight, qzeros, scales, g_idx) become one tensor `<module>.weight` of a GGUF block
// type that holds exactly the same values (io/group_quant.h), so the rest of the loader (fusion,
// tensor parallelism, the backends' kernels) treats it as any GGUF weight. AWQ checkpoints are
// dispatched from here to io/awq.h, compressed-tensors ones to io/compressed_tensors.h.
#pragma once
#include <string>

#include "io/weight_source.h"

namespace ferrum {

// Reads dir's quantization_config (config.json's, else quantize_config.json, else AutoAWQ's
// quant_config.json); a float checkpoint (none there) is left as it is. quant_method awq goes
// to translate_awq_weights, compressed-tensors to translate_compressed_tensors_weights.
// ValueError naming the field or tensor for what is not supported (another quant_method or
// format, bits other than 4 and 8 or a group size that is not a multiple of 32, in the config or
// a `dynamic` rule, asymmetric 8-bit) or does not fit the config (a packed tensor's shape or
// dtype, a g_idx entry out of range, an act-order group that is not whole 32-input blocks).
void translate_quantized_weights(const std::string& dir, WeightSource& ws);

}  // namespace ferrum
