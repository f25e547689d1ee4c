#include "model/decoder.h"

#include <algorithm>
#include <cmath>

namespace ferrum {

Decoder::Decoder(std::shared_ptr<Backend> be, ModelConfig cfg, ModelWeights w, RopeTable rope, PipelineStage stage,
                 int64_t max_loras, int64_t max_lora_rank)
    : be_(std::move(be)), cfg_(std::move(cfg)), w_(std::move(w)), rope_(std::move(rope)), max_lora_rank_(max_lora_rank),
      stage_(stage) {
  if (max_loras > 0) {
    lora_ = std::make_shared<LoraSlots>();
    lora_->slots.resize(size_t(max_loras));
  }
  attn_ = AttnParams{cfg_.heads, cfg_.kv_heads, cfg_.head_dim, float(1.0 / std::sqrt(double(cfg_.head_dim))),
                     cfg_.sliding_window};
  const auto widest = [&](const Linear& l) {
    if (l.input_order.defined()) ordered_inputs_ = std::max(ordered_inputs_, l.input_order.numel());
  };
  widest(w_.lm_head);
  for (const LayerWeights& l : w_.layers)
    for (const Linear* lin : {&l.qkv, &l.o, &l.gate_up, &l.down, &l.router}) widest(*lin);
}

StepBuffers Decoder::alloc_step(int64_t T, int64_t S, int64_t R, int64_t max_blocks, const StepRows& split,
                                bool embeds) const {
  Backend& be = *be_;
  StepBuffers b;
  b.tokens = T;
  b.seqs = S;
  b.rows = R;
  b.split = split;
  b.ids = be.alloc(DType::I32, {T});
  b.batch.token_seq = be.alloc(DType::I32, {T});
  b.batch.token_pos = be.alloc(DType::I32, {T});
  b.batch.slot_mapping = be.alloc(DType::I32, {T});
  b.batch.block_tables = be.alloc(DType::I32, {S, max_blocks});
  b.logit_rows = be.alloc(DType::I32, {R});
  const ModelConfig& c = cfg_;
  if (embeds) {
    b.inputs = be.alloc(DType::F32, {2 * T, c.hidden});
    b.input_rows = be.alloc(DType::I32, {T});
  }
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
  if (lora_) {
    b.lora_rows = be.alloc(DType::I32, {T});
    b.lora_scales = be.alloc(DType::F32, {T});
  }
  if (ordered_inputs_ > 0) b.ordered = be.alloc(DType::F32, {T * ordered_inputs_});
  b.h_rows = be.alloc(DType::F32, {R, c.hidden});
  b.logits = be.alloc(DType::F32, {std::max<int64_t>(split.logit_rows, 1), c.vocab});
  return b;
}

template <typename Op>
void Decoder::by_row_group(Stream& s, const StepBuffers& b, int64_t n, int64_t gen, const Op& op) const {
  if (gen > 0) {
    s.float_activations = false;
    s.decode_rows = b.split.decodes ? gen : 0;
    op(0, gen);
  }
  if (gen < n) {
    s.float_activations = true;
    s.decode_rows = 0;
    op(gen, n - gen);
  }
}

void Decoder::matmul(Stream& s, const StepBuffers& b, const Linear& w, const Tensor& x, const Tensor& out,
                     int64_t gen, int64_t site) const {
  by_row_group(s, b, x.dim(0), gen, [&](int64_t begin, int64_t count) {
    w.record(*be_, s, x.slice(begin, count), out.slice(begin, count), b.ordered);
  });
  if (!lora_ || site < 0) return;
  const LoraSiteShape shape = lora_site_shape(cfg_, site);
  be_->lora(s, x, b.lora_rows, b.lora_scales, lora_, site, shape.parts * max_lora_rank_, out);
}

void Decoder::record(RecordedStep& step, const StepBuffers& b, const std::vector<KvLayer>& kv) const {
  Backend& be = *be_;
  const float eps = float(cfg_.rms_eps);
  Tensor attn_out = b.attn.reshape({b.tokens, cfg_.heads, cfg_.head_dim});
  const int64_t gen = b.split.gen_tokens;
  if (!stage_.first()) {  // the residual stream as the previous stage left it
    step.receive(b.x);
  } else if (b.inputs.defined()) {  // the ids' rows (whole after the sum), then each token's own input
    const Tensor looked_up = b.inputs.slice(0, b.tokens);
    be.embedding(step.stream(), b.ids, w_.embed, looked_up);
    step.all_reduce(looked_up);
    be.gather_rows(step.stream(), b.inputs, b.input_rows, b.x);
  } else {
    be.embedding(step.stream(), b.ids, w_.embed, b.x);
    step.all_reduce(b.x);
  }
  for (size_t l = 0; l < w_.layers.size(); ++l) {
    const LayerWeights& L = w_.layers[l];
    const int64_t layer = stage_.layer0 + int64_t(l);  // the model's numbering, as the adapters' sites
    Stream& s = step.stream();
    // x += previous layer's MLP output; h = norm(x)   (the first layer only normalises)
    if (l == 0) be.rms_norm(s, b.x, L.attn_norm, eps, b.h);
    else be.add_rms_norm(s, b.x, b.down, L.attn_norm, eps, b.h);
    matmul(s, b, L.qkv, b.h, b.qkv, gen, lora_site(layer, LoraSite::Qkv));
    be.qkv_to_cache(s, b.qkv, L.q_norm, L.k_norm, eps, rope_, b.batch, attn_, b.q, kv[l]);
    be.paged_attention(s, b.q, kv[l], b.batch, attn_, attn_out);
    matmul(s, b, L.o, b.attn, b.o, gen, lora_site(layer, LoraSite::O));
    step.all_reduce(b.o);
    Stream& t = step.stream();
    be.add_rms_norm(t, b.x, b.o, L.ffn_norm, eps, b.h);
    if (L.moe) {  // route each token to its top-k experts; their weighted sum is the MLP output
      matmul(t, b, L.router, b.h, b.router_logits, gen);
      be.moe_route(t, b.router_logits, cfg_.experts_per_token, cfg_.norm_topk_prob, b.expert_ids,
                   b.expert_weights);
      by_row_group(t, b, b.tokens, gen, [&](int64_t begin, int64_t count) {
        be.moe_experts(t, b.h.slice(begin, count), L.gate_exps, L.up_exps, L.down_exps,
                       b.expert_ids.slice(begin, count), b.expert_weights.slice(begin, count),
                       b.down.slice(begin, count), L.moe_extras);
      });
    } else {
      matmul(t, b, L.gate_up, b.h, b.gate_up, gen, lora_site(layer, LoraSite::GateUp));
      be.swiglu(t, b.gate_up, b.act);
      matmul(t, b, L.down, b.act, b.down, gen, lora_site(layer, LoraSite::Down));
    }
    step.all_reduce(b.down);
  }
  Stream& s = step.stream();
  if (!stage_.last()) {  // x += the last layer's MLP output, sent on (h is not used: any norm weight does)
    be.add_rms_norm(s, b.x, b.down, w_.layers.back().ffn_norm, eps, b.h);
    step.send(b.x);
    return;
  }
  be.add_rms_norm(s, b.x, b.down, w_.final_norm, eps, b.h);
  be.gather_rows(s, b.h, b.logit_rows, b.h_rows);
  const int64_t L = b.split.logit_rows;
  if (L > 0) matmul(s, b, w_.lm_head, b.h_rows.slice(0, L), b.logits.slice(0, L), b.split.gen_rows);
}

}  // namespace ferrum
