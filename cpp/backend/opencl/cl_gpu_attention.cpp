// The gpu family's qkv_to_cache and paged_attention (kernels/gpu_attention.cl).
#include <algorithm>

#include "backend/opencl/cl_backend.h"
#include "core/error.h"

namespace ferrum::ocl {

cl_program ClBackend::gpu_attention_program(DType kv) {
  const char* def = kv == DType::F32 ? "-DKV_F32" : kv == DType::F16 ? "-DKV_F16" : "-DKV_I8";
  return gpu_program({"common", "gpu_common", "quantize", "kv_pool", "gpu_attention"},
                     std::string(def) + " -DMAX_HEAD_DIM=" + std::to_string(kMaxHeadDim));
}

void ClBackend::gpu_qkv_to_cache(Stream& s, const Tensor& qkv, const Tensor& q_norm, const Tensor& k_norm,
                                 float eps, const RopeTable& rope, const AttnBatch& batch, const AttnParams& p,
                                 const Tensor& q_out, const KvLayer& kv) {
  const int64_t T = qkv.rows(), heads_all = p.heads + 2 * p.kv_heads;
  const bool norm = q_norm.defined(), i8 = kv.k.dtype == DType::I8;
  Launch l = launch_groups(gpu_attention_program(kv.k.dtype), "qkv_rope_cache", T * heads_all, tuning_.attn_wg);
  KernelArgs(l)
      .tensor(qkv, "qkv_to_cache")
      .tensor(norm ? q_norm : placeholder(), "qkv_to_cache")
      .tensor(norm ? k_norm : placeholder(), "qkv_to_cache")
      .i32(norm ? 1 : 0).f32(eps)
      .tensor(rope.cos, "qkv_to_cache").tensor(rope.sin, "qkv_to_cache")
      .i32(rope.cos.cols()).i32(rope.cos.dim(0)).i32(rope.layout == RopeLayout::Interleaved ? 1 : 0)
      .tensor(batch.token_pos, "qkv_to_cache").tensor(batch.slot_mapping, "qkv_to_cache")
      .i32(T).i32(p.heads).i32(p.kv_heads).i32(p.head_dim)
      .tensor(q_out, "qkv_to_cache").tensor(kv.k, "qkv_to_cache").tensor(kv.v, "qkv_to_cache")
      .tensor(i8 ? kv.k_scale : placeholder(), "qkv_to_cache")
      .tensor(i8 ? kv.v_scale : placeholder(), "qkv_to_cache")
      .i32(kv.block_size()).i32(kv.k.dim(0) * kv.block_size());
  record(s, std::move(l));
}

// Steps of few tokens (decodes) split each token's positions over work-groups and combine the
// splits' partial softmaxes; longer ones run a work-group per (token, KV head, head group).
void ClBackend::gpu_paged_attention(Stream& s, const Tensor& q, const KvLayer& kv, const AttnBatch& batch,
                                    const AttnParams& p, const Tensor& out) {
  const int64_t T = q.numel() / (p.heads * p.head_dim), G = p.heads / p.kv_heads;
  const int64_t max_positions = batch.block_tables.dim(1) * kv.block_size();
  const int64_t splits = T <= tuning_.attn_split_tokens
                             ? std::max<int64_t>(1, (max_positions + tuning_.attn_split - 1) / tuning_.attn_split)
                             : 1;
  const int64_t head_groups = (G + tuning_.attn_heads - 1) / tuning_.attn_heads;
  const bool i8 = kv.k.dtype == DType::I8;
  cl_program program = gpu_attention_program(kv.k.dtype);
  const Tensor part = splits > 1 ? alloc(DType::F32, {T * p.heads * splits, p.head_dim + 2}) : placeholder();
  Launch l = launch_groups(program, "attention_split", T * p.kv_heads * head_groups * splits, tuning_.attn_wg);
  KernelArgs a(l);
  a.tensor(q, "paged_attention").tensor(out, "paged_attention")
      .tensor(batch.token_seq, "paged_attention").tensor(batch.token_pos, "paged_attention")
      .tensor(batch.block_tables, "paged_attention").i32(batch.block_tables.dim(1))
      .tensor(kv.k, "paged_attention").tensor(kv.v, "paged_attention")
      .tensor(i8 ? kv.k_scale : placeholder(), "paged_attention")
      .tensor(i8 ? kv.v_scale : placeholder(), "paged_attention")
      .i32(kv.k.dim(0)).i32(kv.block_size()).i32(T).i32(p.heads).i32(p.kv_heads).i32(p.head_dim)
      .f32(p.scale).i32(p.window).i32(splits).tensor(part, "paged_attention");
  // The launch that writes out can quantize it for the o projection (ClStream::offer_quantized):
  // its last arguments are (xq, xq offset, enable), off until a matmul claims it.
  cl_uint xq_arg = a.next_index();
  a.tensor(placeholder(), "paged_attention").i32(0);
  record(s, std::move(l));
  if (splits > 1) {
    Launch c = launch_groups(program, "attention_combine", T * p.heads, tuning_.attn_wg);
    KernelArgs b(c);
    b.tensor(part, "paged_attention").tensor(out, "paged_attention")
        .tensor(batch.token_pos, "paged_attention").i32(T).i32(p.heads).i32(p.head_dim).i32(p.window)
        .i32(splits).i32(max_positions);
    xq_arg = b.next_index();
    b.tensor(placeholder(), "paged_attention").i32(0);
    record(s, std::move(c));
  }
  if (p.head_dim % 32 != 0) return;
  const BufferView v = single_buffer(out, "paged_attention");
  QuantizableOutput o;
  o.mem = v.mem;
  o.byte_offset = v.byte_offset;
  o.rows = T;
  o.cols = p.heads * p.head_dim;
  o.xq_arg = xq_arg;
  cl_stream(s).offer_quantized(std::move(o));
}

}  // namespace ferrum::ocl
