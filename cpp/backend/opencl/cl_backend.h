// The OpenCL backend: device buffers (split when larger than one allocation), streams of
// prepared kernel launches, and the op set as kernels in kernels/*.cl, in two families (cpu:
// shaped for pocl; gpu: shaped for GPUs; cl_family.h). Ops validate with backend/op_checks.h,
// then record the launches of the backend's family; nothing runs before Stream::submit().
#pragma once
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "backend/opencl/cl_device.h"
#include "backend/opencl/cl_family.h"
#include "backend/opencl/cl_memory.h"
#include "backend/opencl/cl_programs.h"
#include "backend/opencl/cl_stream.h"

namespace ferrum::ocl {

// Largest head_dim the attention kernels keep in private memory.
constexpr int64_t kMaxHeadDim = 256;

// The register tile of the many-token matmul kernels (linear_t4 / t8, moe_tiles_t4 / t8) for a
// weight type and the number of tokens sharing each weight row: tokens x weight rows per
// work-item, and the kernels with that tile (the gpu family's: a work-group's tile, moe_gemm).
struct MatmulTile {
  int64_t tokens, rows;
  const char *linear_kernel, *moe_kernel;
};
MatmulTile matmul_tile(DType weight_dtype, int64_t tokens);
// Whether one-token and batched-decode matmuls over these weights quantize x to 8 bits (both
// families: the same numerics).
bool dot_q8(DType weight_dtype);
// Bytes per row of x quantized to 8 bits (kernels/quantize.cl: xq_row_bytes).
int64_t xq_row_bytes(int64_t K);

struct LoraArena;  // cl_ops_lora.cpp

class ClBackend : public Backend {
 public:
  // selector: what follows "opencl" in the device spec ("", ":P" or ":P:D"); kernels: the kernel
  // family ("" / "auto", "gpu", "cpu"; see choose_family).
  explicit ClBackend(const std::string& selector, const std::string& kernels = "");
  std::string name() const override { return "opencl"; }
  bool supports(Op op, DType weight_dtype) const override;
  const DeviceInfo& device_info() const { return dc_->info(); }
  ProgramCache& programs() { return *programs_; }
  KernelFamily family() const { return family_; }
  const GpuTuning& tuning() const { return tuning_; }

  Tensor alloc(DType dtype, Shape shape) override;
  Tensor from_host(const void* data, DType dtype, Shape shape,
                   std::shared_ptr<const void> keepalive) override;
  void upload(const Tensor& dst, const void* src, size_t bytes) override;
  void download(const Tensor& src, void* dst, size_t bytes) override;
  // gpu family: 2-byte aligned block types repacked in place into the flat row layout
  // (kernels/gpu_weights.cl), recorded in the storage; otherwise w itself.
  Tensor pack_weight(const Tensor& w, const Consumed& consumed) override;
  size_t memory_available_bytes() const override;  // global memory less live buffers
  void materialize(const Tensor& t) override;       // fills t with zeros and waits
  // gpu family: streams replay through a command buffer where the device has one (on pocl that is
  // slower than enqueueing each launch, so the cpu family's do not).
  std::unique_ptr<Stream> new_stream() override;

  void embedding(Stream& s, const Tensor& ids, const Tensor& table, const Tensor& out) override;
  void linear(Stream& s, const Tensor& x, const Tensor& w, const Tensor& bias,
              const Tensor& out, int64_t out_col) override;
  void rms_norm(Stream& s, const Tensor& x, const Tensor& w, float eps, const Tensor& out) override;
  void add_rms_norm(Stream& s, const Tensor& residual, const Tensor& x, const Tensor& w, float eps,
                    const Tensor& out) override;
  void qkv_to_cache(Stream& s, const Tensor& qkv, const Tensor& q_norm, const Tensor& k_norm,
                    float eps, const RopeTable& rope, const AttnBatch& batch, const AttnParams& p,
                    const Tensor& q_out, const KvLayer& kv) override;
  void paged_attention(Stream& s, const Tensor& q, const KvLayer& kv, const AttnBatch& batch,
                       const AttnParams& p, const Tensor& out) override;
  void swiglu(Stream& s, const Tensor& gate_up, const Tensor& out) override;
  void gather_rows(Stream& s, const Tensor& x, const Tensor& idx, const Tensor& out) override;
  void gather_columns(Stream& s, const Tensor& x, const Tensor& idx, const Tensor& out) override;
  void add_group_offsets(Stream& s, const Tensor& x, const Tensor& block_groups, const Tensor& offsets,
                         const Tensor& out) override;
  void moe_route(Stream& s, const Tensor& logits, int64_t top_k, bool normalize, const Tensor& ids,
                 const Tensor& weights) override;
  void moe_experts(Stream& s, const Tensor& x, const Tensor& gate, const Tensor& up,
                   const Tensor& down, const Tensor& ids, const Tensor& weights,
                   const Tensor& out, const MoeExtras& extras) override;
  void lora(Stream& s, const Tensor& x, const Tensor& row_slots, const Tensor& row_scales,
            std::shared_ptr<const LoraSlots> slots,
            int64_t site, int64_t max_rank, const Tensor& out) override;

 private:
  // Programs: kernels/common.cl + the op family's file, built per weight / KV dtype.
  cl_program elementwise_program();
  cl_program attention_program(DType kv_dtype);
  cl_program linear_program(DType weight_dtype);
  // x [T, K] quantized to 8 bits per 32 elements (the CPU's Q8_0 activations) in a new tensor,
  // the layout kernels/linear.cl's quantize_q8_rows describes.
  Tensor quantize_q8(Stream& s, cl_program program, const Tensor& x);
  void segment_args(KernelArgs& a, const RowSegment& seg, const Tensor& w, const Tensor& bias,
                    const BufferView& o, const Tensor& out, int64_t out_col) const;
  // linear over 8-bit activations (decodes over the weight types dot_q8 accepts).
  void linear_q8(Stream& s, cl_program program, const Tensor& x, const Tensor& w, const Tensor& bias,
                 const Tensor& out, int64_t out_col);
  // A launch of `kernel` over `work_items` work-items (1-D), in work-groups of up to max_local.
  Launch launch(cl_program program, const char* kernel, int64_t work_items, int64_t max_local = 16);
  static ClStream& cl_stream(Stream& s);  // ValueError for another backend's stream
  // keeps_quantized: see ClStream::add.
  void record(Stream& s, Launch&& l, bool keeps_quantized = false);
  // f32 [rows(x), groups]: the sums of x's 32-column blocks by group (add_group_offsets').
  Tensor group_sums(Stream& s, const Tensor& x, const Tensor& block_groups, int64_t groups);
  // [pairs, cols(in)]: row p = in's row p / x_div in the order of expert ids[p] (act-order experts).
  Tensor moe_gather_columns(Stream& s, const Tensor& in, int64_t x_div, const Tensor& order, const Tensor& ids,
                            int64_t pairs);
  // y[p, col ..] += offsets o of expert ids[p] over the group sums of in's row p / x_div
  // (moe_experts' asymmetric 8-bit experts; nothing when o is undefined).
  void moe_add_group_offsets(Stream& s, const Tensor& in, int64_t x_div, const ExpertOffsets& o, const Tensor& ids,
                             const Tensor& y, int64_t col);
  // moe_experts' matmuls (either family): y[p, col + n] = w[ids[p]][n, :] . x[p / x_div, :], per
  // pair (moe_rows) or over the pairs grouped by expert (moe_tiles; groups from moe_group).
  // xq: x quantized by quantize_q8 (8-bit activations), or undefined (f32 ones).
  void moe_rows(Stream& s, const Tensor& x, const Tensor& xq, int64_t x_div, const Tensor& w,
                const Tensor& ids, const Tensor& y, int64_t col);
  Tensor moe_group(Stream& s, const Tensor& ids, int64_t E, int64_t tile_tokens);
  // groups: from moe_group with tiles of tile.tokens pairs.
  void moe_tiles(Stream& s, const Tensor& x, int64_t x_div, const Tensor& w, const Tensor& groups,
                 int64_t P, const MatmulTile& tile, const Tensor& y, int64_t col);
  void check_owned(const Tensor& t, const char* op) const;
  // The device copy of a slot set, shared by every lora op recorded over it.
  std::shared_ptr<LoraArena> lora_arena(const std::shared_ptr<const LoraSlots>& slots);
  // Stands in for an absent optional tensor (bias, QK-norm weights, int8 scales).
  const Tensor& placeholder() const { return placeholder_; }

  // ---- gpu family (cl_gpu_*.cpp) ----
  // Programs: the gpu_*.cl files plus what they share, with the tuning's defines.
  cl_program gpu_program(const std::vector<std::string>& sources, const std::string& options);
  cl_program gpu_linear_program(const Tensor& w);
  cl_program gpu_rows_program();
  cl_program gpu_attention_program(DType kv_dtype);
  // A launch of `groups` work-groups of `local` work-items.
  Launch launch_groups(cl_program program, const char* kernel, int64_t groups, int64_t local);
  void gpu_linear(Stream& s, const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& out,
                  int64_t out_col);
  // x quantized to 8 bits for a decode matmul: by the launch that wrote x when the stream's last
  // launch is a gpu norm / SwiGLU writing exactly x, or already quantized for the previous matmul
  // over x, else by a quantize_q8_rows launch.
  Tensor gpu_quantized(Stream& s, cl_program program, const Tensor& x);
  void gpu_rms_norm(Stream& s, const Tensor* residual, const Tensor& x, const Tensor& w, float eps,
                    const Tensor& out);
  void gpu_swiglu(Stream& s, const Tensor& gate_up, const Tensor& out);
  // Splits of a step's positions (1: none) and the rest of attention_split's arguments (a: after
  // the cpu family's paged_attention's), its launch, the combine of the splits, the output's offer.
  int64_t gpu_attention_splits(int64_t tokens, int64_t max_positions) const;
  void gpu_split_attention(Stream& s, cl_program program, Launch& l, KernelArgs& a, int64_t splits,
                           const AttnBatch& batch, const AttnParams& p, int64_t block_size, const Tensor& out);

  std::shared_ptr<DeviceContext> dc_;
  std::shared_ptr<BufferPool> pool_;
  std::unique_ptr<ProgramCache> programs_;
  Tensor placeholder_;
  KernelFamily family_ = KernelFamily::Cpu;
  GpuTuning tuning_;
  // FERRUM_OPENCL_PORTABLE=1 at construction: every kernel in its portable OpenCL C form: the cpu
  // family's weight kernels without clang's x86 builtins (kernels/weights.cl), the gpu family's
  // without NVIDIA's inline PTX (tests compare both forms).
  bool portable_kernels_ = false;
  std::mutex lora_mu_;
  std::vector<std::pair<std::weak_ptr<const LoraSlots>, std::weak_ptr<LoraArena>>> lora_arenas_;
};

}  // namespace ferrum::ocl
