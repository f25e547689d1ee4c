#include "model/weight_names.h"

#include <set>

#include "core/error.h"

namespace ferrum {

const NamePair kEmbed{"model.embed_tokens.weight", "token_embd.weight"};
const NamePair kFinalNorm{"model.norm.weight", "output_norm.weight"};
const NamePair kLmHead{"lm_head.weight", "output.weight"};
const NamePair kAttnNorm{"model.layers.{}.input_layernorm.weight", "blk.{}.attn_norm.weight"};
const NamePair kFfnNorm{"model.layers.{}.post_attention_layernorm.weight", "blk.{}.ffn_norm.weight"};
const NamePair kQ{"model.layers.{}.self_attn.q_proj.weight", "blk.{}.attn_q.weight"};
const NamePair kK{"model.layers.{}.self_attn.k_proj.weight", "blk.{}.attn_k.weight"};
const NamePair kV{"model.layers.{}.self_attn.v_proj.weight", "blk.{}.attn_v.weight"};
const NamePair kQBias{"model.layers.{}.self_attn.q_proj.bias", "blk.{}.attn_q.bias"};
const NamePair kKBias{"model.layers.{}.self_attn.k_proj.bias", "blk.{}.attn_k.bias"};
const NamePair kVBias{"model.layers.{}.self_attn.v_proj.bias", "blk.{}.attn_v.bias"};
const NamePair kO{"model.layers.{}.self_attn.o_proj.weight", "blk.{}.attn_output.weight"};
const NamePair kQNorm{"model.layers.{}.self_attn.q_norm.weight", "blk.{}.attn_q_norm.weight"};
const NamePair kKNorm{"model.layers.{}.self_attn.k_norm.weight", "blk.{}.attn_k_norm.weight"};
const NamePair kGate{"model.layers.{}.mlp.gate_proj.weight", "blk.{}.ffn_gate.weight"};
const NamePair kUp{"model.layers.{}.mlp.up_proj.weight", "blk.{}.ffn_up.weight"};
const NamePair kDown{"model.layers.{}.mlp.down_proj.weight", "blk.{}.ffn_down.weight"};
const NamePair kRouter{"model.layers.{}.mlp.gate.weight", "blk.{}.ffn_gate_inp.weight"};
const NamePair kGateExps{"model.layers.{}.mlp.experts.{e}.gate_proj.weight", "blk.{}.ffn_gate_exps.weight"};
const NamePair kUpExps{"model.layers.{}.mlp.experts.{e}.up_proj.weight", "blk.{}.ffn_up_exps.weight"};
const NamePair kDownExps{"model.layers.{}.mlp.experts.{e}.down_proj.weight", "blk.{}.ffn_down_exps.weight"};
const char* const kRopeFreqs = "rope_freqs.weight";

Naming naming_of(const WeightSource& src) { return src.find(kEmbed.gguf) ? Naming::GGUF : Naming::HF; }

std::string tensor_name(const NamePair& p, Naming naming, int64_t layer, int64_t expert) {
  std::string n = naming == Naming::HF ? p.hf : p.gguf;
  size_t at = n.find("{}");
  if (at != std::string::npos) n.replace(at, 2, std::to_string(layer));
  at = n.find("{e}");
  if (at != std::string::npos) n.replace(at, 3, std::to_string(expert));
  return n;
}

namespace {

enum class Role { Matrix, Vector };  // matrices: any float or block type; vectors: float

class Checker {
 public:
  Checker(const WeightSource& src) : src_(src), naming_(naming_of(src)) {}

  bool has(const NamePair& p, int64_t layer = -1) const { return src_.find(tensor_name(p, naming_, layer)); }
  void need(const NamePair& p, int64_t layer, const Shape& shape, Role role, int64_t expert = -1) {
    need(tensor_name(p, naming_, layer, expert), shape, role);
  }
  void need(const std::string& name, const Shape& shape, Role role) {
    const TensorInfo* t = src_.find(name);
    if (!t) throw FormatError(src_.path + ": missing tensor '" + name + "'");
    if (t->shape != shape)
      throw FormatError(src_.path + ": tensor '" + name + "' has shape " + shape_str(t->shape) +
                        " but the config needs " + shape_str(shape));
    const DType d = t->dtype;
    const bool is_float = d == DType::F32 || d == DType::F16 || d == DType::BF16;
    if (role == Role::Vector ? !is_float : !(is_float || is_quantized(d)))
      throw FormatError(src_.path + ": tensor '" + name + "' has type " + dtype_name(d) + ", which cannot hold " +
                        (role == Role::Vector ? "a norm or bias (F32, F16 or BF16)" : "a weight matrix"));
    used_.insert(name);
  }
  void allow(const std::string& name) { used_.insert(name); }
  void refuse_unused(const ModelConfig& c) const {
    for (const auto& [name, t] : src_.tensors)
      if (!used_.count(name))
        throw FormatError(src_.path + ": tensor '" + name + "' is not part of a " + std::to_string(c.layers) + "-layer " +
                          c.arch + " model" + (c.experts ? " with " + std::to_string(c.experts) + " experts" : "") +
                          " (a layer count or a name is wrong)");
  }
  Naming naming() const { return naming_; }

 private:
  const WeightSource& src_;
  Naming naming_;
  std::set<std::string> used_;
};

}  // namespace

void check_weights(const WeightSource& src, const ModelConfig& c) {
  Checker ck(src);
  const int64_t D = c.hidden, F = c.intermediate;
  ck.need(kEmbed, -1, {c.vocab, D}, Role::Matrix);
  ck.need(kFinalNorm, -1, {D}, Role::Vector);
  const std::string head = tensor_name(kLmHead, ck.naming());
  if (c.tie_embeddings || !src.find(head)) ck.allow(head);  // beside tied embeddings, unread
  else ck.need(head, {c.vocab, D}, Role::Matrix);
  if (ck.naming() == Naming::GGUF && src.find(kRopeFreqs)) ck.need(kRopeFreqs, {c.head_dim / 2}, Role::Vector);
  // Every layer has QK-norm and q/k/v biases or none does: layer 0 says which.
  const bool qk_norm = ck.has(kQNorm, 0), qkv_bias = ck.has(kQBias, 0);
  for (int64_t i = 0; i < c.layers; ++i) {
    ck.need(kAttnNorm, i, {D}, Role::Vector);
    ck.need(kFfnNorm, i, {D}, Role::Vector);
    if (qk_norm) {
      ck.need(kQNorm, i, {c.head_dim}, Role::Vector);
      ck.need(kKNorm, i, {c.head_dim}, Role::Vector);
    }
    if (qkv_bias) {
      ck.need(kQBias, i, {c.q_dim()}, Role::Vector);
      ck.need(kKBias, i, {c.kv_dim()}, Role::Vector);
      ck.need(kVBias, i, {c.kv_dim()}, Role::Vector);
    }
    ck.need(kQ, i, {c.q_dim(), D}, Role::Matrix);
    ck.need(kK, i, {c.kv_dim(), D}, Role::Matrix);
    ck.need(kV, i, {c.kv_dim(), D}, Role::Matrix);
    ck.need(kO, i, {D, c.q_dim()}, Role::Matrix);
    if (c.is_moe_layer(i)) {
      const int64_t E = c.experts, X = c.expert_intermediate;
      ck.need(kRouter, i, {E, D}, Role::Matrix);
      if (ck.naming() == Naming::GGUF) {
        ck.need(kGateExps, i, {E, X, D}, Role::Matrix);
        ck.need(kUpExps, i, {E, X, D}, Role::Matrix);
        ck.need(kDownExps, i, {E, D, X}, Role::Matrix);
      } else {
        for (int64_t e = 0; e < E; ++e) {
          ck.need(kGateExps, i, {X, D}, Role::Matrix, e);
          ck.need(kUpExps, i, {X, D}, Role::Matrix, e);
          ck.need(kDownExps, i, {D, X}, Role::Matrix, e);
        }
      }
    } else {
      ck.need(kGate, i, {F, D}, Role::Matrix);
      ck.need(kUp, i, {F, D}, Role::Matrix);
      ck.need(kDown, i, {D, F}, Role::Matrix);
    }
  }
  if (ck.naming() == Naming::HF) {  // older transformers saved the RoPE frequencies too
    const std::string inv_freq = "rotary_emb.inv_freq";
    for (const auto& [name, t] : src.tensors)
      if (name.size() >= inv_freq.size() && name.compare(name.size() - inv_freq.size(), inv_freq.size(), inv_freq) == 0)
        ck.allow(name);
  }
  ck.refuse_unused(c);
}

}  // namespace ferrum
