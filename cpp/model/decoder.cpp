#include "model/decoder.h"

#include <cmath>

namespace ferrum {

Decoder::Decoder(std::shared_ptr<Backend> be, ModelConfig cfg, ModelWeights w, RopeTable rope)
    : be_(std::move(be)), cfg_(std::move(cfg)), w_(std::move(w)), rope_(std::move(rope)) {
  attn_ = AttnParams{cfg_.heads, cfg_.kv_heads, cfg_.head_dim, float(1.0 / std::sqrt(double(cfg_.head_dim))),
                     cfg_.sliding_window};
}

StepBuffers Decoder::alloc_step(int64_t T, int64_t S, int64_t R, int64_t max_blocks) const {
  Backend& be = *be_;
  StepBuffers b;
  b.tokens = T;
  b.seqs = S;
  b.rows = R;
  b.ids = be.alloc(DType::I32, {T});
  b.batch.token_seq = be.alloc(DType::I32, {T});
  b.batch.token_pos = be.alloc(DType::I32, {T});
  b.batch.slot_mapping = be.alloc(DType::I32, {T});
  b.batch.block_tables = be.alloc(DType::I32, {S, max_blocks});
  b.logit_rows = be.alloc(DType::I32, {R});
  const ModelConfig& c = cfg_;
  b.x = be.alloc(DType::F32, {T, c.hidden});
  b.h = be.alloc(DType::F32, {T, c.hidden});
  b.qkv = be.alloc(DType::F32, {T, c.q_dim() + 2 * c.kv_dim()});
  b.q = be.alloc(DType::F32, {T, c.heads, c.head_dim});
  b.attn = be.alloc(DType::F32, {T, c.q_dim()});
  b.o = be.alloc(DType::F32, {T, c.hidden});
  if (c.has_dense_layer()) {
    b.gate_up = be.alloc(DType::F32, {T, 2 * c.intermediate});
    b.act = be.alloc(DType::F32, {T, c.intermediate});
  }
  if (c.experts > 0) {
    b.router_logits = be.alloc(DType::F32, {T, c.experts});
    b.expert_ids = be.alloc(DType::I32, {T, c.experts_per_token});
    b.expert_weights = be.alloc(DType::F32, {T, c.experts_per_token});
  }
  b.down = be.alloc(DType::F32, {T, c.hidden});
  b.h_rows = be.alloc(DType::F32, {R, c.hidden});
  b.logits = be.alloc(DType::F32, {R, c.vocab});
  return b;
}

void Decoder::record(Stream& s, const StepBuffers& b, const std::vector<KvLayer>& kv) const {
  Backend& be = *be_;
  const float eps = float(cfg_.rms_eps);
  Tensor attn_out = b.attn.reshape({b.tokens, cfg_.heads, cfg_.head_dim});
  be.embedding(s, b.ids, w_.embed, b.x);
  for (size_t l = 0; l < w_.layers.size(); ++l) {
    const LayerWeights& L = w_.layers[l];
    // x += previous layer's MLP output; h = norm(x)   (the first layer only normalises)
    if (l == 0) be.rms_norm(s, b.x, L.attn_norm, eps, b.h);
    else be.add_rms_norm(s, b.x, b.down, L.attn_norm, eps, b.h);
    L.qkv.record(be, s, b.h, b.qkv);
    be.qkv_to_cache(s, b.qkv, L.q_norm, L.k_norm, eps, rope_, b.batch, attn_, b.q, kv[l]);
    be.paged_attention(s, b.q, kv[l], b.batch, attn_, attn_out);
    L.o.record(be, s, b.attn, b.o);
    be.add_rms_norm(s, b.x, b.o, L.ffn_norm, eps, b.h);
    if (L.moe) {  // route each token to its top-k experts; their weighted sum is the MLP output
      L.router.record(be, s, b.h, b.router_logits);
      be.moe_route(s, b.router_logits, cfg_.experts_per_token, cfg_.norm_topk_prob, b.expert_ids,
                   b.expert_weights);
      be.moe_experts(s, b.h, L.gate_exps, L.up_exps, L.down_exps, b.expert_ids, b.expert_weights, b.down);
    } else {
      L.gate_up.record(be, s, b.h, b.gate_up);
      be.swiglu(s, b.gate_up, b.act);
      L.down.record(be, s, b.act, b.down);
    }
  }
  be.add_rms_norm(s, b.x, b.down, w_.final_norm, eps, b.h);
  be.gather_rows(s, b.h, b.logit_rows, b.h_rows);
  w_.lm_head.record(be, s, b.h_rows, b.logits);
}

}  // namespace ferrum
