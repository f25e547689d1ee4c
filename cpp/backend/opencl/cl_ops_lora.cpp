// LoRA (kernels/lora.cl, gpu_lora.cl): per projection site a shrink t = x A^T into scratch
// [T, site_rank] and an expand out += scale t B^T, each row under the adapter of its slot. A
// recorded step's slots change between submits, and a kernel binds a fixed set of buffers, so the
// adapters in a slot set are copied into one buffer per set (a table, then the weights), rebuilt
// at a submit whose slots differ from the last ones; the launches are rebound when that buffer
// is reallocated.
#include <algorithm>
#include <cstring>
#include <cstdint>
#include <mutex>

#include "backend/op_checks.h"
#include "backend/opencl/cl_backend.h"
#include "backend/opencl/cl_error.h"
#include "core/error.h"

namespace ferrum::ocl {

namespace {
constexpr int64_t kUpdateInts = 8;  // kernels/lora.cl: LORA_UPDATE_INTS
constexpr int64_t kWeightsAlign = 16;  // floats: the weights start on 64 bytes
constexpr int64_t kMatrixAlign = 16;   // bytes
int64_t aligned_bytes(const Tensor& m) {
  return int64_t((m.nbytes() + kMatrixAlign - 1) / kMatrixAlign * kMatrixAlign);
}

// kernels/lora.cl's LORA_F32 ...
int32_t lora_dtype_code(DType t) {
  switch (t) {
    case DType::F32: return 0;
    case DType::F16: return 1;
    case DType::BF16: return 2;
    case DType::Q8_0: return 3;
    default: throw ValueError(std::string("lora: no OpenCL kernels for adapters in ") + dtype_name(t));
  }
}
}  // namespace

// The device copy of a slot set: held are the adapters it was built from.
struct LoraArena {
  std::shared_ptr<DeviceContext> dc;
  std::shared_ptr<BufferPool> pool;
  Backend* owner = nullptr;
  std::mutex mu;
  std::vector<std::shared_ptr<const LoraWeights>> held;
  bool built = false;
  Tensor buf;  // the table's ints, then the weights' bytes (an f32 tensor only for its size)
  int64_t weights_offset = 0;  // in floats

  // Brings buf up to date with `slots` (nothing when they hold what they held last time).
  void update(const LoraSlots& slots);
};

void LoraArena::update(const LoraSlots& slots) {
  std::lock_guard<std::mutex> lock(mu);
  if (built && held == slots.slots) return;
  const int64_t S = int64_t(slots.slots.size());
  int64_t sites = 0, updates = 0, bytes = 0;
  for (const auto& w : slots.slots) {
    if (!w) continue;
    sites = std::max<int64_t>(sites, int64_t(w->sites.size()));
    for (const auto& site : w->sites)
      for (const LoraUpdate& u : site) {
        updates++;
        bytes += aligned_bytes(u.a) + aligned_bytes(u.b);
      }
  }
  const int64_t table_ints = 2 + 2 * S * sites + kUpdateInts * updates;
  const int64_t woff = (table_ints + kWeightsAlign - 1) / kWeightsAlign * kWeightsAlign;
  const int64_t total = std::max<int64_t>(woff + (bytes + 3) / 4, kWeightsAlign);
  if (total * 4 > INT32_MAX) throw ResourceError("the LoRA adapters in use exceed 2 GiB on the OpenCL device");
  if (!buf.defined() || buf.numel() < total) {
    Tensor t;
    t.dtype = DType::F32;
    t.shape = {total};
    t.storage = allocate_storage(owner, pool, dc->info(), t.nbytes(), t.row_bytes());
    buf = std::move(t);
  }
  const BufferView dst = single_buffer(buf, "lora");
  std::vector<int32_t> table(size_t(table_ints), 0);
  table[0] = int32_t(S);
  table[1] = int32_t(sites);
  int64_t u = 0, at = 0;
  auto copy = [&](const Tensor& src) {
    const BufferView v = single_buffer(src, "lora");
    cl_check(clEnqueueCopyBuffer(dc->queue(), v.mem, dst.mem, v.byte_offset,
                                 dst.byte_offset + size_t(woff * 4 + at), src.nbytes(), 0, nullptr, nullptr),
             "clEnqueueCopyBuffer");
    const int64_t offset = at;
    at += aligned_bytes(src);
    return int32_t(offset);
  };
  for (int64_t s = 0; s < S; ++s) {
    const auto& w = slots.slots[size_t(s)];
    if (!w) continue;
    for (int64_t site = 0; site < int64_t(w->sites.size()); ++site) {
      const auto& ups = w->sites[size_t(site)];
      table[size_t(2 + 2 * (s * sites + site))] = int32_t(u);
      table[size_t(2 + 2 * (s * sites + site) + 1)] = int32_t(ups.size());
      int64_t rank_col = 0;
      for (const LoraUpdate& up : ups) {
        int32_t* e = &table[size_t(2 + 2 * S * sites + kUpdateInts * u)];
        e[0] = copy(up.a);
        e[1] = copy(up.b);
        e[2] = int32_t(up.a.dim(0));
        e[3] = int32_t(up.b.dim(0));
        e[4] = int32_t(up.out_col);
        e[5] = int32_t(rank_col);
        std::memcpy(&e[6], &up.scale, 4);
        e[7] = lora_dtype_code(up.a.dtype) | lora_dtype_code(up.b.dtype) << 8;
        rank_col += up.a.dim(0);
        u++;
      }
    }
  }
  // Blocking, on the in-order queue: after the steps already submitted, before the next one.
  cl_check(clEnqueueWriteBuffer(dc->queue(), dst.mem, CL_TRUE, dst.byte_offset, table.size() * 4, table.data(), 0,
                                nullptr, nullptr),
           "clEnqueueWriteBuffer");
  held = slots.slots;
  built = true;
  weights_offset = woff;
}

std::shared_ptr<LoraArena> ClBackend::lora_arena(const std::shared_ptr<const LoraSlots>& slots) {
  std::lock_guard<std::mutex> lock(lora_mu_);
  lora_arenas_.erase(std::remove_if(lora_arenas_.begin(), lora_arenas_.end(),
                                    [](const auto& e) { return e.first.expired() || e.second.expired(); }),
                     lora_arenas_.end());
  for (const auto& [set, arena] : lora_arenas_)
    if (set.lock() == slots) return arena.lock();
  auto arena = std::make_shared<LoraArena>();
  arena->dc = dc_;
  arena->pool = pool_;
  arena->owner = this;
  lora_arenas_.emplace_back(slots, arena);
  return arena;
}

void ClBackend::lora(Stream& s, const Tensor& x, const Tensor& row_slots, const Tensor& row_scales,
                     std::shared_ptr<const LoraSlots> slots, int64_t site, int64_t site_rank, const Tensor& out) {
  for (const Tensor* t : {&x, &row_slots, &row_scales, &out}) check_owned(*t, "lora");
  checks::lora(x, row_slots, row_scales, site_rank, out);
  if (!slots) throw ValueError("lora: no slots");
  const int64_t T = x.rows(), K = x.cols(), ld = out.cols();
  if (T == 0) return;
  ClStream& cs = cl_stream(s);
  const Tensor t = alloc(DType::F32, {T, site_rank});
  const bool gpu = family_ == KernelFamily::Gpu;
  cl_program program = gpu ? gpu_program({"common", "gpu_common", "lora", "gpu_lora"}, "")
                           : programs_->get({"common", "lora"}, "");
  Launch shrink = gpu ? launch_groups(program, "gpu_lora_shrink", (T * site_rank + tuning_.gemv_groups - 1) / tuning_.gemv_groups,
                                      tuning_.lanes * tuning_.gemv_groups)
                      : launch(program, "lora_shrink", T * site_rank, 64);
  Launch expand = launch(program, "lora_expand", T * ld, gpu ? 256 : 64);
  // Arguments 4 .. 7 (the table and the weights) are bound at submit, to the arena: the table's
  // offset in ints, the weights' in bytes.
  constexpr cl_uint kArenaArg = 4;
  KernelArgs a(shrink);
  a.tensor(x, "lora").tensor(row_slots, "lora").tensor(placeholder(), "lora").tensor(placeholder(), "lora")
      .tensor(t, "lora").i32(T).i32(K).i32(site).i32(site_rank);
  if (gpu) a.local_floats(tuning_.lanes * tuning_.gemv_groups);
  KernelArgs(expand).tensor(t, "lora").tensor(row_slots, "lora").tensor(placeholder(), "lora")
      .tensor(placeholder(), "lora").tensor(out, "lora").i32(T).i32(ld).i32(site).i32(site_rank)
      .tensor(row_scales, "lora");
  std::shared_ptr<LoraArena> arena = lora_arena(slots);
  std::vector<cl_kernel> kernels = {shrink.kernel, expand.kernel};
  struct Binding {
    cl_mem mem = nullptr;
    cl_long table_off = 0, weights_off = 0;
    bool operator==(const Binding& o) const {
      return mem == o.mem && table_off == o.table_off && weights_off == o.weights_off;
    }
  };
  auto bound = std::make_shared<Binding>();
  cs.add_prepare([arena, slots, kernels, bound]() {
    arena->update(*slots);
    const BufferView v = single_buffer(arena->buf, "lora");
    const cl_long table_off = cl_long(v.byte_offset / 4);
    const Binding now{v.mem, table_off, cl_long(v.byte_offset) + cl_long(arena->weights_offset) * 4};
    if (now == *bound) return false;
    for (cl_kernel k : kernels) {
      cl_check(clSetKernelArg(k, kArenaArg, sizeof(cl_mem), &now.mem), "lora");
      cl_check(clSetKernelArg(k, kArenaArg + 1, sizeof(cl_long), &now.table_off), "lora");
      cl_check(clSetKernelArg(k, kArenaArg + 2, sizeof(cl_mem), &now.mem), "lora");
      cl_check(clSetKernelArg(k, kArenaArg + 3, sizeof(cl_long), &now.weights_off), "lora");
    }
    *bound = now;
    return true;
  });
  record(s, std::move(shrink));
  record(s, std::move(expand));
}

}  // namespace ferrum::ocl
