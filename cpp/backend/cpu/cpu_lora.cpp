// LoRA on the CPU: two commands per projection site. Rows are grouped by the slot they chose;
// the shrink gives each thread blocks of kShrinkRanks rank rows of A (every row of the group
// against the block, each x row read once per block), the expand whole 16-column chunks of B
// (kept transposed, in the C16T layout pack_lora gave it, so a rank's 16 outputs are one
// vector), so each adapter's A and B are read once per call however many rows use it. A rank
// block of A stored in q8_0 or a batch of a q8_0 B's chunks is converted to f32 once per call
// (into an L1-sized buffer); f16 / bf16 values convert in registers, exactly. The results are
// those of the f32 update with those values. Each output element is one fixed-order sum of its
// row's own values, times its row's request scale: a row's result does not depend on its batch.
// The kernels (lora_kernels.h) have an AVX-512 copy with the same floats. The adapter's
// matrices lie on its own 2 MiB pages (CpuBackend::pack_lora): on 4 KiB ones a decode read
// them at well under half the weights' pace.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <iterator>
#include <type_traits>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/cpu_kernels.h"
#include "backend/cpu/fast_math.h"
#include "backend/cpu/lora_kernels.h"
#include "backend/op_checks.h"
#include "core/error.h"
#include "quant/quant.h"
#include "quant/repack.h"

namespace ferrum {

namespace {

constexpr int64_t kExpandCols = 16;
constexpr int64_t kShrinkRanks = 4;

// The rows of each slot that has updates at `site`, in slot order.
struct SlotRows {
  const std::vector<LoraUpdate>* updates;
  std::vector<int64_t> rows;
};

std::vector<SlotRows> group_rows(const LoraSlots& slots, int64_t site, const int32_t* row_slots, int64_t T) {
  std::vector<SlotRows> groups;
  std::vector<int64_t> group_of(slots.slots.size(), -1);
  for (int64_t t = 0; t < T; ++t) {
    const int32_t s = row_slots[t];
    if (s < 0 || size_t(s) >= slots.slots.size() || !slots.slots[size_t(s)]) continue;
    const LoraWeights& w = *slots.slots[size_t(s)];
    if (site >= int64_t(w.sites.size()) || w.sites[size_t(site)].empty()) continue;
    if (group_of[size_t(s)] < 0) {
      group_of[size_t(s)] = int64_t(groups.size());
      groups.push_back({&w.sites[size_t(site)], {}});
    }
    groups[size_t(group_of[size_t(s)])].rows.push_back(t);
  }
  return groups;
}

// Calls fn(group, update, offset of the update's ranks in a row of scratch, u0, u1) once per
// update with units in [begin, end) of all groups' updates (an update has units_of(update)
// units), [u0, u1) being those units numbered within the update.
template <typename Units, typename Fn>
void for_update_units(const std::vector<SlotRows>& groups, int64_t begin, int64_t end, const Units& units_of,
                      const Fn& fn) {
  int64_t u0 = 0;
  for (const SlotRows& g : groups) {
    int64_t offset = 0;
    for (const LoraUpdate& up : *g.updates) {
      const int64_t n = units_of(up), lo = std::max(begin, u0), hi = std::min(end, u0 + n);
      if (lo < hi) fn(g, up, offset, lo - u0, hi - u0);
      u0 += n;
      offset += up.a.dim(0);
    }
  }
}

template <typename Units>
int64_t count_units(const std::vector<SlotRows>& groups, const Units& units_of) {
  int64_t n = 0;
  for (const SlotRows& g : groups)
    for (const LoraUpdate& up : *g.updates) n += units_of(up);
  return n;
}

int64_t rank_units(const LoraUpdate& up) { return (up.a.dim(0) + kShrinkRanks - 1) / kShrinkRanks; }
int64_t col_units(const LoraUpdate& up) { return (up.b.dim(0) + kExpandCols - 1) / kExpandCols; }

// Rows [r0, r0 + rows) of m (2-D, a storage dtype) as f32: m's own floats when it is f32, else
// converted into buf.
const float* f32_rows(const Tensor& m, int64_t r0, int64_t rows, std::vector<float>& buf) {
  const int64_t cols = m.dim(1);
  if (m.dtype == DType::F32) return host_ptr<float>(m) + r0 * cols;
  buf.resize(size_t(rows * cols));
  quant::dequantize_row(m.dtype, host_ptr<uint8_t>(m) + r0 * int64_t(dtype_bytes(m.dtype, cols)), buf.data(),
                        rows * cols);
  return buf.data();
}

// a * b + c, rounded once, on 8 lanes (one AVX2 register; GCC keeps arrays of 16-lane vectors
// in memory on AVX2).
inline cpu::f32x8 fma8(cpu::f32x8 a, cpu::f32x8 b, cpu::f32x8 c) {
#if defined(__FMA__)
  return cpu::f32x8(_mm256_fmadd_ps(__m256(a), __m256(b), __m256(c)));
#else
  cpu::f32x8 r;
  for (int i = 0; i < 8; ++i) r[i] = std::fma(a[i], b[i], c[i]);
  return r;
#endif
}

inline cpu::f32x8 splat8(float x) { return cpu::f32x8{x, x, x, x, x, x, x, x}; }

inline void store8(float* p, cpu::f32x8 v) { std::memcpy(p, &v, sizeof v); }

// Sums v's lanes in one fixed order.
inline float hsum8(cpu::f32x8 v) {
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
  return v[0] + v[1];
}

inline cpu::f32x8 load8(const float* p) {
  cpu::f32x8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Element i of a matrix stored as kType (f32, f16 or bf16; each converts to f32 exactly), and
// elements i .. i + 7.
template <DType kType>
float element(const uint8_t* p, int64_t i) {
  if constexpr (kType == DType::F32) {
    return reinterpret_cast<const float*>(p)[i];
  } else {
    uint16_t h;
    std::memcpy(&h, p + 2 * i, 2);
    if constexpr (kType == DType::F16) return _cvtsh_ss(h);
    const uint32_t bits = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
}

template <DType kType>
cpu::f32x8 elements8(const uint8_t* p, int64_t i) {
  if constexpr (kType == DType::F32) {
    return ::ferrum::load8(reinterpret_cast<const float*>(p) + i);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * i));
    if constexpr (kType == DType::F16) return cpu::f32x8(_mm256_cvtph_ps(h));
    return cpu::f32x8(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
  }
}

bool direct_dtype(DType t) { return t == DType::F32 || t == DType::F16 || t == DType::BF16; }

// out[r][i] = x[r] . a[i] for R rows x[r] and N rows of a (K apart, stored as kType): each
// product one 8-lane chain, its lanes summed, then the tail (K % 8) in order; the same floats
// whatever R is. (8 lanes: 2 x 4 chains fit AVX2's registers. R, N and the dtype are template
// parameters so that the chains stay in registers.)
template <DType kType, int R, int N>
void shrink_rows(const float* const* x, const uint8_t* a, int64_t K, float* const* out) {
  cpu::f32x8 acc[R][N] = {};
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    cpu::f32x8 v[R];
    for (int r = 0; r < R; ++r) v[r] = load8(x[r] + k);
    for (int i = 0; i < N; ++i) {
      const cpu::f32x8 w = elements8<kType>(a, i * K + k);
      for (int r = 0; r < R; ++r) acc[r][i] = fma8(v[r], w, acc[r][i]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < N; ++i) {
      float sum = hsum8(acc[r][i]);
      for (int64_t kk = k; kk < K; ++kk) sum = std::fma(x[r][kk], element<kType>(a, i * K + kk), sum);
      out[r][i] = sum;
    }
}

template <DType kType, int R>
cpu::LoraShrinkFn shrink_kernel_of(int64_t n) {
  static constexpr cpu::LoraShrinkFn k[] = {shrink_rows<kType, R, 1>, shrink_rows<kType, R, 2>,
                                            shrink_rows<kType, R, 3>, shrink_rows<kType, R, 4>};
  static_assert(std::size(k) == kShrinkRanks);
  return k[n - 1];
}

template <int R>
cpu::LoraShrinkFn shrink_kernel(DType dtype, int64_t n) {
  return dtype == DType::F32   ? shrink_kernel_of<DType::F32, R>(n)
         : dtype == DType::F16 ? shrink_kernel_of<DType::F16, R>(n)
                               : shrink_kernel_of<DType::BF16, R>(n);
}

// out[r][n] += scale[r] * sum_j v[r][j] b[j][n] for R rows and the first `width` (<= 16) columns n
// of one 16-column chunk of B^T, b [rank][16] stored as kType, j in order from 0: the same floats
// whatever R is. (Not inlined: inside the command's lambda GCC ran out of registers and kept the
// accumulators in memory, stored at every j.)
template <DType kType, int R>
[[gnu::noinline]] void expand_chunk(const float* const* v, const uint8_t* b, int64_t rank, int64_t width,
                                    const float* scale, float* const* out) {
  using cpu::f32x8;
  f32x8 acc[R][2] = {};
  for (int64_t j = 0; j < rank; ++j) {
    const f32x8 w0 = elements8<kType>(b, j * kExpandCols), w1 = elements8<kType>(b, j * kExpandCols + 8);
    for (int r = 0; r < R; ++r) {
      const f32x8 x = splat8(v[r][j]);
      acc[r][0] = fma8(x, w0, acc[r][0]);
      acc[r][1] = fma8(x, w1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float* o = out[r];
    if (width == kExpandCols) {
      const f32x8 s = splat8(scale[r]);
      store8(o, fma8(s, acc[r][0], load8(o)));
      store8(o + 8, fma8(s, acc[r][1], load8(o + 8)));
    } else {
      for (int64_t n = 0; n < width; ++n) o[n] = std::fma(scale[r], acc[r][n / 8][n % 8], o[n]);
    }
  }
}

template <int R>
cpu::LoraExpandFn expand_kernel(DType dtype) {
  return dtype == DType::F32   ? expand_chunk<DType::F32, R>
         : dtype == DType::F16 ? expand_chunk<DType::F16, R>
                               : expand_chunk<DType::BF16, R>;
}

// Calls block(rows) for the group's rows `size` at a time, then one(row) for the rest.
template <typename Block, typename One>
void by_row_blocks(const std::vector<int64_t>& rows, size_t size, const Block& block, const One& one) {
  size_t i = 0;
  for (; i + size <= rows.size(); i += size) block(&rows[i]);
  for (; i < rows.size(); ++i) one(&rows[i]);
}

// AVX2's: 2 x 4 shrink chains or 4 x 2 expand ones fill its 16 registers.
constexpr int kShrinkRows = 2, kExpandRows = 4;
constexpr cpu::LoraKernels kAvx2Kernels{
    kShrinkRows, kExpandRows,
    [](DType t, int rows, int64_t n) { return rows == 1 ? shrink_kernel<1>(t, n) : shrink_kernel<kShrinkRows>(t, n); },
    [](DType t, int rows) { return rows == 1 ? expand_kernel<1>(t) : expand_kernel<kExpandRows>(t); }};
constexpr int kMaxBlockRows = 8;  // of either kernel set

const cpu::LoraKernels& lora_kernels() {
  static const cpu::LoraKernels& k = cpu::avx512_copies() ? cpu::lora_kernels_avx512() : kAvx2Kernels;
  return k;
}

// Chunks of a B not in the C16T layout converted at a time: 16 x 16 columns of rank 16 in f32
// are 16 KiB, in L1.
constexpr int64_t kExpandBatch = 16;

}  // namespace

const cpu::LoraKernels& cpu::lora_kernels_avx2() { return kAvx2Kernels; }

void CpuBackend::lora(Stream& s, const Tensor& x, const Tensor& row_slots, const Tensor& row_scales,
                      std::shared_ptr<const LoraSlots> slots, int64_t site, int64_t site_rank, const Tensor& out) {
  own({&x, &row_slots, &row_scales, &out});
  checks::lora(x, row_slots, row_scales, site_rank, out);
  if (!slots) throw ValueError("lora: no slots");
  const int64_t T = x.rows(), K = x.cols(), ld = out.cols();
  auto tmp = scratch(Scratch::Lora, size_t(T * site_rank) * 4);
  // The groups are made once per call, by the shrink's thread 0 before its barrier; the expand
  // reads them after it.
  auto groups = std::make_shared<std::vector<SlotRows>>();
  CpuStream& cs = static_cast<CpuStream&>(s);
  cs.record("lora_shrink", [=](int ith, int nth) {
    // Every thread groups the rows itself (a few hundred ints): no wait for a shared plan.
    const std::vector<SlotRows> g = group_rows(*slots, site, host_ptr<int32_t>(row_slots), T);
    if (ith == 0) *groups = g;
    int64_t b, e;
    split_range(count_units(g, rank_units), ith, nth, &b, &e);
    float* t = reinterpret_cast<float*>(tmp->data());
    std::vector<float> a_f32;  // a block of A's rows converted, for A not in f32
    for_update_units(g, b, e, rank_units, [&](const SlotRows& grp, const LoraUpdate& up, int64_t offset, int64_t u0,
                                              int64_t u1) {
      for (int64_t block = u0; block < u1; ++block) {
        const int64_t j0 = block * kShrinkRanks, nj = std::min(kShrinkRanks, up.a.dim(0) - j0);
        const bool direct = direct_dtype(up.a.dtype);
        const DType a_dtype = direct ? up.a.dtype : DType::F32;
        const uint8_t* a = direct ? host_ptr<uint8_t>(up.a) + j0 * int64_t(dtype_bytes(up.a.dtype, K))
                                  : reinterpret_cast<const uint8_t*>(f32_rows(up.a, j0, nj, a_f32));
        const cpu::LoraKernels& kern = lora_kernels();
        const cpu::LoraShrinkFn block_kernel = kern.shrink(a_dtype, kern.shrink_rows, nj),
                                one_kernel = kern.shrink(a_dtype, 1, nj);
        auto run = [&](const int64_t* rows, int count, cpu::LoraShrinkFn kernel) {
          const float* xs[kMaxBlockRows];
          float* outs[kMaxBlockRows];
          for (int r = 0; r < count; ++r)
            xs[r] = host_ptr<float>(x) + rows[r] * K, outs[r] = t + rows[r] * site_rank + offset + j0;
          kernel(xs, a, K, outs);
        };
        by_row_blocks(
            grp.rows, size_t(kern.shrink_rows), [&](const int64_t* rows) { run(rows, kern.shrink_rows, block_kernel); },
            [&](const int64_t* rows) { run(rows, 1, one_kernel); });
      }
    });
  });
  cs.record("lora_expand", [=](int ith, int nth) {
    const std::vector<SlotRows>& g = *groups;
    int64_t b, e;
    split_range(count_units(g, col_units), ith, nth, &b, &e);
    const float* t = reinterpret_cast<const float*>(tmp->data());
    const float* row_scale = host_ptr<float>(row_scales);
    std::vector<float> b_f32, bt;  // for B not in C16T: kExpandBatch chunks' rows in f32, then as C16T
    for_update_units(g, b, e, col_units, [&](const SlotRows& grp, const LoraUpdate& up, int64_t offset, int64_t c0,
                                             int64_t c1) {
      const int64_t r = up.b.dim(1), N = up.b.dim(0);
      const bool chunked = layout_of(up.b) == quant::WeightLayout::C16T;
      const DType bt_dtype = chunked ? up.b.dtype : DType::F32;
      const size_t chunk_bytes = dtype_bytes(bt_dtype, r * kExpandCols);
      const cpu::LoraKernels& kern = lora_kernels();
      const cpu::LoraExpandFn block_kernel = kern.expand(bt_dtype, kern.expand_rows),
                              one_kernel = kern.expand(bt_dtype, 1);
      for (int64_t cb = c0; cb < c1; cb += kExpandBatch) {
        const int64_t chunks = std::min(kExpandBatch, c1 - cb), n0 = cb * kExpandCols;
        const uint8_t* chunk0;
        if (chunked) {
          chunk0 = host_ptr<uint8_t>(up.b) + size_t(cb) * chunk_bytes;
        } else {
          const int64_t b_rows = std::min(N, n0 + chunks * kExpandCols) - n0;
          bt.resize(size_t(quant::c16t_elements(b_rows, r)));
          quant::repack_c16t(DType::F32, f32_rows(up.b, n0, b_rows, b_f32), bt.data(), b_rows, r);
          chunk0 = reinterpret_cast<const uint8_t*>(bt.data());
        }
        auto run = [&](const int64_t* rows, int count, cpu::LoraExpandFn kernel) {
          const float* vs[kMaxBlockRows];
          float* outs[kMaxBlockRows];
          float scales[kMaxBlockRows];
          for (int i = 0; i < count; ++i) {
            vs[i] = t + rows[i] * site_rank + offset;
            scales[i] = up.scale * row_scale[rows[i]];
          }
          for (int64_t c = 0; c < chunks; ++c) {
            const int64_t col = n0 + c * kExpandCols;
            for (int i = 0; i < count; ++i) outs[i] = host_ptr<float>(out) + rows[i] * ld + up.out_col + col;
            kernel(vs, chunk0 + size_t(c) * chunk_bytes, r, std::min(kExpandCols, N - col), scales, outs);
          }
        };
        by_row_blocks(
            grp.rows, size_t(kern.expand_rows), [&](const int64_t* rows) { run(rows, kern.expand_rows, block_kernel); },
            [&](const int64_t* rows) { run(rows, 1, one_kernel); });
      }
    });
  });
}

}  // namespace ferrum
