#include "model/config.h"

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <utility>

#include "core/error.h"
#include "io/gguf.h"
#include "io/llama2c.h"

namespace ferrum {

using json = nlohmann::json;

namespace {

// rope_theta when a checkpoint does not say (the reference design's variant defaults).
double default_rope_theta(const std::string& arch) {
  if (arch == "llama") return 500000.0;
  if (arch == "qwen2" || arch == "qwen3" || arch == "qwen3_moe") return 1000000.0;
  return 10000.0;
}

template <typename T>
T get_or(const json& j, const char* key, T fallback) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  return it->get<T>();
}

// ferrum's arch for a config.json's architectures[0] and model_type. Either alone names it; when
// both are given they must name the same one, or the weights would load as the wrong model.
std::string hf_arch(const json& j, const std::string& path) {
  static const std::pair<const char*, const char*> kArchs[] = {
      {"LlamaForCausalLM", "llama"}, {"Qwen2ForCausalLM", "qwen2"}, {"Qwen3ForCausalLM", "qwen3"},
      {"Qwen3MoeForCausalLM", "qwen3_moe"}, {"MistralForCausalLM", "mistral"}};
  std::string arch_name;
  if (j.contains("architectures") && j["architectures"].is_array() && !j["architectures"].empty())
    arch_name = j["architectures"][0].get<std::string>();
  const std::string model_type = get_or<std::string>(j, "model_type", "");
  std::string by_name, by_type;
  for (const auto& [name, type] : kArchs) {
    if (arch_name == name) by_name = type;
    if (model_type == type) by_type = type;
  }
  const std::string runs = " (ferrum runs Llama, Qwen2, Qwen3, Qwen3-MoE and Mistral)";
  if (!arch_name.empty() && !model_type.empty() && by_name != by_type) {
    if (by_name.empty() && by_type.empty())
      throw FormatError(path + ": unknown architecture '" + arch_name + "'" + runs);
    throw FormatError(path + ": model_type '" + model_type + "' and architectures ['" + arch_name +
                      "'] disagree" + runs);
  }
  if (by_name.empty() && by_type.empty())
    throw FormatError(path + ": unknown architecture '" + (arch_name.empty() ? model_type : arch_name) + "'" +
                      runs);
  return by_name.empty() ? by_type : by_name;
}

void read_llama3_scaling(const json& s, ModelConfig& c, const json& top) {
  std::string type = get_or<std::string>(s, "rope_type", get_or<std::string>(s, "type", "default"));
  if (type == "default" || type == "linear_default") return;
  if (type != "llama3")
    throw FormatError("rope scaling type '" + type + "' is not supported (only llama3)");
  c.rope_factor = get_or<double>(s, "factor", 8.0);
  c.rope_low_freq_factor = get_or<double>(s, "low_freq_factor", 1.0);
  c.rope_high_freq_factor = get_or<double>(s, "high_freq_factor", 4.0);
  c.rope_original_max_positions = get_or<double>(
      s, "original_max_position_embeddings", get_or<double>(top, "original_max_position_embeddings", 8192.0));
  if (c.rope_factor <= 0 || c.rope_low_freq_factor <= 0 || c.rope_high_freq_factor <= c.rope_low_freq_factor ||
      c.rope_original_max_positions <= 0)
    throw FormatError("invalid llama3 rope scaling parameters");
}

// transformers' rule: layer l is sparse unless listed in mlp_only_layers, every `step`-th layer.
void read_hf_moe(const json& j, ModelConfig& c) {
  c.experts = get_or<int64_t>(j, "num_experts", get_or<int64_t>(j, "num_local_experts", 0));
  c.experts_per_token = get_or<int64_t>(j, "num_experts_per_tok", 0);
  c.expert_intermediate = get_or<int64_t>(j, "moe_intermediate_size", 0);
  c.norm_topk_prob = get_or<bool>(j, "norm_topk_prob", false);
  const int64_t step = get_or<int64_t>(j, "decoder_sparse_step", 1);
  if (step <= 0) throw FormatError("decoder_sparse_step must be >= 1");
  std::vector<int64_t> dense_only = get_or<std::vector<int64_t>>(j, "mlp_only_layers", {});
  c.moe_layers.assign(size_t(std::max<int64_t>(c.layers, 0)), false);
  for (int64_t l = 0; l < c.layers; ++l)
    c.moe_layers[size_t(l)] = c.experts > 0 && (l + 1) % step == 0 &&
                              std::find(dense_only.begin(), dense_only.end(), l) == dense_only.end();
}

}  // namespace

bool ModelConfig::has_dense_layer() const {
  for (int64_t l = 0; l < layers; ++l)
    if (!is_moe_layer(l)) return true;
  return false;
}

void ModelConfig::validate(const std::string& source) const {
  auto bad = [&](const std::string& what) { throw FormatError(source + ": " + what); };
  if (hidden <= 0 || layers <= 0 || heads <= 0 || kv_heads <= 0 || head_dim <= 0 ||
      vocab <= 0 || max_positions <= 0)
    bad("config has a missing or non-positive size (hidden " + std::to_string(hidden) + ", layers " +
        std::to_string(layers) + ", heads " + std::to_string(heads) + ", vocab " + std::to_string(vocab) + ")");
  if (int64_t(moe_layers.size()) != layers && experts > 0) bad("MoE layer map does not match the layer count");
  if (has_dense_layer() && intermediate <= 0) bad("intermediate_size must be positive");
  if (experts < 0) bad("num_experts must be >= 0");
  if (experts > 0) {
    if (experts_per_token < 1 || experts_per_token > experts)
      bad("num_experts_per_tok " + std::to_string(experts_per_token) + " must be in [1, num_experts " +
          std::to_string(experts) + "]");
    if (expert_intermediate <= 0) bad("moe_intermediate_size must be positive");
  }
  if (heads % kv_heads) bad("num_attention_heads is not a multiple of num_key_value_heads");
  if (head_dim % 2) bad("head_dim must be even");
  if (sliding_window < 0) bad("sliding_window must be >= 0");
}

ModelConfig config_from_hf(const std::string& dir) {
  const std::string path = dir + "/config.json";
  std::ifstream in(path);
  if (!in) throw FormatError(path + ": cannot open");
  json j;
  try {
    j = json::parse(in);
  } catch (const json::exception& e) {
    throw FormatError(path + ": not valid JSON (" + e.what() + ")");
  }
  ModelConfig c;
  try {
    c.arch = hf_arch(j, path);
    c.hidden = get_or<int64_t>(j, "hidden_size", 0);
    c.intermediate = get_or<int64_t>(j, "intermediate_size", 0);
    c.layers = get_or<int64_t>(j, "num_hidden_layers", 0);
    c.heads = get_or<int64_t>(j, "num_attention_heads", 0);
    c.kv_heads = get_or<int64_t>(j, "num_key_value_heads", c.heads);
    c.head_dim = get_or<int64_t>(j, "head_dim", c.heads ? c.hidden / c.heads : 0);
    c.vocab = get_or<int64_t>(j, "vocab_size", 0);
    c.max_positions = get_or<int64_t>(j, "max_position_embeddings", 2048);
    c.rms_eps = get_or<double>(j, "rms_norm_eps", 1e-6);
    c.tie_embeddings = get_or<bool>(j, "tie_word_embeddings", false);
    // transformers 5 nests rope settings in rope_parameters; older files use top-level keys.
    const json& rope = j.contains("rope_parameters") && j["rope_parameters"].is_object() ? j["rope_parameters"] : j;
    c.rope_theta = get_or<double>(rope, "rope_theta", get_or<double>(j, "rope_theta", default_rope_theta(c.arch)));
    if (&rope != &j) read_llama3_scaling(rope, c, j);
    else if (j.contains("rope_scaling") && j["rope_scaling"].is_object()) read_llama3_scaling(j["rope_scaling"], c, j);
    if (c.arch == "qwen3_moe") read_hf_moe(j, c);
    if (c.arch == "mistral") c.sliding_window = get_or<int64_t>(j, "sliding_window", 0);
    else if (get_or<bool>(j, "use_sliding_window", false)) c.sliding_window = get_or<int64_t>(j, "sliding_window", 0);
  } catch (const json::exception& e) {
    throw FormatError(path + ": malformed config (" + e.what() + ")");
  } catch (const FormatError& e) {
    std::string m = e.what();
    throw FormatError(m.rfind(path, 0) == 0 ? m : path + ": " + m);
  }
  c.validate(path);
  return c;
}

ModelConfig config_from_gguf(const GgufFile& g) {
  const std::string& path = g.weights.path;
  ModelConfig c;
  std::string a = g.get_string("general.architecture");
  if (a != "llama" && a != "qwen2" && a != "qwen3" && a != "qwen3moe" && a != "mistral")
    throw FormatError(path + ": unknown architecture '" + a + "' (ferrum runs llama, qwen2, qwen3, qwen3moe, mistral)");
  c.arch = a == "qwen3moe" ? "qwen3_moe" : a;
  auto key = [&](const std::string& k) { return a + "." + k; };
  c.hidden = g.get_int(key("embedding_length"), 0);
  c.intermediate = g.get_int(key("feed_forward_length"), 0);
  c.layers = g.get_int(key("block_count"), 0);
  c.heads = g.get_int(key("attention.head_count"), 0);
  c.kv_heads = g.get_int(key("attention.head_count_kv"), c.heads);
  c.head_dim = g.get_int(key("attention.key_length"), c.heads ? c.hidden / c.heads : 0);
  c.max_positions = g.get_int(key("context_length"), 2048);
  c.rms_eps = g.get_float(key("attention.layer_norm_rms_epsilon"), 1e-5);
  c.rope_theta = g.get_float(key("rope.freq_base"), 10000.0);  // llama.cpp's default
  c.sliding_window = g.get_int(key("attention.sliding_window"), 0);
  // llama.cpp's converter permutes Llama q/k into interleaved pairs; Qwen keeps NeoX halves.
  c.rope_layout = (a == "llama" || a == "mistral") ? RopeLayout::Interleaved : RopeLayout::HalfSplit;
  const TensorInfo* embd = g.weights.find("token_embd.weight");
  if (!embd) throw FormatError(path + ": no token_embd.weight tensor");
  c.vocab = embd->shape[0];
  c.tie_embeddings = g.weights.find("output.weight") == nullptr;
  if (a == "qwen3moe") {
    c.experts = g.get_int(key("expert_count"), 0);
    c.experts_per_token = g.get_int(key("expert_used_count"), 0);
    c.expert_intermediate = g.get_int(key("expert_feed_forward_length"), 0);
    // llama.cpp always renormalises qwen3moe's top-k weights; the key lets a file say otherwise.
    c.norm_topk_prob = g.get_int(key("expert_weights_norm"), 1) != 0;
    // A layer is sparse when it has a router (llama.cpp's qwen3moe has only sparse layers; a
    // file with dense ones loads here only).
    c.moe_layers.assign(size_t(std::max<int64_t>(c.layers, 0)), false);
    for (int64_t l = 0; l < c.layers; ++l)
      c.moe_layers[size_t(l)] = g.weights.find("blk." + std::to_string(l) + ".ffn_gate_inp.weight") != nullptr;
    if (c.experts <= 0) throw FormatError(path + ": qwen3moe file without " + key("expert_count"));
  }
  c.validate(path);
  return c;
}

ModelConfig config_from_llama2c(const Llama2cHeader& h) {
  ModelConfig c;
  c.arch = "llama";
  c.hidden = h.dim;
  c.intermediate = h.hidden_dim;
  c.layers = h.n_layers;
  c.heads = h.n_heads;
  c.kv_heads = h.n_kv_heads;
  c.head_dim = h.dim / h.n_heads;
  c.vocab = h.vocab_size;
  c.max_positions = h.seq_len;
  c.rms_eps = 1e-5;
  c.rope_theta = 10000.0;
  c.rope_layout = RopeLayout::Interleaved;
  c.tie_embeddings = h.shared_classifier;
  return c;
}

}  // namespace ferrum
