// qkv_to_cache and paged_attention (kernels/attention.cl, built per KV pool dtype; the gpu
// family's: cl_gpu_attention.cpp).
#include "backend/op_checks.h"
#include "backend/opencl/cl_backend.h"
#include "core/error.h"

namespace ferrum::ocl {

namespace {
void check_head_dim(int64_t hd, const char* op) {
  if (hd > kMaxHeadDim)
    throw ValueError(std::string(op) + ": head_dim " + std::to_string(hd) + " exceeds the OpenCL backend's " +
                     std::to_string(kMaxHeadDim));
}
}  // namespace

void ClBackend::qkv_to_cache(Stream& s, const Tensor& qkv, const Tensor& q_norm, const Tensor& k_norm,
                             float eps, const RopeTable& rope, const AttnBatch& batch,
                             const AttnParams& p, const Tensor& q_out, const KvLayer& kv) {
  checks::qkv_to_cache(qkv, q_norm, k_norm, rope, batch, p, q_out, kv);
  check_head_dim(p.head_dim, "qkv_to_cache");
  const int64_t T = qkv.rows(), heads_all = p.heads + 2 * p.kv_heads;
  if (T == 0) return;
  const bool norm = q_norm.defined();
  const bool i8 = kv.k.dtype == DType::I8;
  // cpu family: a work-item per (token, head); gpu: a work-group (kernels/gpu_attention.cl).
  Launch l = family_ == KernelFamily::Gpu
                 ? launch_groups(gpu_attention_program(kv.k.dtype), "qkv_rope_cache", T * heads_all, tuning_.attn_wg)
                 : launch(attention_program(kv.k.dtype), "qkv_to_cache", T * heads_all);
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

void ClBackend::paged_attention(Stream& s, const Tensor& q, const KvLayer& kv, const AttnBatch& batch,
                                const AttnParams& p, const Tensor& out) {
  checks::paged_attention(q, kv, batch, p, out);
  check_head_dim(p.head_dim, "paged_attention");
  const int64_t T = q.numel() / (p.heads * p.head_dim);
  if (T == 0) return;
  const bool i8 = kv.k.dtype == DType::I8, gpu = family_ == KernelFamily::Gpu;
  // cpu family: a work-item per (token, head); gpu: a work-group per (token, KV head, group of its
  // query heads, split of the positions) (cl_gpu_attention.cpp).
  const int64_t splits = gpu ? gpu_attention_splits(T, batch.block_tables.dim(1) * kv.block_size()) : 1;
  const int64_t head_groups = (p.heads / p.kv_heads + tuning_.attn_heads - 1) / tuning_.attn_heads;
  cl_program program = gpu ? gpu_attention_program(kv.k.dtype) : attention_program(kv.k.dtype);
  Launch l = gpu ? launch_groups(program, "attention_split", T * p.kv_heads * head_groups * splits, tuning_.attn_wg)
                 : launch(program, "paged_attention", T * p.heads, 4);
  KernelArgs a(l);
  a.tensor(q, "paged_attention").tensor(out, "paged_attention")
      .tensor(batch.token_seq, "paged_attention").tensor(batch.token_pos, "paged_attention")
      .tensor(batch.block_tables, "paged_attention").i32(batch.block_tables.dim(1))
      .tensor(kv.k, "paged_attention").tensor(kv.v, "paged_attention")
      .tensor(i8 ? kv.k_scale : placeholder(), "paged_attention")
      .tensor(i8 ? kv.v_scale : placeholder(), "paged_attention")
      .i32(kv.k.dim(0)).i32(kv.block_size()).i32(T).i32(p.heads).i32(p.kv_heads).i32(p.head_dim)
      .f32(p.scale).i32(p.window);
  if (gpu) return gpu_split_attention(s, program, l, a, splits, batch, p, kv.block_size(), out);
  record(s, std::move(l));
}

}  // namespace ferrum::ocl
