// llama2.c checkpoints (the legacy .bin of karpathy/llama2.c): a 7-int header then f32 weights.
// Tensors are presented under GGUF names; Q/K keep llama2.c's interleaved RoPE layout.
#pragma once
#include <string>

#include "io/weight_source.h"

namespace ferrum {

struct Llama2cHeader {
  int dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len;
  bool shared_classifier;
};

WeightSource open_llama2c(const std::string& path, Llama2cHeader* header);

}  // namespace ferrum
