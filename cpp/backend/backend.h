// The backend interface: buffers, a command stream that ops are recorded into, and the op set
// the decoders record (only those: a new backend implements what the model uses). Model code is
// written once against this; the CPU and OpenCL backends implement it.
//
// Recording model: every op call appends a command to a Stream; nothing runs until
// Stream::submit(). Commands bind tensors (not host values), so a recorded stream can be
// submitted again after the host rewrites its input buffers (token ids, positions, slot
// mappings, block tables): that is decode-step capture and replay, with eager execution being
// record -> submit -> clear.
//
// Conventions: activations are f32 and row-major; weights W are [out_features, in_features]
// in any DType the backend supports(); integer inputs are i32.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace ferrum {

enum class Op {
  Embedding, Linear, RmsNorm, AddRmsNorm, QkvToCache, PagedAttention, SwiGLU, GatherRows,
  MoeRoute, MoeExperts, Lora, GatherColumns, GroupOffsets,
};
const char* op_name(Op op);

enum class RopeLayout { HalfSplit /* NeoX / HF rotate_half */, Interleaved /* GGUF pairs */ };

// cos/sin f32 [max_positions, rotary_dim / 2], precomputed on the host (Llama-3 scaling included).
struct RopeTable {
  Tensor cos, sin;
  RopeLayout layout = RopeLayout::HalfSplit;
};

// Geometry of one attention layer.
struct AttnParams {
  int64_t heads = 0, kv_heads = 0, head_dim = 0;
  float scale = 1.0f;       // usually 1/sqrt(head_dim)
  int64_t window = 0;       // sliding window in tokens (query at p sees (p-window, p]); 0 = off
};

// Where each of the T tokens of a varlen batch sits. Tokens of one sequence are contiguous and
// in position order; a token at position p attends to positions <= p of its own sequence, so
// prefill chunks and single decode tokens of many sequences share one call.
struct AttnBatch {
  Tensor token_seq;     // i32[T]: row of block_tables this token belongs to
  Tensor token_pos;     // i32[T]: absolute position
  Tensor slot_mapping;  // i32[T]: pool slot (block * block_size + offset) for this token's K/V
  Tensor block_tables;  // i32[S, max_blocks]: logical -> physical block, per sequence
};

// One layer's view of the paged KV pool: [num_blocks, kv_heads, block_size, head_dim] in f16,
// f32 or i8. i8 pools carry one f32 scale per (block, head, slot) row in k_scale / v_scale.
// That shape is the logical one; a backend may order a pool's elements its own way (the CPU
// backend's K pools: cpu_kernels.h), so only its own ops read or write them.
struct KvLayer {
  Tensor k, v;
  Tensor k_scale, v_scale;
  int64_t block_size() const { return k.dim(2); }
};

// LoRA (low-rank adapters). One update of a projection's output columns [out_col, out_col + N):
//   out[t, out_col + n] += (scale * row_scale[t]) * sum_j (sum_k x[t, k] a[j, k]) b[n, j]
// with a [r, K] and b [N, r] in a storage dtype (lora_storage_dtype; Q8_0 only for rows of whole
// blocks), b possibly in the backend's own layout (Backend::pack_lora). Backends compute with
// their values converted to f32, as the same update stored in f32 computes: a row's result
// depends on those values only. A fused projection (q/k/v, gate/up) takes one per part.
inline bool lora_storage_dtype(DType t) {
  return t == DType::F32 || t == DType::F16 || t == DType::BF16 || t == DType::Q8_0;
}
struct LoraUpdate {
  Tensor a, b;
  int64_t out_col = 0;
  float scale = 1.0f;
};
// One adapter's updates at each projection site of a model (the decoder numbers the sites); a
// site it does not target has none. Adapters of different ranks keep their own sizes.
struct LoraWeights {
  std::vector<std::vector<LoraUpdate>> sites;
  int64_t bytes = 0;  // of its tensors
};
// The adapters a step's rows choose from, by slot. The host fills the slots before each submit of
// a recorded step, as it rewrites the ids; a recorded lora op reads them when it runs.
struct LoraSlots {
  std::vector<std::shared_ptr<const LoraWeights>> slots;  // null: an unused slot
};

class Stream {
 public:
  virtual ~Stream() = default;
  virtual void submit() = 0;  // run every recorded command, in order (may be called repeatedly)
  virtual void sync() = 0;    // wait until submitted work is done
  virtual void clear() = 0;   // drop recorded commands
  virtual size_t size() const = 0;

  // How the matmuls (linear, moe_experts) recorded from now on compute their activation rows; the
  // recorder sets these before each group of rows, as the requests the rows belong to state it.
  // decode_rows: every row is a generation's next token (or a proposal verified with it): matmuls
  // of up to this many rows may take the backend's decode path (the CPU quantizes activations to
  // 8 bits there, as for single-token decodes), so a token computes the same whatever its batch;
  // 0 keeps the prefill numerics.
  int64_t decode_rows = 0;
  // float_activations: the rows are scores' or embeddings': f32 activations whatever the row
  // count, so scores agree with a float reference; generations' rows may quantize activations to
  // 8 bits (the CPU's int8 GEMM and dot kernels).
  bool float_activations = false;
};

// An asymmetric 8-bit expert projection's zero-point terms, as add_group_offsets takes them for
// one matrix, for all E experts at once: offsets f32 [E, G, N] (N its outputs) and block_groups
// i32 [K / 32] (K its inputs; the experts share the grouping). Undefined tensors: none.
struct ExpertOffsets {
  Tensor offsets, block_groups;
  bool defined() const { return offsets.defined(); }
};
// What quantized checkpoints' experts bring besides their blocks: asymmetric 8-bit zeros'
// offsets per projection, and GPTQ act-order's input orders, i32 [E, H] for gate and up (which
// read one input and share it) and [E, I] for down: expert e's stored column j holds its input
// order[e, j]. Undefined tensors: none.
struct MoeExtras {
  ExpertOffsets gate, up, down;
  Tensor gate_up_order, down_order;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  // Whether op runs here with weights of that dtype. A backend that does not override the
  // optional MoE ops below must answer false for MoeRoute / MoeExperts.
  virtual bool supports(Op op, DType weight_dtype = DType::F32) const = 0;

  // ---- buffers ----
  virtual Tensor alloc(DType dtype, Shape shape) = 0;
  // A tensor holding host data. With a keepalive (e.g. an mmap'd file) a host-memory backend
  // wraps the bytes without copying; other backends copy them to the device.
  virtual Tensor from_host(const void* data, DType dtype, Shape shape,
                           std::shared_ptr<const void> keepalive = nullptr) = 0;
  // Synchronous copies of `bytes` bytes starting at t.offset (bytes <= t.nbytes()).
  virtual void upload(const Tensor& dst, const void* src, size_t bytes) = 0;
  virtual void download(const Tensor& src, void* dst, size_t bytes) = 0;
  virtual std::unique_ptr<Stream> new_stream() = 0;
  // A 2-D weight that only linear and embedding will read, where and in the layout those run
  // fastest here: possibly a copy (the CPU's weight arena), possibly in a layout of the backend's
  // own (the CPU's R16 row interleaving, recorded in its storage) with the same dtype, values
  // and sizes; else w itself. A copy
  // tells `consumed` (if set) of each range of w it has finished reading, so a loader can drop
  // those file pages as it goes: memory never holds both whole copies of a large weight.
  using Consumed = std::function<void(const void* begin, size_t bytes)>;
  virtual Tensor pack_weight(const Tensor& w, const Consumed& consumed) { return w; }
  // Moves a loaded LoRA adapter's A and B matrices where and in the layout this backend's lora
  // op reads them fastest (the CPU: the adapter's own run of 2 MiB pages, B in its C16T layout,
  // recorded in its storage), with the same dtypes, shapes and values; or leaves them.
  virtual void pack_lora(LoraWeights& w) {}
  // Bytes that buffers here could still take (the KV pool is checked against it at load).
  virtual size_t memory_available_bytes() const = 0;
  // Backs t's memory now, so that a driver that allocates at first use fails here
  // (ResourceError) rather than in the middle of a step. Host pages need nothing.
  virtual void materialize(const Tensor& t) {}

  // ---- ops (recorded into s) ----
  // out[t, :] = table[ids[t], :] as f32. table [vocab, H] in any weight dtype.
  virtual void embedding(Stream& s, const Tensor& ids, const Tensor& table, const Tensor& out) = 0;
  // out[:, out_col : out_col + N] = x[T, K] @ w[N, K]^T (+ bias[N] when defined); out is
  // [T, >= out_col + N]. The column offset lets projections stored in different dtypes (q/k
  // as Q4_K, v as Q6_K) fill one fused output.
  virtual void linear(Stream& s, const Tensor& x, const Tensor& w, const Tensor& bias,
                      const Tensor& out, int64_t out_col = 0) = 0;
  // out[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * w. out may alias x.
  virtual void rms_norm(Stream& s, const Tensor& x, const Tensor& w, float eps,
                        const Tensor& out) = 0;
  // residual += x; out = rms_norm(residual) * w.
  virtual void add_rms_norm(Stream& s, const Tensor& residual, const Tensor& x, const Tensor& w,
                            float eps, const Tensor& out) = 0;
  // Split qkv [T, (H + 2 KV) * hd]; per-head RMS norm of q and k when q_norm/k_norm are defined
  // (QK-norm, weights [hd]); RoPE on q and k; q -> q_out [T, H, hd]; k, v -> the pool at
  // batch.slot_mapping.
  virtual void qkv_to_cache(Stream& s, const Tensor& qkv, const Tensor& q_norm,
                            const Tensor& k_norm, float eps, const RopeTable& rope,
                            const AttnBatch& batch, const AttnParams& p, const Tensor& q_out,
                            const KvLayer& kv) = 0;
  // Causal GQA attention of q [T, H, hd] over the pool (which already holds this step's K/V):
  // out [T, H, hd].
  virtual void paged_attention(Stream& s, const Tensor& q, const KvLayer& kv,
                               const AttnBatch& batch, const AttnParams& p,
                               const Tensor& out) = 0;
  // out[T, I] = silu(gate_up[:, :I]) * gate_up[:, I:].
  virtual void swiglu(Stream& s, const Tensor& gate_up, const Tensor& out) = 0;
  // out[r, :] = x[idx[r], :]
  virtual void gather_rows(Stream& s, const Tensor& x, const Tensor& idx, const Tensor& out) = 0;
  // out[r, j] = x[r, idx[j]], idx in [0, cols(x)): a projection's inputs in the order its
  // weight's columns are stored in (GPTQ act-order).
  virtual void gather_columns(Stream& s, const Tensor& x, const Tensor& idx, const Tensor& out) = 0;
  // out[r, n] += sum_g offsets[g, n] * sums[r, g] (g in order), where sums[r, g] adds up the
  // 32-column blocks b of x [T, K] in group g = block_groups[b] (i32 [K / 32], in [0, G)), the
  // blocks in order (a block's own sum in an order of the backend's); offsets f32 [G, N], out
  // [T, >= N]. What an asymmetric 8-bit projection adds to its Q8_0 part (Linear::group_offsets).
  virtual void add_group_offsets(Stream& s, const Tensor& x, const Tensor& block_groups, const Tensor& offsets,
                                 const Tensor& out) = 0;

  // ---- mixture of experts (Qwen3-MoE); optional: the defaults throw ValueError ----
  // Routing is data: both ops read ids / weights from tensors at submit time, so a recorded
  // stream replays correctly whatever experts the new inputs pick.
  //
  // Router, for each token t of logits f32[T, E] (E experts):
  //   p = softmax(logits[t, :]) in f32 over all E experts;
  //   ids[t, 0..k) = the top_k experts by p, largest first (equal p: lower expert id first);
  //   weights[t, j] = p[ids[t, j]], divided by sum_j p[ids[t, j]] when normalize.
  // ids i32[T, top_k], weights f32[T, top_k]; 1 <= top_k <= E.
  virtual void moe_route(Stream& s, const Tensor& logits, int64_t top_k, bool normalize,
                         const Tensor& ids, const Tensor& weights);
  // Weighted sum of each selected expert's SwiGLU MLP, for each token t of x f32[T, H]:
  //   out[t, :] = sum_j weights[t, j] * down[e] @ (silu(gate[e] @ x[t]) * (up[e] @ x[t])),
  //   e = ids[t, j].
  // gate / up [E, I, H] and down [E, H, I]: expert e's [out_features, in_features] matrices
  // stacked along dim 0 (GGUF's ffn_{gate,up,down}_exps as stored), each in any weight dtype
  // the backend supports(MoeExperts, dtype); the three may differ. ids i32[T, k] and weights
  // f32[T, k] as moe_route writes them; an id outside [0, E) contributes nothing. out f32[T, H]
  // must not alias x.
  // With extras (MoeExtras): an expert's product reads its input in the expert's order
  // (gather_columns' x[t, order[e]]) and adds its zero-point terms as add_group_offsets does for
  // one matrix, over the input so ordered: gate[e] @ x[t, order[e]] + sum_g offsets[e, g, :] *
  // (the sum of those columns in group g), and so on.
  virtual void moe_experts(Stream& s, const Tensor& x, const Tensor& gate, const Tensor& up,
                           const Tensor& down, const Tensor& ids, const Tensor& weights,
                           const Tensor& out, const MoeExtras& extras);

  // ---- LoRA; optional: the default throws ValueError (supports(Op::Lora) must then be false) ----
  // For each row t of x f32[T, K] whose slot = row_slots[t] (i32[T]) is in [0, slots.slots.size())
  // and holds an adapter: that adapter's updates at `site` are added into out f32[T, >= cols], as
  // LoraUpdate says, each scaled by the row's request scale row_scales[t] (f32[T]) on top of its
  // own; other rows (slot -1, an empty slot, an adapter without updates there) are left as they
  // are. Slots, row_slots and row_scales are read at submit time. A row's result does not depend
  // on the other rows. Each update's ranks are at most max_rank (sizes the op's scratch).
  virtual void lora(Stream& s, const Tensor& x, const Tensor& row_slots, const Tensor& row_scales,
                    std::shared_ptr<const LoraSlots> slots, int64_t site, int64_t max_rank, const Tensor& out);
};

// Creates "cpu" or "opencl[:platform[:device]]" backends. opencl_kernels picks the OpenCL
// backend's kernel family: "gpu", "cpu", or "" (by device type, or FERRUM_OPENCL_KERNELS).
std::shared_ptr<Backend> make_backend(const std::string& spec, int num_threads = 0,
                                      const std::string& opencl_kernels = "");

}  // namespace ferrum
