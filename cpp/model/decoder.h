// The Llama-family decoder, written once against the backend interface.
#pragma once
#include <memory>
#include <vector>

#include "backend/backend.h"
#include "model/config.h"
#include "model/weights.h"

namespace ferrum {

// Every tensor one forward step touches, for a fixed shape: `tokens` rows of a varlen batch
// over `seqs` sequences, producing logits for `rows` of them. Kept alive with a recorded stream
// so the step can be replayed after rewriting ids / batch / logit_rows.
struct StepBuffers {
  int64_t tokens = 0, seqs = 0, rows = 0;
  Tensor ids;         // i32[tokens]
  AttnBatch batch;    // token_seq, token_pos, slot_mapping [tokens]; block_tables [seqs, max_blocks]
  Tensor logit_rows;  // i32[rows]: which token rows get logits
  Tensor x, h, qkv, q, attn, o, gate_up, act, down, h_rows, logits;  // gate_up / act: dense layers
  Tensor router_logits, expert_ids, expert_weights;  // MoE layers: f32[T, E], i32 / f32[T, k]
};

class Decoder {
 public:
  Decoder(std::shared_ptr<Backend> be, ModelConfig cfg, ModelWeights w, RopeTable rope);
  const ModelConfig& config() const { return cfg_; }
  Backend& backend() const { return *be_; }

  StepBuffers alloc_step(int64_t tokens, int64_t seqs, int64_t rows, int64_t max_blocks) const;
  // Records embedding -> layers -> final norm -> lm_head for the rows asked for.
  void record(Stream& s, const StepBuffers& b, const std::vector<KvLayer>& kv) const;

 private:
  std::shared_ptr<Backend> be_;
  ModelConfig cfg_;
  ModelWeights w_;
  RopeTable rope_;
  AttnParams attn_;
};

}  // namespace ferrum
