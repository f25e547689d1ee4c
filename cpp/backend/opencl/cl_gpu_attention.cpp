// The gpu family's paged_attention (kernels/gpu_attention.cl; its qkv_to_cache: cl_ops_attention.cpp).
#include <algorithm>

#include "backend/opencl/cl_backend.h"
#include "core/error.h"

namespace ferrum::ocl {

cl_program ClBackend::gpu_attention_program(DType kv) {
  const char* def = kv == DType::F32 ? "-DKV_F32" : kv == DType::F16 ? "-DKV_F16" : "-DKV_I8";
  return gpu_program({"common", "gpu_common", "quantize", "kv_pool", "gpu_attention"},
                     std::string(def) + " -DMAX_HEAD_DIM=" + std::to_string(kMaxHeadDim));
}

// Steps of few tokens (decodes) split each token's positions over work-groups (their partial
// softmaxes combined after); longer ones run one piece per (token, KV head, head group).
int64_t ClBackend::gpu_attention_splits(int64_t tokens, int64_t max_positions) const {
  if (tokens > tuning_.attn_split_tokens) return 1;
  return std::max<int64_t>(1, (max_positions + tuning_.attn_split - 1) / tuning_.attn_split);
}

void ClBackend::gpu_split_attention(Stream& s, cl_program program, Launch& l, KernelArgs& a, int64_t splits,
                                    const AttnBatch& batch, const AttnParams& p, int64_t block_size,
                                    const Tensor& out) {
  const int64_t T = batch.token_pos.numel(), max_positions = batch.block_tables.dim(1) * block_size;
  const Tensor part = splits > 1 ? alloc(DType::F32, {T * p.heads * splits, p.head_dim + 2}) : placeholder();
  a.i32(splits).tensor(part, "paged_attention");
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
