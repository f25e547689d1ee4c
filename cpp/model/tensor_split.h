// How a model divides between the ranks of a tensor-parallel group (Megatron-LM's split):
//   q/k/v and gate/up by output rows: each rank holds whole attention heads (its share of the KV
//     heads with their query heads; with fewer KV heads than ranks, each KV head is held by the
//     ranks that share its query heads) and a share of the MLP's intermediate rows;
//   o and down by input columns, so each rank's matmul gives a partial sum of the full output
//     (the decoder adds them up across ranks with one all-reduce after each);
//   the embedding and the lm_head by vocabulary rows (the embedding's partial rows are summed
//     too; each rank's logits columns are gathered on rank 0);
//   Qwen3-MoE experts by their intermediate rows (gate / up rows, down columns).
// Norms and the MoE router are whole on every rank.
#pragma once
#include <cstdint>

#include "model/config.h"

namespace ferrum {

// Indices [begin, begin + count) of a whole dimension (rows or columns).
struct IndexRange {
  int64_t begin = 0, count = 0;
};

struct TensorSplit {
  int rank = 0, ranks = 1;
  // This rank's share of the model's: rows [first, first + count).
  int64_t head0 = 0, heads = 0;        // query heads
  int64_t kv_head0 = 0, kv_heads = 0;  // KV heads
  int64_t inter0 = 0, intermediate = 0;
  int64_t expert_inter0 = 0, expert_intermediate = 0;
  int64_t vocab0 = 0, vocab = 0;
  // Vocabulary rows per rank before the last one's (which may hold fewer): the width of each
  // rank's logits columns as they are gathered.
  int64_t vocab_chunk = 0;

  bool whole() const { return ranks == 1; }
  // This rank's rows of q (its heads'), of k and of v (its KV heads'), and of gate and of up (its
  // intermediate rows): the rows of the column-parallel projections it holds, which are also its
  // input columns of o and of down. Its weights and its share of a LoRA update are cut by these.
  IndexRange q_rows(const ModelConfig& c) const { return {head0 * c.head_dim, heads * c.head_dim}; }
  IndexRange kv_rows(const ModelConfig& c) const { return {kv_head0 * c.head_dim, kv_heads * c.head_dim}; }
  IndexRange inter_rows() const { return {inter0, intermediate}; }
  // The part of the model this rank computes: c with its heads, KV heads, intermediate sizes and
  // vocabulary rows.
  ModelConfig local(const ModelConfig& c) const;
};

// Rank `rank`'s share of c among `ranks`. ValueError when c cannot be split so: query heads or
// intermediate sizes that do not divide between the ranks, KV heads that can be neither divided
// between them nor shared by them, or too few vocabulary rows to give each rank some.
TensorSplit split_model(const ModelConfig& c, int rank, int ranks);

}  // namespace ferrum
