#include "model/config.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <optional>
#include <utility>

#include "core/error.h"
#include "io/gguf.h"
#include "io/json_strict.h"
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

// config.json values of the type their key needs (nullopt when absent or null). No conversion:
// an integer key refuses 2048.0 and "2048", a boolean key refuses 1.
std::optional<int64_t> json_int(const json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::nullopt;
  if (!it->is_number_integer()) throw FormatError(std::string("'") + key + "' is " + it->type_name() + " " + it->dump() + ", expected an integer");
  if (it->is_number_unsigned() && it->get<uint64_t>() > uint64_t(INT64_MAX))
    throw FormatError(std::string("'") + key + "' is out of range (" + it->dump() + ")");
  return it->get<int64_t>();
}
std::optional<double> json_real(const json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::nullopt;
  if (!it->is_number()) throw FormatError(std::string("'") + key + "' is " + it->type_name() + ", expected a number");
  return it->get<double>();
}
std::optional<bool> json_bool(const json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::nullopt;
  if (!it->is_boolean()) throw FormatError(std::string("'") + key + "' is " + it->type_name() + ", expected true or false");
  return it->get<bool>();
}
std::optional<std::string> json_string(const json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::nullopt;
  if (!it->is_string()) throw FormatError(std::string("'") + key + "' is " + it->type_name() + ", expected a string");
  return it->get<std::string>();
}

// ferrum's arch for a config.json's architectures[0] and model_type. Either alone names it; when
// both are given they must name the same one, or the weights would load as the wrong model.
std::string hf_arch(const json& j, const std::string& path) {
  static const std::pair<const char*, const char*> kArchs[] = {
      {"LlamaForCausalLM", "llama"}, {"Qwen2ForCausalLM", "qwen2"}, {"Qwen3ForCausalLM", "qwen3"},
      {"Qwen3MoeForCausalLM", "qwen3_moe"}, {"MistralForCausalLM", "mistral"}};
  std::string arch_name;
  if (auto it = j.find("architectures"); it != j.end() && it->is_array() && !it->empty()) {
    if (!(*it)[0].is_string()) throw FormatError("'architectures' holds " + (*it)[0].dump() + ", not a name");
    arch_name = (*it)[0].get<std::string>();
  }
  const std::string model_type = json_string(j, "model_type").value_or("");
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
  std::string type = json_string(s, "rope_type").value_or(json_string(s, "type").value_or("default"));
  if (type == "default" || type == "linear_default") return;
  if (type != "llama3")
    throw FormatError("rope scaling type '" + type + "' is not supported (only llama3)");
  c.rope_factor = json_real(s, "factor").value_or(8.0);
  c.rope_low_freq_factor = json_real(s, "low_freq_factor").value_or(1.0);
  c.rope_high_freq_factor = json_real(s, "high_freq_factor").value_or(4.0);
  c.rope_original_max_positions = json_real(s, "original_max_position_embeddings")
                                      .value_or(json_real(top, "original_max_position_embeddings").value_or(8192.0));
}

// transformers' rule: layer l is sparse unless listed in mlp_only_layers, every `step`-th layer.
void read_hf_moe(const json& j, ModelConfig& c) {
  c.experts = json_int(j, "num_experts").value_or(json_int(j, "num_local_experts").value_or(0));
  c.experts_per_token = json_int(j, "num_experts_per_tok").value_or(0);
  c.expert_intermediate = json_int(j, "moe_intermediate_size").value_or(0);
  c.norm_topk_prob = json_bool(j, "norm_topk_prob").value_or(false);
  const int64_t step = json_int(j, "decoder_sparse_step").value_or(1);
  if (step <= 0) throw FormatError("decoder_sparse_step must be >= 1");
  std::vector<int64_t> dense_only;
  if (auto it = j.find("mlp_only_layers"); it != j.end() && !it->is_null()) {
    if (!it->is_array()) throw FormatError("'mlp_only_layers' is not a list");
    for (const json& l : *it) {
      if (!l.is_number_integer()) throw FormatError("'mlp_only_layers' holds " + l.dump() + ", not a layer index");
      dense_only.push_back(l.get<int64_t>());
    }
  }
  c.moe_layers.assign(size_t(std::clamp<int64_t>(c.layers, 0, kMaxLayers)), false);
  for (int64_t l = 0; l < int64_t(c.moe_layers.size()); ++l)
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
        std::to_string(layers) + ", heads " + std::to_string(heads) + ", kv heads " + std::to_string(kv_heads) +
        ", head_dim " + std::to_string(head_dim) + ", vocab " + std::to_string(vocab) + ", context " +
        std::to_string(max_positions) + ")");
  // Token ids and positions are 32-bit on every backend; the other bounds are far above any
  // real model and keep products of sizes and loops over layers and experts small.
  if (vocab > INT32_MAX || max_positions > INT32_MAX || hidden > (1 << 20) || intermediate > (1 << 24) ||
      expert_intermediate > (1 << 24) || layers > kMaxLayers || heads > (1 << 16) || head_dim > (1 << 16) ||
      experts > kMaxExperts || sliding_window > INT32_MAX)
    bad("config has an implausibly large size (hidden " + std::to_string(hidden) + ", intermediate " +
        std::to_string(intermediate) + ", layers " + std::to_string(layers) + ", heads " + std::to_string(heads) +
        ", head_dim " + std::to_string(head_dim) + ", vocab " + std::to_string(vocab) + ", context " +
        std::to_string(max_positions) + ", experts " + std::to_string(experts) + ")");
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
  if (!(std::isfinite(rms_eps) && rms_eps > 0 && rms_eps <= 1))
    bad("rms_norm_eps " + std::to_string(rms_eps) + " is not in (0, 1]");
  if (!(std::isfinite(rope_theta) && rope_theta > 0)) bad("rope_theta " + std::to_string(rope_theta) + " is not a positive number");
  if (rope_factor != 0 &&
      !(std::isfinite(rope_factor) && rope_factor > 0 && std::isfinite(rope_low_freq_factor) && rope_low_freq_factor > 0 &&
        std::isfinite(rope_high_freq_factor) && rope_high_freq_factor > rope_low_freq_factor &&
        std::isfinite(rope_original_max_positions) && rope_original_max_positions > 0))
    bad("invalid llama3 rope scaling parameters");
}

ModelConfig config_from_hf(const std::string& dir) {
  const std::string path = dir + "/config.json";
  std::ifstream in(path, std::ios::binary);
  if (!in) throw FormatError(path + ": cannot open");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const json j = parse_json_strict(text.data(), text.data() + text.size(), path);
  if (!j.is_object()) throw FormatError(path + ": not a JSON object");
  ModelConfig c;
  try {
    c.arch = hf_arch(j, path);
    c.hidden = json_int(j, "hidden_size").value_or(0);
    c.intermediate = json_int(j, "intermediate_size").value_or(0);
    c.layers = json_int(j, "num_hidden_layers").value_or(0);
    c.heads = json_int(j, "num_attention_heads").value_or(0);
    c.kv_heads = json_int(j, "num_key_value_heads").value_or(c.heads);
    c.head_dim = json_int(j, "head_dim").value_or(c.heads > 0 ? c.hidden / c.heads : 0);
    c.vocab = json_int(j, "vocab_size").value_or(0);
    c.max_positions = json_int(j, "max_position_embeddings").value_or(2048);
    c.rms_eps = json_real(j, "rms_norm_eps").value_or(1e-6);
    c.tie_embeddings = json_bool(j, "tie_word_embeddings").value_or(false);
    // transformers 5 nests rope settings in rope_parameters; older files use top-level keys.
    const json& rope = j.contains("rope_parameters") && j["rope_parameters"].is_object() ? j["rope_parameters"] : j;
    c.rope_theta = json_real(rope, "rope_theta").value_or(json_real(j, "rope_theta").value_or(default_rope_theta(c.arch)));
    if (&rope != &j) read_llama3_scaling(rope, c, j);
    else if (j.contains("rope_scaling") && j["rope_scaling"].is_object()) read_llama3_scaling(j["rope_scaling"], c, j);
    if (c.arch == "qwen3_moe") read_hf_moe(j, c);
    if (c.arch == "mistral") c.sliding_window = json_int(j, "sliding_window").value_or(0);
    else if (json_bool(j, "use_sliding_window").value_or(false)) c.sliding_window = json_int(j, "sliding_window").value_or(0);
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
  std::string a = g.string("general.architecture").value_or("");
  if (a != "llama" && a != "qwen2" && a != "qwen3" && a != "qwen3moe" && a != "mistral")
    throw FormatError(path + ": unknown architecture '" + a + "' (ferrum runs llama, qwen2, qwen3, qwen3moe, mistral)");
  c.arch = a == "qwen3moe" ? "qwen3_moe" : a;
  auto key = [&](const std::string& k) { return a + "." + k; };
  // The keys llama.cpp requires; the others have llama.cpp's defaults.
  auto required = [&](const std::string& k) {
    std::optional<int64_t> v = g.integer(key(k));
    if (!v) throw FormatError(path + ": no metadata '" + key(k) + "'");
    return *v;
  };
  c.max_positions = required("context_length");
  c.hidden = required("embedding_length");
  c.layers = required("block_count");
  c.heads = required("attention.head_count");
  c.intermediate = g.integer(key("feed_forward_length")).value_or(0);
  c.kv_heads = g.integer(key("attention.head_count_kv")).value_or(c.heads);
  c.head_dim = g.integer(key("attention.key_length")).value_or(c.heads > 0 ? c.hidden / c.heads : 0);
  std::optional<double> eps = g.real(key("attention.layer_norm_rms_epsilon"));
  if (!eps) throw FormatError(path + ": no metadata '" + key("attention.layer_norm_rms_epsilon") + "'");
  c.rms_eps = *eps;
  c.rope_theta = g.real(key("rope.freq_base")).value_or(10000.0);  // llama.cpp's default
  c.sliding_window = g.integer(key("attention.sliding_window")).value_or(0);
  // ferrum rotates whole heads and keys and values share head_dim.
  for (const char* k : {"attention.value_length", "rope.dimension_count"})
    if (std::optional<int64_t> v = g.integer(key(k)); v && *v != c.head_dim)
      throw FormatError(path + ": metadata '" + key(k) + "' is " + std::to_string(*v) + ", but heads are " +
                        std::to_string(c.head_dim) + " wide (ferrum runs full-width RoPE and equal key and value heads)");
  // llama.cpp's converter permutes Llama q/k into interleaved pairs; Qwen keeps NeoX halves.
  c.rope_layout = (a == "llama" || a == "mistral") ? RopeLayout::Interleaved : RopeLayout::HalfSplit;
  const TensorInfo* embd = g.weights.find("token_embd.weight");
  if (!embd) throw FormatError(path + ": no token_embd.weight tensor");
  c.vocab = embd->shape[0];
  if (std::optional<int64_t> v = g.integer(key("vocab_size")); v && *v != c.vocab)
    throw FormatError(path + ": metadata '" + key("vocab_size") + "' is " + std::to_string(*v) + ", but token_embd.weight has " +
                      std::to_string(c.vocab) + " rows");
  if (const GgufValue* tokens = g.get("tokenizer.ggml.tokens")) {
    if (tokens->kind != GgufValue::Kind::Array)
      throw FormatError(path + ": metadata 'tokenizer.ggml.tokens' is " + tokens->kind_name() + ", expected an array");
    if (int64_t(tokens->array.size()) != c.vocab)
      throw FormatError(path + ": the vocabulary has " + std::to_string(tokens->array.size()) +
                        " tokens, but token_embd.weight has " + std::to_string(c.vocab) + " rows");
  }
  c.tie_embeddings = g.weights.find("output.weight") == nullptr;
  if (a == "qwen3moe") {
    c.experts = g.integer(key("expert_count")).value_or(0);
    c.experts_per_token = g.integer(key("expert_used_count")).value_or(0);
    c.expert_intermediate = g.integer(key("expert_feed_forward_length")).value_or(0);
    // llama.cpp always renormalises qwen3moe's top-k weights; the key lets a file say otherwise.
    c.norm_topk_prob = g.boolean(key("expert_weights_norm")).value_or(true);
    // A layer is sparse when it has a router (llama.cpp's qwen3moe has only sparse layers; a
    // file with dense ones loads here only).
    c.moe_layers.assign(size_t(std::clamp<int64_t>(c.layers, 0, kMaxLayers)), false);
    for (int64_t l = 0; l < int64_t(c.moe_layers.size()); ++l)
      c.moe_layers[size_t(l)] = g.weights.find("blk." + std::to_string(l) + ".ffn_gate_inp.weight") != nullptr;
    if (c.experts <= 0) throw FormatError(path + ": qwen3moe file without " + key("expert_count"));
  }
  c.validate(path);
  return c;
}

ModelConfig config_from_llama2c(const Llama2cHeader& h, const std::string& path) {
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
  c.validate(path);
  return c;
}

}  // namespace ferrum
