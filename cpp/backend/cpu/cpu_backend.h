// The CPU backend: host memory, OpenBLAS for multi-row dense GEMMs, our own kernels elsewhere.
// A stream is a flat list of bound commands; submit() runs the list once on the thread pool,
// all threads stepping through it together with a barrier between commands.
#pragma once
#include <functional>
#include <memory>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/weight_arena.h"
#include "core/thread_pool.h"
#include "quant/quant.h"

namespace ferrum {

struct CpuStorage : Storage {
  CpuStorage(Backend* b, size_t n);  // owns memory
  CpuStorage(Backend* b, size_t n, void* data, std::shared_ptr<const void> keep,
             quant::WeightLayout layout = quant::WeightLayout::Plain);  // wraps
  ~CpuStorage() override;
  void* data;
  bool owned;
  std::shared_ptr<const void> keepalive;
  // How the weight rows in this storage lie: the file's layout, or the R16 interleaving
  // pack_weight chose (the tensors' dtype stays the file's; the kernels follow both).
  quant::WeightLayout layout = quant::WeightLayout::Plain;
};

template <typename T>
inline T* host_ptr(const Tensor& t) {
  return reinterpret_cast<T*>(static_cast<char*>(static_cast<CpuStorage*>(t.storage.get())->data) + t.offset);
}

inline quant::WeightLayout layout_of(const Tensor& t) {
  return static_cast<const CpuStorage*>(t.storage.get())->layout;
}

// One recorded command: fn(thread_index, num_threads) does that thread's share.
struct CpuCommand {
  const char* name;
  std::function<void(int, int)> fn;
  int warm = -1;  // the weight shares (CpuStream::warm_before) its waiting threads read ahead, or -1
};

// How a decode matmul deals its weights to threads (cpu_linear.cpp): `units` units of
// unit_bytes each from base, split as split_range does, in reverse thread order if `reverse`.
struct WeightShares {
  const char* base;
  size_t unit_bytes;
  int64_t units;
  bool reverse;
};

class CpuBackend;
class CommandProfile;

class CpuStream : public Stream {
 public:
  explicit CpuStream(CpuBackend* backend) : backend_(backend) {}
  void submit() override;
  void sync() override {}  // submit() runs to completion
  void clear() override {
    commands_.clear();
    warm_.clear();
    warm_from_ = 0;
    last_weights_end_ = nullptr;
    last_reversed_ = false;
  }
  size_t size() const override { return commands_.size(); }
  void record(const char* name, std::function<void(int, int)> fn) {
    commands_.push_back({name, std::move(fn)});
  }
  // The decode matmul about to be recorded reads `shares`: the commands since the previous one
  // (that one included) have a thread that waits at their barrier read the start of its
  // share into its L2. The time a thread would idle (an unbalanced op, a one-row norm, the tail
  // of a matmul) then streams weights the matmul would read from DRAM.
  void warm_before(const WeightShares& shares) {
    for (size_t i = warm_from_; i < commands_.size(); ++i) commands_[i].warm = int(warm_.size());
    warm_.push_back(shares);
    warm_from_ = commands_.size();
  }
  // Whether threads take a matmul's row ranges in reverse order: yes when its weights start
  // where the previous matmul's (in the weight arena's load order) end and that one's were not
  // reversed. A decode then snakes through consecutive matrices: the thread that read the end
  // of one starts the next, its stream going on in address order (in plain order the worker
  // thread ran slower in most single-row matmuls, likely as the other thread's prefetches ran
  // on into its range).
  bool reverse_threads(const void* begin, size_t bytes) {
    const char* b = static_cast<const char*>(begin);
    const bool follows = b >= last_weights_end_ && b < last_weights_end_ + 4096;  // arena slack
    last_reversed_ = follows && !last_reversed_;
    last_weights_end_ = b + bytes;
    return last_reversed_;
  }

 private:
  void profiled_submit(CommandProfile& profile);
  void barrier_after(const CpuCommand& c, int ith, int nth);
  CpuBackend* backend_;
  std::vector<CpuCommand> commands_;
  std::vector<WeightShares> warm_;
  size_t warm_from_ = 0;
  const char* last_weights_end_ = nullptr;
  bool last_reversed_ = false;
};

// Scratch memory kinds; see CpuBackend::scratch.
enum class Scratch { GemmTiles, Activations, Attention, QkvRows, Lora, Count };

class CpuBackend : public Backend {
 public:
  explicit CpuBackend(int num_threads);
  std::string name() const override { return "cpu"; }
  bool supports(Op op, DType weight_dtype) const override;
  int num_threads() const { return pool_.size(); }
  ThreadPool& pool() { return pool_; }

  Tensor alloc(DType dtype, Shape shape) override;
  Tensor from_host(const void* data, DType dtype, Shape shape,
                   std::shared_ptr<const void> keepalive) override;
  void upload(const Tensor& dst, const void* src, size_t bytes) override;
  // A copy in the weight arena (2 MiB pages, streamed in order); the legacy formats, k-quants,
  // IQ4 types, F16 and BF16 in the R16 layout (quant/repack.h) where its kernels run (AVX-512;
  // AVX2 for the quantized types).
  Tensor pack_weight(const Tensor& w, const Consumed& consumed) override;
  // One weight arena per adapter (its pages go with it); B in f32 / f16 / bf16 in the C16T
  // layout, in q8_0 as it is.
  void pack_lora(LoraWeights& w) override;
  size_t memory_available_bytes() const override;  // the system's MemAvailable
  void download(const Tensor& src, void* dst, size_t bytes) override;
  std::unique_ptr<Stream> new_stream() override { return std::make_unique<CpuStream>(this); }

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
  // Shrink (x A^T into scratch) then expand (+= scale * that B^T), rows grouped by slot: each
  // adapter's A and B are read once per call, whatever its row count (cpu_lora.cpp).
  void lora(Stream& s, const Tensor& x, const Tensor& row_slots, const Tensor& row_scales,
            std::shared_ptr<const LoraSlots> slots,
            int64_t site, int64_t site_rank, const Tensor& out) override;

 private:
  // A buffer of at least `bytes` shared by every command of one kind: commands run one at a
  // time, so one buffer per kind serves all streams (per-command buffers cost a model's worth
  // of memory and a fresh page-faulting allocation per eager step). A recorded stream keeps the
  // buffer it was recorded with alive; a larger request replaces the backend's buffer.
  std::shared_ptr<std::vector<char>> scratch(Scratch kind, size_t bytes);
  void check_host(const Tensor& t) const;
  // Every (defined) tensor of an op must live in this backend's host memory: a tensor of
  // another backend would be read as a host pointer.
  void own(std::initializer_list<const Tensor*> ts) const;
  void own(std::initializer_list<const Tensor*> ts, const AttnBatch& b, const KvLayer& kv) const;
  ThreadPool pool_;
  WeightArena weights_;
  std::shared_ptr<std::vector<char>> scratch_[int(Scratch::Count)];
};

}  // namespace ferrum
