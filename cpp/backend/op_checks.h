// Shape and dtype validation shared by every backend, run when an op is recorded, so a
// mistake made from Python is a ValueError and never reaches a kernel.
#pragma once
#include "backend/backend.h"

namespace ferrum::checks {

void embedding(const Tensor& ids, const Tensor& table, const Tensor& out);
void linear(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& out, int64_t out_col);
void rms_norm(const Tensor& x, const Tensor& w, const Tensor& out);
void add_rms_norm(const Tensor& residual, const Tensor& x, const Tensor& w, const Tensor& out);
void qkv_to_cache(const Tensor& qkv, const Tensor& q_norm, const Tensor& k_norm,
                  const RopeTable& rope, const AttnBatch& batch, const AttnParams& p,
                  const Tensor& q_out, const KvLayer& kv);
void paged_attention(const Tensor& q, const KvLayer& kv, const AttnBatch& batch,
                     const AttnParams& p, const Tensor& out);
void swiglu(const Tensor& gate_up, const Tensor& out);
void gather_rows(const Tensor& x, const Tensor& idx, const Tensor& out);
void gather_columns(const Tensor& x, const Tensor& idx, const Tensor& out);
void add_group_offsets(const Tensor& x, const Tensor& block_groups, const Tensor& offsets, const Tensor& out);
void moe_route(const Tensor& logits, int64_t top_k, const Tensor& ids, const Tensor& weights);
void moe_experts(const Tensor& x, const Tensor& gate, const Tensor& up, const Tensor& down,
                 const Tensor& ids, const Tensor& weights, const Tensor& out, const MoeExtras& extras);
void lora(const Tensor& x, const Tensor& row_slots, const Tensor& row_scales, int64_t site_rank, const Tensor& out);

}  // namespace ferrum::checks
