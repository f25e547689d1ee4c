// One config for the whole Llama family (Llama 2/3, Qwen2/2.5, Qwen3, Qwen3-MoE, Mistral), read
// from HF config.json, GGUF metadata or a llama2.c header.
#pragma once
#include <string>
#include <vector>

#include "backend/backend.h"

namespace ferrum {

struct GgufFile;
struct Llama2cHeader;

// Loops over layers and experts stay short for any file: no model has more.
constexpr int64_t kMaxLayers = 1024, kMaxExperts = 1024;

struct ModelConfig {
  std::string arch;  // "llama", "qwen2", "qwen3", "qwen3_moe", "mistral"
  int64_t hidden = 0, intermediate = 0, layers = 0, heads = 0, kv_heads = 0, head_dim = 0;
  int64_t vocab = 0, max_positions = 0;
  double rms_eps = 1e-6;
  double rope_theta = 10000.0;
  RopeLayout rope_layout = RopeLayout::HalfSplit;
  // Llama-3 rope scaling (factor 0 = off)
  double rope_factor = 0.0, rope_low_freq_factor = 1.0, rope_high_freq_factor = 4.0;
  double rope_original_max_positions = 8192.0;
  int64_t sliding_window = 0;  // 0 = none
  bool tie_embeddings = false;
  // Mixture of experts (Qwen3-MoE). A sparse layer routes each token to experts_per_token of
  // `experts` SwiGLU MLPs of width expert_intermediate; the other layers stay dense
  // (`intermediate`). experts == 0: every layer is dense.
  int64_t experts = 0, experts_per_token = 0, expert_intermediate = 0;
  bool norm_topk_prob = false;   // renormalise the top-k routing weights to sum to 1
  std::vector<bool> moe_layers;  // per layer

  bool is_moe_layer(int64_t layer) const { return experts > 0 && moe_layers.at(size_t(layer)); }
  bool has_dense_layer() const;

  int64_t q_dim() const { return heads * head_dim; }
  int64_t kv_dim() const { return kv_heads * head_dim; }
  // The value rules every format shares: sizes positive and bounded, heads a multiple of KV
  // heads, head_dim even, rms_norm_eps in (0, 1], rope_theta positive, rope scaling and MoE
  // settings consistent. FormatError naming source and the first rule broken.
  void validate(const std::string& source) const;
};

// Reads <dir>/config.json.
ModelConfig config_from_hf(const std::string& dir);
ModelConfig config_from_gguf(const GgufFile& g);
ModelConfig config_from_llama2c(const Llama2cHeader& h, const std::string& path);

}  // namespace ferrum
