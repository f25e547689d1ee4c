// RoPE cos/sin tables [positions, head_dim / 2], computed in double on the host. A table holds
// the positions a sequence can reach (the runner passes the smaller of max_model_len and the KV
// pool's tokens), never the model's declared context as such.
#pragma once
#include <vector>

#include "backend/backend.h"
#include "model/config.h"

namespace ferrum {

// freq_factors (optional, GGUF rope_freqs): per-frequency divisors that llama.cpp stores
// instead of Llama-3 scaling parameters.
RopeTable make_rope_table(Backend& be, const ModelConfig& c, int64_t positions,
                          const std::vector<float>& freq_factors);

}  // namespace ferrum
