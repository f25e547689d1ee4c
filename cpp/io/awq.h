// AWQ checkpoints (AutoAWQ / GPTQModel) kept compressed, as GPTQ ones are (io/group_quant.h):
// each module's qweight, qzeros and f16 scales become one `<module>.weight` of a GGUF block type
// holding exactly the same values, w = s * (q - z):
//   gemm: qweight [K, N / 8], qzeros [G, N / 8], scales [G, N], packed along the outputs with
//         the nibble order 0 2 4 6 1 3 5 7;
//   gemv: qweight [N, K / 8], qzeros [N, W], scales [N, 8 W], packed along the inputs in order,
//         W words of zeros padded as AutoAWQ's calculate_zeros_width pads them.
#pragma once
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "io/weight_source.h"

namespace ferrum {

// q: the quantization_config (quant_method awq) read from `where`; modules: those with a
// qweight. ValueError naming the field or tensor for what is not supported (a version other
// than gemm / gemv, bits other than 4, a group size that is not -1 or a multiple of 32, the
// llm-awq backend, `dynamic`) or does not fit the config (a packed tensor's dtype or shape, a
// module both quantized and listed in modules_to_not_convert).
void translate_awq_weights(const nlohmann::json& q, const std::string& where, const std::vector<std::string>& modules,
                           WeightSource& ws);

}  // namespace ferrum
