// The OpenCL backend: device buffers (split when larger than one allocation), streams of
// prepared kernel launches, and the op set as kernels in kernels/*.cl. Ops validate with
// backend/op_checks.h, then record launches; nothing runs before Stream::submit().
#pragma once
#include <memory>
#include <string>

#include "backend/backend.h"
#include "backend/opencl/cl_device.h"
#include "backend/opencl/cl_memory.h"
#include "backend/opencl/cl_programs.h"
#include "backend/opencl/cl_stream.h"

namespace ferrum::ocl {

// Largest head_dim the attention kernels keep in private memory.
constexpr int64_t kMaxHeadDim = 256;

// The register tile of the many-token matmul kernels (linear_t4 / t8, moe_tiles_t4 / t8) for a
// weight type and the number of tokens sharing each weight row: tokens x weight rows per
// work-item, and the kernels with that tile.
struct MatmulTile {
  int64_t tokens, rows;
  const char *linear_kernel, *moe_kernel;
};
MatmulTile matmul_tile(DType weight_dtype, int64_t tokens);
// Whether one-token and batched-decode matmuls over these weights quantize x to 8 bits.
bool dot_q8(DType weight_dtype);

class ClBackend : public Backend {
 public:
  // selector: what follows "opencl" in the device spec ("", ":P" or ":P:D").
  explicit ClBackend(const std::string& selector);
  std::string name() const override { return "opencl"; }
  bool supports(Op op, DType weight_dtype) const override;
  const DeviceInfo& device_info() const { return dc_->info(); }
  ProgramCache& programs() { return *programs_; }

  Tensor alloc(DType dtype, Shape shape) override;
  Tensor from_host(const void* data, DType dtype, Shape shape,
                   std::shared_ptr<const void> keepalive) override;
  void upload(const Tensor& dst, const void* src, size_t bytes) override;
  void download(const Tensor& src, void* dst, size_t bytes) override;
  size_t memory_available_bytes() const override;  // global memory less live buffers
  void materialize(const Tensor& t) override;       // fills t with zeros and waits
  std::unique_ptr<Stream> new_stream() override { return std::make_unique<ClStream>(dc_); }

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
  void moe_route(Stream& s, const Tensor& logits, int64_t top_k, bool normalize, const Tensor& ids,
                 const Tensor& weights) override;
  void moe_experts(Stream& s, const Tensor& x, const Tensor& gate, const Tensor& up,
                   const Tensor& down, const Tensor& ids, const Tensor& weights,
                   const Tensor& out) override;

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
  void record(Stream& s, Launch&& l);
  // moe_experts' matmuls: y[p, col + n] = w[ids[p]][n, :] . x[p / x_div, :], per pair
  // (moe_rows) or over the pairs grouped by expert (moe_tiles; groups from moe_group).
  // xq: x quantized by quantize_q8 (8-bit activations), or undefined (f32 ones).
  void moe_rows(Stream& s, const Tensor& x, const Tensor& xq, int64_t x_div, const Tensor& w,
                const Tensor& ids, const Tensor& y, int64_t col);
  Tensor moe_group(Stream& s, const Tensor& ids, int64_t E, int64_t tile_tokens);
  // groups: from moe_group with tiles of tile.tokens pairs.
  void moe_tiles(Stream& s, const Tensor& x, int64_t x_div, const Tensor& w, const Tensor& groups,
                 int64_t P, const MatmulTile& tile, const Tensor& y, int64_t col);
  void check_owned(const Tensor& t, const char* op) const;
  // Stands in for an absent optional tensor (bias, QK-norm weights, int8 scales).
  const Tensor& placeholder() const { return placeholder_; }

  std::shared_ptr<DeviceContext> dc_;
  std::shared_ptr<BufferPool> pool_;
  std::unique_ptr<ProgramCache> programs_;
  Tensor placeholder_;
  // FERRUM_OPENCL_PORTABLE=1 at construction: the weight kernels' portable forms on x86 too,
  // not clang's x86 builtins (kernels/weights.cl; tests compare both forms).
  bool portable_kernels_ = false;
};

}  // namespace ferrum::ocl
