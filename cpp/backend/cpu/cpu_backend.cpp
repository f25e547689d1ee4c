#include "backend/cpu/cpu_backend.h"

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <cblas.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <sys/mman.h>
#include <unistd.h>

#include "backend/cpu/cpu_kernels.h"
#include "backend/cpu/command_profile.h"
#include "backend/cpu/group_offsets.h"
#include "backend/op_checks.h"
#include "core/error.h"
#include "quant/quant.h"
#include "quant/repack.h"

namespace ferrum {

namespace {
constexpr size_t kAlign = 64;

// Buffers from this size up (the KV pool, large scratch, a fused projection before pack_weight
// copies it) are mapped pages of their own: freed, they go back to the system at once. From the
// heap, the load's short-lived copies left tens of MB of free but resident holes.
constexpr size_t kMapBytes = size_t(1) << 20;

void* aligned_bytes(size_t n) {
  if (n >= kMapBytes) {
    void* p = mmap(nullptr, n + kAlign, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw ResourceError("out of host memory mapping " + std::to_string(n) + " bytes");
    return p;
  }
  // (kAlign bytes of slack past the end, as for the mapped buffers: kernels may load a whole
  // vector there.)
  void* p = std::aligned_alloc(kAlign, (n + kAlign - 1) / kAlign * kAlign + kAlign);
  if (!p) throw ResourceError("out of host memory allocating " + std::to_string(n) + " bytes");
  return p;
}

void free_bytes(void* p, size_t n) {
  if (n >= kMapBytes)
    munmap(p, n + kAlign);
  else
    std::free(p);
}

// Whether pack_weight stores 2-D weight w in the R16 layout: its type has one, w is whole 16-row
// groups of whole blocks, and this CPU has the layout's kernels.
bool goes_in_r16(const Tensor& w) {
  return quant::has_r16_layout(w.dtype) && w.dim(0) % quant::kR16Rows == 0 &&
         w.cols() % quant::r16_block_elems(w.dtype) == 0 && quant::gemm_kernel(w.dtype, quant::WeightLayout::R16);
}

// Splits [0, n) for thread ith of nth; returns false when this thread has nothing to do.
inline bool my_range(int64_t n, int ith, int nth, int64_t* b, int64_t* e) {
  split_range(n, ith, nth, b, e);
  return *b < *e;
}
}  // namespace

CpuStorage::CpuStorage(Backend* b, size_t n) : Storage(b, n), data(aligned_bytes(n)), owned(true) {}
CpuStorage::CpuStorage(Backend* b, size_t n, void* d, std::shared_ptr<const void> keep, quant::WeightLayout l)
    : Storage(b, n), data(d), owned(false), keepalive(std::move(keep)), layout(l) {}
CpuStorage::~CpuStorage() {
  if (owned) free_bytes(data, bytes);
}

void CpuStream::submit() {
  if (commands_.empty()) return;
  ThreadPool& pool = backend_->pool();
  if (CommandProfile* profile = CommandProfile::enabled()) {
    profiled_submit(*profile);
    return;
  }
  pool.run([&](int ith, int nth) {
    for (const CpuCommand& c : commands_) {
      c.fn(ith, nth);
      barrier_after(c, ith, nth);
    }
  });
}

namespace {
// A thread's prefetch of the start of its share of the next matmul, a few lines per step. Up to
// kWarmBytes: a quarter of the L2, so it is still there when the matmul reads it.
constexpr size_t kWarmBytes = 256 * 1024;
struct Warmer {
  const char* next;
  const char* end;
  uint64_t sink = 0;
  // Loads, not prefetch instructions: a load waits for a free miss buffer where a prefetch may be
  // dropped, so the lines asked for do arrive, at the rate the memory gives them (and a
  // sequential run of loads starts the hardware prefetcher).
  static bool step(void* self) {
    Warmer& w = *static_cast<Warmer*>(self);
    for (int i = 0; i < 4 && w.next < w.end; ++i, w.next += 64) w.sink += *reinterpret_cast<const volatile uint8_t*>(w.next);
    return w.next < w.end;
  }
};
}  // namespace

void CpuStream::barrier_after(const CpuCommand& c, int ith, int nth) {
  ThreadPool& pool = backend_->pool();
  if (c.warm < 0) return pool.barrier();
  const WeightShares& ws = warm_[size_t(c.warm)];
  int64_t b, e;
  split_range(ws.units, ws.reverse ? nth - 1 - ith : ith, nth, &b, &e);
  Warmer w{ws.base + size_t(b) * ws.unit_bytes, nullptr};
  w.end = w.next + std::min(size_t(e - b) * ws.unit_bytes, kWarmBytes);
  pool.barrier(&Warmer::step, &w);
}

// submit() with each command timed: every thread's own work, and the wall time from the start
// of the command to the end of its barrier on the calling thread.
void CpuStream::profiled_submit(CommandProfile& profile) {
  ThreadPool& pool = backend_->pool();
  const size_t n = commands_.size(), threads = size_t(pool.size());
  std::vector<int64_t> work(n * threads), wall(n);
  pool.run([&](int ith, int nth) {
    for (size_t i = 0; i < n; ++i) {
      const int64_t t0 = CommandProfile::now();
      commands_[i].fn(ith, nth);
      const int64_t t1 = CommandProfile::now();
      barrier_after(commands_[i], ith, nth);
      work[i * threads + size_t(ith)] = t1 - t0;
      if (ith == 0) wall[i] = CommandProfile::now() - t0;
    }
  });
  for (size_t i = 0; i < n; ++i) {
    const int64_t* w = &work[i * threads];
    profile.add(commands_[i].name, wall[i], *std::max_element(w, w + threads),
                *std::min_element(w, w + threads));
  }
}

CpuBackend::CpuBackend(int num_threads) : pool_(num_threads) {
  // Our pool owns all parallelism: each thread calls single-threaded sgemm on its slice.
  openblas_set_num_threads(1);
}

bool CpuBackend::supports(Op op, DType w) const {
  switch (op) {
    case Op::Embedding:
    case Op::Linear:
    case Op::MoeExperts:
      return w == DType::F32 || w == DType::F16 || w == DType::BF16 || is_quantized(w);
    default:
      return true;
  }
}

std::shared_ptr<std::vector<char>> CpuBackend::scratch(Scratch kind, size_t bytes) {
  std::shared_ptr<std::vector<char>>& buf = scratch_[int(kind)];
  if (!buf || buf->size() < bytes) buf = std::make_shared<std::vector<char>>(bytes);
  return buf;
}

void CpuBackend::check_host(const Tensor& t) const {
  if (t.defined() && t.storage->backend != this)
    throw ValueError("tensor " + t.str() + " belongs to another backend");
}

void CpuBackend::own(std::initializer_list<const Tensor*> ts) const {
  for (const Tensor* t : ts) check_host(*t);
}

void CpuBackend::own(std::initializer_list<const Tensor*> ts, const AttnBatch& b, const KvLayer& kv) const {
  own(ts);
  own({&b.token_seq, &b.token_pos, &b.slot_mapping, &b.block_tables, &kv.k, &kv.v, &kv.k_scale, &kv.v_scale});
}

Tensor CpuBackend::alloc(DType dtype, Shape shape) {
  Tensor t;
  t.dtype = dtype;
  t.shape = std::move(shape);
  for (int64_t d : t.shape) FERRUM_CHECK(d >= 0, "negative dimension in " + shape_str(t.shape));
  FERRUM_CHECK(t.cols() % dtype_info(dtype).block_elems == 0,
               "last dim of " + t.str() + " is not a multiple of the block size");
  t.storage = std::make_shared<CpuStorage>(this, t.nbytes());
  return t;
}

Tensor CpuBackend::from_host(const void* data, DType dtype, Shape shape,
                             std::shared_ptr<const void> keepalive) {
  if (keepalive) {
    Tensor t;
    t.dtype = dtype;
    t.shape = std::move(shape);
    t.storage = std::make_shared<CpuStorage>(this, t.nbytes(), const_cast<void*>(data), std::move(keepalive));
    return t;
  }
  Tensor t = alloc(dtype, std::move(shape));
  std::memcpy(host_ptr<void>(t), data, t.nbytes());
  return t;
}

void CpuBackend::upload(const Tensor& dst, const void* src, size_t bytes) {
  check_host(dst);
  FERRUM_CHECK(bytes <= dst.nbytes(), "upload of " + std::to_string(bytes) + " bytes into " + dst.str());
  std::memcpy(host_ptr<void>(dst), src, bytes);
}

size_t CpuBackend::memory_available_bytes() const {
  if (FILE* f = std::fopen("/proc/meminfo", "r")) {
    char line[256];
    long long kib = -1;
    while (std::fgets(line, sizeof line, f))
      if (std::sscanf(line, "MemAvailable: %lld kB", &kib) == 1) break;
    std::fclose(f);
    if (kib > 0) return size_t(kib) * 1024;
  }
  return size_t(sysconf(_SC_AVPHYS_PAGES)) * size_t(sysconf(_SC_PAGESIZE));
}

void CpuBackend::pack_lora(LoraWeights& w) {
  WeightArena arena;  // this adapter's region, unmapped when its last tensor goes
  const auto place = [&](const Tensor& m, bool c16t) {
    check_host(m);
    const size_t bytes = c16t ? dtype_bytes(m.dtype, quant::c16t_elements(m.dim(0), m.dim(1))) : m.nbytes();
    WeightArena::Block block = arena.allocate(bytes);
    if (c16t) quant::repack_c16t(m.dtype, host_ptr<char>(m), block.data, m.dim(0), m.dim(1));
    else std::memcpy(block.data, host_ptr<char>(m), bytes);
    Tensor t = m;
    t.offset = 0;
    t.storage = std::make_shared<CpuStorage>(this, bytes, block.data, std::move(block.region),
                                             c16t ? quant::WeightLayout::C16T : quant::WeightLayout::Plain);
    return t;
  };
  for (auto& site : w.sites)
    for (LoraUpdate& u : site) {
      u.a = place(u.a, false);
      u.b = place(u.b, u.b.dtype == DType::F32 || u.b.dtype == DType::F16 || u.b.dtype == DType::BF16);
    }
#if defined(__GLIBC__)
  malloc_trim(0);  // the loader's copies are gone: their heap pages back to the system
#endif
}

Tensor CpuBackend::pack_weight(const Tensor& w, const Consumed& consumed) {
  check_host(w);
  if (w.shape.size() != 2) return w;
  using quant::WeightLayout;
  const bool r16 = goes_in_r16(w);
  Tensor t;
  t.dtype = w.dtype;
  t.shape = w.shape;
  WeightArena::Block block = weights_.allocate(t.nbytes());
  t.storage = std::make_shared<CpuStorage>(this, t.nbytes(), block.data, std::move(block.region),
                                           r16 ? WeightLayout::R16 : WeightLayout::Plain);
  // In chunks of rows, each handed back once copied (a tied 49152-row embedding is 30 MB).
  constexpr int64_t kChunkRows = 64 * quant::kR16Rows;
  const size_t rb = w.row_bytes();
  for (int64_t r = 0; r < w.dim(0); r += kChunkRows) {
    const int64_t rows = std::min(kChunkRows, w.dim(0) - r);
    const char* src = host_ptr<char>(w) + size_t(r) * rb;
    char* dst = host_ptr<char>(t) + size_t(r) * rb;
    if (r16)
      quant::repack_r16(w.dtype, src, dst, rows, w.cols());
    else
      std::memcpy(dst, src, size_t(rows) * rb);
    if (consumed) consumed(src, size_t(rows) * rb);
  }
  return t;
}

void CpuBackend::download(const Tensor& src, void* dst, size_t bytes) {
  check_host(src);
  FERRUM_CHECK(bytes <= src.nbytes(), "download of " + std::to_string(bytes) + " bytes from " + src.str());
  std::memcpy(dst, host_ptr<void>(src), bytes);
}

static CpuStream& cpu_stream(Stream& s) { return static_cast<CpuStream&>(s); }

void CpuBackend::embedding(Stream& s, const Tensor& ids, const Tensor& table, const Tensor& out) {
  own({&ids, &table, &out});
  checks::embedding(ids, table, out);
  cpu_stream(s).record("embedding", [=](int ith, int nth) {
    int64_t b, e;
    if (!my_range(ids.numel(), ith, nth, &b, &e)) return;
    const int32_t* id = host_ptr<int32_t>(ids);
    const char* rows = host_ptr<char>(table);
    int64_t vocab = table.dim(0), h = table.cols();
    for (int64_t t = b; t < e; ++t) {
      float* o = host_ptr<float>(out) + t * h;
      if (id[t] < 0 || id[t] >= vocab) {  // the model validates ids; this only keeps memory safe
        std::memset(o, 0, size_t(h) * 4);
        continue;
      }
      quant::dequantize_rows(table.dtype, layout_of(table), rows, id[t], 1, h, o);
    }
  });
}

void CpuBackend::rms_norm(Stream& s, const Tensor& x, const Tensor& w, float eps, const Tensor& out) {
  own({&x, &w, &out});
  checks::rms_norm(x, w, out);
  cpu_stream(s).record("rms_norm", [=](int ith, int nth) {
    int64_t b, e, d = x.cols();
    if (!my_range(x.rows(), ith, nth, &b, &e)) return;
    for (int64_t r = b; r < e; ++r)
      cpu::rms_norm_row(host_ptr<float>(x) + r * d, host_ptr<float>(w), eps, host_ptr<float>(out) + r * d, d);
  });
}

void CpuBackend::add_rms_norm(Stream& s, const Tensor& residual, const Tensor& x, const Tensor& w,
                              float eps, const Tensor& out) {
  own({&residual, &x, &w, &out});
  checks::add_rms_norm(residual, x, w, out);
  cpu_stream(s).record("add_rms_norm", [=](int ith, int nth) {
    int64_t b, e, d = x.cols();
    if (!my_range(x.rows(), ith, nth, &b, &e)) return;
    for (int64_t r = b; r < e; ++r) {
      float* res = host_ptr<float>(residual) + r * d;
      const float* xr = host_ptr<float>(x) + r * d;
      for (int64_t i = 0; i < d; ++i) res[i] += xr[i];
      cpu::rms_norm_row(res, host_ptr<float>(w), eps, host_ptr<float>(out) + r * d, d);
    }
  });
}

void CpuBackend::qkv_to_cache(Stream& s, const Tensor& qkv, const Tensor& q_norm,
                              const Tensor& k_norm, float eps, const RopeTable& rope,
                              const AttnBatch& batch, const AttnParams& p, const Tensor& q_out,
                              const KvLayer& kv) {
  own({&qkv, &q_norm, &k_norm, &rope.cos, &rope.sin, &q_out}, batch, kv);
  checks::qkv_to_cache(qkv, q_norm, k_norm, rope, batch, p, q_out, kv);
  const int64_t hd = p.head_dim;
  auto rows = scratch(Scratch::QkvRows, size_t(pool_.size() * hd) * 4);
  cpu_stream(s).record("qkv_to_cache", [=](int ith, int nth) {
    const int64_t heads_all = p.heads + 2 * p.kv_heads, tokens = qkv.rows();
    const int64_t half = rope.cos.cols(), max_pos = rope.cos.dim(0);
    const int64_t total_slots = kv.k.dim(0) * kv.block_size();
    float* tmp = reinterpret_cast<float*>(rows->data()) + size_t(ith) * hd;
    int64_t b, e;
    if (!my_range(tokens * heads_all, ith, nth, &b, &e)) return;
    for (int64_t i = b; i < e; ++i) {
      int64_t t = i / heads_all, h = i % heads_all;
      const float* src = host_ptr<float>(qkv) + t * qkv.cols() + h * hd;
      int64_t pos = host_ptr<int32_t>(batch.token_pos)[t];
      bool rotate = pos >= 0 && pos < max_pos;
      const float* c = host_ptr<float>(rope.cos) + pos * half;
      const float* sn = host_ptr<float>(rope.sin) + pos * half;
      if (h < p.heads) {  // query head -> q_out
        float* dst = host_ptr<float>(q_out) + (t * p.heads + h) * hd;
        if (q_norm.defined()) cpu::rms_norm_row(src, host_ptr<float>(q_norm), eps, dst, hd);
        else std::memcpy(dst, src, size_t(hd) * 4);
        if (rotate) cpu::rope_head(dst, c, sn, half, rope.layout);
        continue;
      }
      int64_t slot = host_ptr<int32_t>(batch.slot_mapping)[t];
      if (slot < 0 || slot >= total_slots) continue;  // padding token
      if (h < p.heads + p.kv_heads) {  // key head: norm, rotate, store
        if (k_norm.defined()) cpu::rms_norm_row(src, host_ptr<float>(k_norm), eps, tmp, hd);
        else std::memcpy(tmp, src, size_t(hd) * 4);
        if (rotate) cpu::rope_head(tmp, c, sn, half, rope.layout);
        cpu::kv_store_row(kv, true, slot, h - p.heads, tmp);
      } else {
        cpu::kv_store_row(kv, false, slot, h - p.heads - p.kv_heads, src);
      }
    }
  });
}

void CpuBackend::swiglu(Stream& s, const Tensor& gate_up, const Tensor& out) {
  own({&gate_up, &out});
  checks::swiglu(gate_up, out);
  cpu_stream(s).record("swiglu", [=](int ith, int nth) {
    // Split by elements (in pieces of 16), not rows: a decode's one row is shared by the threads.
    const int64_t n = out.cols(), total = out.rows() * n;
    int64_t b, e;
    if (!my_range((total + 15) / 16, ith, nth, &b, &e)) return;
    for (int64_t i = 16 * b, end = std::min(16 * e, total); i < end;) {
      const int64_t r = i / n, c = i % n, len = std::min(n - c, end - i);
      const float* g = host_ptr<float>(gate_up) + r * 2 * n + c;
      cpu::silu_mul(g, g + n, host_ptr<float>(out) + r * n + c, len);
      i += len;
    }
  });
}

void CpuBackend::gather_rows(Stream& s, const Tensor& x, const Tensor& idx, const Tensor& out) {
  own({&x, &idx, &out});
  checks::gather_rows(x, idx, out);
  cpu_stream(s).record("gather_rows", [=](int ith, int nth) {
    if (ith != 0) return;  // tiny: a few rows
    int64_t d = x.cols();
    for (int64_t r = 0; r < idx.numel(); ++r) {
      int32_t i = host_ptr<int32_t>(idx)[r];
      float* o = host_ptr<float>(out) + r * d;
      if (i < 0 || i >= x.rows()) std::memset(o, 0, size_t(d) * 4);
      else std::memcpy(o, host_ptr<float>(x) + i * d, size_t(d) * 4);
    }
  });
}

void CpuBackend::gather_columns(Stream& s, const Tensor& x, const Tensor& idx, const Tensor& out) {
  own({&x, &idx, &out});
  checks::gather_columns(x, idx, out);
  cpu_stream(s).record("gather_columns", [=](int ith, int nth) {
    const int64_t rows = x.rows(), k = x.cols(), n = idx.numel();
    const int32_t* order = host_ptr<int32_t>(idx);
    for (int64_t r = ith; r < rows; r += nth) {
      const float* src = host_ptr<float>(x) + r * k;
      float* dst = host_ptr<float>(out) + r * n;
      for (int64_t j = 0; j < n; ++j) dst[j] = src[order[j]];
    }
  });
}

namespace {
constexpr int64_t kTileRows = 4;
}  // namespace

void CpuBackend::add_group_offsets(Stream& s, const Tensor& x, const Tensor& block_groups, const Tensor& offsets,
                                   const Tensor& out) {
  own({&x, &block_groups, &offsets, &out});
  checks::add_group_offsets(x, block_groups, offsets, out);
  cpu_stream(s).record("add_group_offsets", [=](int ith, int nth) {
    const int64_t rows = x.rows(), k = x.cols(), blocks = block_groups.numel();
    const int64_t G = offsets.dim(0), N = offsets.dim(1);
    const int32_t* group = host_ptr<int32_t>(block_groups);
    const float* off = host_ptr<float>(offsets);
    // Enough rows: each thread its rows; else each its share of the outputs (every thread adding
    // up the rows' groups). An output is computed alike either way.
    const bool by_rows = rows >= nth;
    const int64_t r0 = by_rows ? rows * ith / nth : 0, r1 = by_rows ? rows * (ith + 1) / nth : rows;
    const int64_t n0 = by_rows ? 0 : N * ith / nth, n1 = by_rows ? N : N * (ith + 1) / nth;
    std::vector<float> sums(static_cast<size_t>((r1 - r0) * G));
    for (int64_t r = r0; r < r1; ++r) cpu::group_sums(host_ptr<float>(x) + r * k, blocks, group, G, sums.data() + (r - r0) * G);
    // Tiles of kTileRows rows by kChunk outputs, accumulated in registers; every output is
    // the same fused multiply-adds over g in order, whatever its tile.
    for (int64_t c0 = n0; c0 < n1; c0 += cpu::kOffsetChunk) {
      const int64_t len = std::min(cpu::kOffsetChunk, n1 - c0);
      int64_t r = r0;
      for (; r + kTileRows <= r1; r += kTileRows)
        cpu::offsets_tile<kTileRows>(sums.data() + (r - r0) * G, G, off + c0, N, host_ptr<float>(out) + r * out.cols() + c0,
                                out.cols(), len);
      for (; r < r1; ++r)
        cpu::offsets_tile<1>(sums.data() + (r - r0) * G, G, off + c0, N, host_ptr<float>(out) + r * out.cols() + c0,
                        out.cols(), len);
    }
  });
}

}  // namespace ferrum
