// The Llama-family decoder, written once against the backend interface.
#pragma once
#include <memory>
#include <vector>

#include "backend/backend.h"
#include "model/config.h"
#include "model/lora.h"
#include "model/pipeline_split.h"
#include "model/recorded_step.h"
#include "model/weights.h"

namespace ferrum {

// How a step's rows divide between the requests that state their numerics: token rows
// [0, gen_tokens) and output rows [0, gen_rows) belong to generations, whose matmuls may
// quantize activations to 8 bits (and take the decode path when `decodes`: each of those rows is
// a different sequence's next token); the rest belong to scores and embeddings, computed with
// f32 activations. Output rows [0, logit_rows) go through the lm_head; the rest (embeddings')
// are returned as final hidden states.
struct StepRows {
  int64_t gen_tokens = 0, gen_rows = 0;
  bool decodes = false;
  int64_t logit_rows = 0;
};

// Every tensor one forward step touches, for a fixed shape: `tokens` rows of a varlen batch
// over `seqs` sequences, producing logits for `rows` of them. Kept alive with a recorded stream
// so the step can be replayed after rewriting ids / batch / logit_rows.
struct StepBuffers {
  int64_t tokens = 0, seqs = 0, rows = 0;
  StepRows split;
  Tensor ids;         // i32[tokens]
  // Steps with prompts given as embeddings: f32[2 * tokens, hidden], the ids' embedding rows and
  // then the given rows (uploaded), of which i32 input_rows[tokens] picks each token's input.
  Tensor inputs, input_rows;
  AttnBatch batch;    // token_seq, token_pos, slot_mapping [tokens]; block_tables [seqs, max_blocks]
  Tensor logit_rows;  // i32[rows]: which token rows get logits
  Tensor x, h, qkv, q, attn, o, gate_up, act, down, h_rows, logits;  // gate_up / act: dense layers
  Tensor router_logits, expert_ids, expert_weights;  // MoE layers: f32[T, E], i32 / f32[T, k]
  // With LoRA: i32[tokens], the slot (Decoder::lora_slots) of each token row's adapter, -1 none.
  Tensor lora_rows;
  // With LoRA: f32[tokens], each token row's request scale of its adapter's updates.
  Tensor lora_scales;
  // With projections whose inputs are reordered (Linear::input_order): f32 scratch for the
  // reordered rows, [tokens x the widest such input].
  Tensor ordered;
};

// With tensor parallelism, a rank's decoder computes its share of the model (cfg is
// TensorSplit::local's: its heads, intermediate rows and vocabulary rows) and sums the partial
// outputs of the embedding, o and the MLP's down projection (or experts) across the ranks; the
// residual stream is then whole on every rank, and each rank's logits are its vocabulary's.
//
// With pipeline parallelism, a stage's decoder runs its layers only (w.layers): the first stage
// from the embedding, the others from the hidden rows the previous stage sends; the last stage
// ends with the final norm and the lm_head, the others send their hidden rows on.
class Decoder {
 public:
  // max_loras > 0: steps apply LoRA adapters, up to that many different ones per step, each of
  // rank <= max_lora_rank.
  Decoder(std::shared_ptr<Backend> be, ModelConfig cfg, ModelWeights w, RopeTable rope, PipelineStage stage = {},
          int64_t max_loras = 0, int64_t max_lora_rank = 0);
  const ModelConfig& config() const { return cfg_; }
  // The adapters the rows of the next step run pick from (StepBuffers::lora_rows); null without
  // LoRA. The caller fills it before running a step.
  LoraSlots* lora_slots() const { return lora_.get(); }
  Backend& backend() const { return *be_; }

  StepBuffers alloc_step(int64_t tokens, int64_t seqs, int64_t rows, int64_t max_blocks, const StepRows& split,
                         bool embeds = false) const;
  // Records embedding -> layers -> final norm -> lm_head for the rows asked for.
  void record(RecordedStep& step, const StepBuffers& b, const std::vector<KvLayer>& kv) const;

 private:
  // Records op(begin, count) for the generation rows [0, gen) of an n-row activation, then for
  // the scoring rows [gen, n), each with its numerics set on the stream.
  template <typename Op>
  void by_row_group(Stream& s, const StepBuffers& b, int64_t n, int64_t gen, const Op& op) const;
  // A matmul over token rows (or, for the lm_head, logits rows), split by row group.
  // site >= 0: then the rows' LoRA updates at that site are added (model/lora.h).
  void matmul(Stream& s, const StepBuffers& b, const Linear& w, const Tensor& x, const Tensor& out,
              int64_t gen, int64_t site = -1) const;

  std::shared_ptr<Backend> be_;
  ModelConfig cfg_;
  ModelWeights w_;
  RopeTable rope_;
  AttnParams attn_;
  std::shared_ptr<LoraSlots> lora_;
  int64_t max_lora_rank_ = 0;
  PipelineStage stage_;
  int64_t ordered_inputs_ = 0;  // the widest input of a projection with an input order (0: none)
};

}  // namespace ferrum
