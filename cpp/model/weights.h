// The decoder's weights on a backend, loaded from any WeightSource through one name table
// (HF <-> GGUF). q/k/v and gate/up are fused at load: into one tensor when their dtypes agree,
// else kept as parts that fill column ranges of one output. MoE experts are used as stored in
// GGUF (3-D tensors) and stacked at load from HF's one-tensor-per-expert layout.
#pragma once
#include <functional>
#include <memory>
#include <vector>

#include "backend/backend.h"
#include "io/weight_source.h"
#include "model/config.h"
#include "model/pipeline_split.h"
#include "model/tensor_split.h"

namespace ferrum {

struct Linear {
  std::vector<Tensor> parts;  // [N_i, K] each; outputs concatenated along columns
  Tensor bias;                // f32 [sum N_i] or undefined
  // i32 [K]: the parts' columns hold the inputs in this order (GPTQ act-order), so x is gathered
  // into it first; undefined: in order.
  Tensor input_order;
  // Asymmetric 8-bit parts (GPTQ, compressed-tensors) store s (q - 128); the rest, s (128 - z),
  // rides on the projection: out[:, n] += sum_g group_offsets[g, n] * (the sum of x's stored
  // columns in group g), block b of those columns in group block_groups[b]. Undefined: none.
  Tensor group_offsets;  // f32 [G, out_features]
  Tensor block_groups;   // i32 [K / 32]
  int64_t out_features() const;
  // scratch: f32 of at least rows(x) x K elements when input_order is defined.
  void record(Backend& be, Stream& s, const Tensor& x, const Tensor& out, const Tensor& scratch = {}) const;
};

struct LayerWeights {
  Tensor attn_norm, ffn_norm, q_norm, k_norm;  // f32; q_norm/k_norm only with QK-norm
  Linear qkv, o;
  Linear gate_up, down;  // dense layers
  // Sparse (MoE) layers: router [E, H]; experts stacked along dim 0 as Backend::moe_experts
  // takes them: gate / up [E, I, H], down [E, H, I].
  bool moe = false;
  Linear router;
  Tensor gate_exps, up_exps, down_exps;
  MoeExtras moe_extras;  // asymmetric 8-bit experts' offsets, act-order experts' input orders
};

struct ModelWeights {
  Tensor embed;       // [vocab, hidden], any dtype
  Tensor final_norm;  // f32 [hidden]
  Linear lm_head;     // the embedding itself when tied
  std::vector<float> rope_freq_factors;  // GGUF rope_freqs (llama.cpp stores Llama-3 scaling so)
  std::vector<LayerWeights> layers;
};

// Called after each layer is loaded with (layers done, layers in all): a progress bar's feed.
using LoadProgress = std::function<void(int64_t done, int64_t total)>;

// src has passed check_weights(src, cfg) (open_model_file checks it). With a split (tensor
// parallelism), only this rank's share of each weight is read and held (model/tensor_split.h):
// the embedding as its vocabulary rows plus zero rows, which ids outside them are looked up as.
// ValueError when a block-quantized weight's share of columns is not whole blocks.
ModelWeights load_weights(Backend& be, const WeightSource& src, const ModelConfig& cfg, const TensorSplit& split,
                          const LoadProgress& progress = {});
// A pipeline stage's part (model/pipeline_split.h): its layers (layers[0] is the stage's first),
// the embedding on the first stage, the final norm and the lm_head on the last (a tied
// embedding on both); what a stage does not hold is left undefined.
ModelWeights load_weights(Backend& be, const WeightSource& src, const ModelConfig& cfg, const TensorSplit& split,
                          const PipelineStage& stage, const LoadProgress& progress = {});
// Bytes of the distinct buffers the weights hold.
int64_t weight_bytes(const ModelWeights& w);

}  // namespace ferrum
