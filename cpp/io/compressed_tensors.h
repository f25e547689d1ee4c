// compressed-tensors checkpoints (llm-compressor, quant_method compressed-tensors, format
// pack-quantized) kept compressed, as GPTQ and AWQ ones are (io/group_quant.h): each quantized
// module's tensors become one `<module>.weight` of a GGUF block type holding exactly the same
// values, w = s * (q - z):
//   weight_packed      I32 [N, K * b / 32]  b-bit codes packed along the inputs, low bits first,
//                                           each stored as its signed value + 2^(b - 1)
//   weight_scale       F16 / BF16 / F32 [N, G]  (G = 1 for the channel strategy)
//   weight_zero_point  I32 [N * b / 32, G]  packed the same way along the outputs (asymmetric only)
//   weight_shape       I64 [2] = {N, K}
//   weight_g_idx       I32 [K]              (older act-order files; only group order is read)
// The module's scheme is the config group whose targets match its name first, in
// compressed-tensors' own order: exact names, then "re:" regexes (matched from the name's
// start), then the class name "Linear".
#pragma once
#include <string>

#include <nlohmann/json.hpp>

#include "io/weight_source.h"

namespace ferrum {

// q: the quantization_config (quant_method compressed-tensors) read from `where`. ValueError
// naming the field or tensor for what is not supported (a format other than pack-quantized,
// activation or kv-cache quantization, sparsity or transforms, bits other than 4 and 8, a
// strategy other than group and channel, a group size that is not a multiple of 32, dynamic
// or asymmetric 8-bit weights, act-order out of group order) or does not fit the config (a
// tensor's dtype or shape, a packed module no group targets or one `ignore` lists).
void translate_compressed_tensors_weights(const nlohmann::json& q, const std::string& where, WeightSource& ws);

}  // namespace ferrum
