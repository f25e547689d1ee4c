#include "backend/op_checks.h"

#include "core/error.h"

namespace ferrum::checks {

namespace {
void need(bool ok, const std::string& op, const std::string& what) {
  if (!ok) throw ValueError(op + ": " + what);
}
void defined(const Tensor& t, const std::string& op, const char* name) {
  need(t.defined(), op, std::string(name) + " is undefined");
}
void f32(const Tensor& t, const std::string& op, const char* name) {
  defined(t, op, name);
  need(t.dtype == DType::F32, op, std::string(name) + " must be f32, got " + t.str());
}
void i32(const Tensor& t, const std::string& op, const char* name) {
  defined(t, op, name);
  need(t.dtype == DType::I32, op, std::string(name) + " must be i32, got " + t.str());
}
void same_shape(const Tensor& a, const Tensor& b, const std::string& op) {
  need(a.numel() == b.numel() && a.cols() == b.cols(), op,
       "shape mismatch: " + a.str() + " vs " + b.str());
}
void attn_geometry(const AttnParams& p, const std::string& op) {
  need(p.heads > 0 && p.kv_heads > 0 && p.head_dim > 0 && p.heads % p.kv_heads == 0, op,
       "heads must be a positive multiple of kv_heads");
  need(p.head_dim % 2 == 0, op, "head_dim must be even");
  need(p.window >= 0, op, "window must be >= 0");
}
void batch_tensors(const AttnBatch& b, int64_t tokens, const std::string& op) {
  i32(b.token_seq, op, "token_seq");
  i32(b.token_pos, op, "token_pos");
  i32(b.slot_mapping, op, "slot_mapping");
  i32(b.block_tables, op, "block_tables");
  need(b.token_seq.numel() == tokens && b.token_pos.numel() == tokens &&
           b.slot_mapping.numel() == tokens,
       op, "token_seq / token_pos / slot_mapping must have one entry per token (" +
               std::to_string(tokens) + ")");
  need(b.block_tables.shape.size() == 2, op, "block_tables must be [seqs, max_blocks]");
}
void kv_pool(const KvLayer& kv, const AttnParams& p, const std::string& op) {
  defined(kv.k, op, "kv.k");
  defined(kv.v, op, "kv.v");
  need(kv.k.shape.size() == 4 && kv.k.shape == kv.v.shape, op,
       "kv pools must both be [blocks, kv_heads, block_size, head_dim], got " + kv.k.str() +
           " and " + kv.v.str());
  need(kv.k.dim(1) == p.kv_heads && kv.k.dim(3) == p.head_dim, op,
       "kv pool " + kv.k.str() + " does not match kv_heads/head_dim");
  DType d = kv.k.dtype;
  need(d == DType::F32 || d == DType::F16 || d == DType::I8, op, "kv dtype must be f32, f16 or i8");
  if (d == DType::I8) {
    f32(kv.k_scale, op, "kv.k_scale");
    f32(kv.v_scale, op, "kv.v_scale");
    need(kv.k_scale.numel() * p.head_dim == kv.k.numel() &&
             kv.v_scale.numel() * p.head_dim == kv.v.numel(),
         op, "i8 kv scales must have one entry per (block, head, slot)");
  }
}
}  // namespace

void embedding(const Tensor& ids, const Tensor& table, const Tensor& out) {
  const std::string op = "embedding";
  i32(ids, op, "ids");
  f32(out, op, "out");
  defined(table, op, "table");
  need(table.shape.size() == 2, op, "table must be [vocab, hidden], got " + table.str());
  need(out.rows() == ids.numel() && out.cols() == table.cols(), op,
       "out " + out.str() + " must be [" + std::to_string(ids.numel()) + ", " +
           std::to_string(table.cols()) + "]");
}

void linear(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& out, int64_t out_col) {
  const std::string op = "linear";
  f32(x, op, "x");
  f32(out, op, "out");
  defined(w, op, "w");
  need(w.shape.size() == 2, op, "w must be [out_features, in_features], got " + w.str());
  need(x.cols() == w.cols(), op, "x " + x.str() + " does not match w " + w.str());
  need(out_col >= 0 && out.rows() == x.rows() && out.cols() >= out_col + w.dim(0), op,
       "out " + out.str() + " must be [" + std::to_string(x.rows()) + ", >= " +
           std::to_string(out_col + w.dim(0)) + "]");
  need(w.cols() % dtype_info(w.dtype).block_elems == 0, op,
       "in_features of " + w.str() + " is not a multiple of its block size");
  if (bias.defined()) {
    f32(bias, op, "bias");
    need(bias.numel() == w.dim(0), op, "bias " + bias.str() + " must have out_features entries");
  }
}

void rms_norm(const Tensor& x, const Tensor& w, const Tensor& out) {
  const std::string op = "rms_norm";
  f32(x, op, "x");
  f32(w, op, "w");
  f32(out, op, "out");
  need(w.numel() == x.cols(), op, "w " + w.str() + " must match the last dim of x " + x.str());
  same_shape(x, out, op);
}

void add_rms_norm(const Tensor& residual, const Tensor& x, const Tensor& w, const Tensor& out) {
  const std::string op = "add_rms_norm";
  f32(residual, op, "residual");
  same_shape(residual, x, op);
  rms_norm(x, w, out);
}

void qkv_to_cache(const Tensor& qkv, const Tensor& q_norm, const Tensor& k_norm,
                  const RopeTable& rope_table, const AttnBatch& batch, const AttnParams& p,
                  const Tensor& q_out, const KvLayer& kv) {
  const std::string op = "qkv_to_cache";
  attn_geometry(p, op);
  f32(qkv, op, "qkv");
  f32(q_out, op, "q_out");
  int64_t tokens = qkv.rows();
  need(qkv.cols() == (p.heads + 2 * p.kv_heads) * p.head_dim, op,
       "qkv " + qkv.str() + " must have (heads + 2 kv_heads) * head_dim columns");
  need(q_out.numel() == tokens * p.heads * p.head_dim, op, "q_out " + q_out.str() + " has the wrong size");
  need(q_norm.defined() == k_norm.defined(), op, "q_norm and k_norm come together");
  if (q_norm.defined()) {
    f32(q_norm, op, "q_norm");
    f32(k_norm, op, "k_norm");
    need(q_norm.numel() == p.head_dim && k_norm.numel() == p.head_dim, op, "QK-norm weights must be [head_dim]");
  }
  need(rope_table.cos.defined() && rope_table.cos.cols() * 2 <= p.head_dim, op, "rotary table does not fit head_dim");
  batch_tensors(batch, tokens, op);
  kv_pool(kv, p, op);
}

void paged_attention(const Tensor& q, const KvLayer& kv, const AttnBatch& batch,
                     const AttnParams& p, const Tensor& out) {
  const std::string op = "paged_attention";
  attn_geometry(p, op);
  f32(q, op, "q");
  f32(out, op, "out");
  need(q.numel() % (p.heads * p.head_dim) == 0, op, "q " + q.str() + " is not [tokens, heads, head_dim]");
  int64_t tokens = q.numel() / (p.heads * p.head_dim);
  need(out.numel() == q.numel(), op, "out must be shaped like q");
  batch_tensors(batch, tokens, op);
  kv_pool(kv, p, op);
}

void swiglu(const Tensor& gate_up, const Tensor& out) {
  const std::string op = "swiglu";
  f32(gate_up, op, "gate_up");
  f32(out, op, "out");
  need(gate_up.cols() == 2 * out.cols() && gate_up.rows() == out.rows(), op,
       "gate_up " + gate_up.str() + " must be [T, 2 I] for out " + out.str());
}

void gather_rows(const Tensor& x, const Tensor& idx, const Tensor& out) {
  const std::string op = "gather_rows";
  f32(x, op, "x");
  i32(idx, op, "idx");
  f32(out, op, "out");
  need(out.rows() == idx.numel() && out.cols() == x.cols(), op, "out " + out.str() + " must be [len(idx), cols(x)]");
}

void gather_columns(const Tensor& x, const Tensor& idx, const Tensor& out) {
  const std::string op = "gather_columns";
  f32(x, op, "x");
  i32(idx, op, "idx");
  f32(out, op, "out");
  need(out.rows() == x.rows() && out.cols() == idx.numel(), op, "out " + out.str() + " must be [rows(x), len(idx)]");
}

void add_group_offsets(const Tensor& x, const Tensor& block_groups, const Tensor& offsets, const Tensor& out) {
  const std::string op = "add_group_offsets";
  f32(x, op, "x");
  i32(block_groups, op, "block_groups");
  f32(offsets, op, "offsets");
  f32(out, op, "out");
  need(offsets.shape.size() == 2, op, "offsets " + offsets.str() + " must be [groups, N]");
  need(x.cols() == 32 * block_groups.numel(), op,
       "block_groups " + block_groups.str() + " must hold one group per 32 columns of x " + x.str());
  need(out.rows() == x.rows() && out.cols() >= offsets.dim(1), op,
       "out " + out.str() + " must be [rows(x), >= cols(offsets)]");
}

void moe_route(const Tensor& logits, int64_t top_k, const Tensor& ids, const Tensor& weights) {
  const std::string op = "moe_route";
  f32(logits, op, "logits");
  i32(ids, op, "ids");
  f32(weights, op, "weights");
  need(logits.shape.size() == 2, op, "logits must be [tokens, experts], got " + logits.str());
  need(top_k >= 1 && top_k <= logits.cols(), op,
       "top_k " + std::to_string(top_k) + " must be in [1, " + std::to_string(logits.cols()) + "]");
  need(ids.shape == Shape{logits.rows(), top_k} && weights.shape == ids.shape, op,
       "ids " + ids.str() + " and weights " + weights.str() + " must be [" +
           std::to_string(logits.rows()) + ", " + std::to_string(top_k) + "]");
}

void moe_experts(const Tensor& x, const Tensor& gate, const Tensor& up, const Tensor& down,
                 const Tensor& ids, const Tensor& weights, const Tensor& out, const MoeExtras& extras) {
  const std::string op = "moe_experts";
  f32(x, op, "x");
  f32(out, op, "out");
  i32(ids, op, "ids");
  f32(weights, op, "weights");
  defined(gate, op, "gate");
  defined(up, op, "up");
  defined(down, op, "down");
  need(x.shape.size() == 2 && out.shape == x.shape, op,
       "x " + x.str() + " and out " + out.str() + " must both be [tokens, hidden]");
  need(out.storage != x.storage || out.offset + out.nbytes() <= x.offset ||
           x.offset + x.nbytes() <= out.offset,
       op, "out must not alias x");
  need(gate.shape.size() == 3 && up.shape.size() == 3 && down.shape.size() == 3, op,
       "expert weights must be 3-D [experts, out, in], got gate " + gate.str() + ", up " + up.str() +
           ", down " + down.str());
  const int64_t E = gate.dim(0), I = gate.dim(1), H = x.cols();
  need(gate.shape == Shape{E, I, H} && up.shape == gate.shape, op,
       "gate " + gate.str() + " and up " + up.str() + " must be [experts, inter, " + std::to_string(H) + "]");
  need(down.shape == Shape{E, H, I}, op,
       "down " + down.str() + " must be [" + std::to_string(E) + ", " + std::to_string(H) + ", " +
           std::to_string(I) + "]");
  need(H % dtype_info(gate.dtype).block_elems == 0 && H % dtype_info(up.dtype).block_elems == 0 &&
           I % dtype_info(down.dtype).block_elems == 0,
       op, "expert in_features are not a multiple of their block size");
  need(ids.shape.size() == 2 && ids.rows() == x.rows() && weights.shape == ids.shape, op,
       "ids " + ids.str() + " and weights " + weights.str() + " must be [" + std::to_string(x.rows()) +
           ", top_k]");
  const auto offsets_fit = [&](const ExpertOffsets& o, const char* name, int64_t N, int64_t K) {
    if (!o.defined()) return;
    const std::string what = std::string(name) + " offsets";
    f32(o.offsets, op, what.c_str());
    i32(o.block_groups, op, (std::string(name) + " block_groups").c_str());
    need(o.offsets.shape.size() == 3 && o.offsets.dim(0) == E && o.offsets.dim(2) == N, op,
         what + " " + o.offsets.str() + " must be [" + std::to_string(E) + ", groups, " + std::to_string(N) + "]");
    need(K == 32 * o.block_groups.numel(), op,
         std::string(name) + " block_groups " + o.block_groups.str() + " must hold one group per 32 of its " +
             std::to_string(K) + " inputs");
  };
  const auto order_fits = [&](const Tensor& order, const char* name, int64_t K) {
    if (!order.defined()) return;
    i32(order, op, name);
    need(order.shape == Shape{E, K}, op,
         std::string(name) + " " + order.str() + " must be [" + std::to_string(E) + ", " + std::to_string(K) + "]");
  };
  order_fits(extras.gate_up_order, "gate_up_order", H);
  order_fits(extras.down_order, "down_order", I);
  offsets_fit(extras.gate, "gate", I, H);
  offsets_fit(extras.up, "up", I, H);
  offsets_fit(extras.down, "down", H, I);
}

void lora(const Tensor& x, const Tensor& row_slots, const Tensor& row_scales, int64_t site_rank, const Tensor& out) {
  const std::string op = "lora";
  f32(x, op, "x");
  i32(row_slots, op, "row_slots");
  f32(row_scales, op, "row_scales");
  f32(out, op, "out");
  need(x.shape.size() == 2 && out.shape.size() == 2 && out.rows() == x.rows(), op,
       "x " + x.str() + " and out " + out.str() + " must be [T, K] and [T, N]");
  need(row_slots.numel() == x.rows(), op, "row_slots " + row_slots.str() + " must have one entry per row of x");
  need(row_scales.numel() == x.rows(), op, "row_scales " + row_scales.str() + " must have one entry per row of x");
  need(site_rank >= 1, op, "site_rank must be >= 1");
}

}  // namespace ferrum::checks
