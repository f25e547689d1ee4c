// LoRA on the CPU: two commands per projection site. Rows are grouped by the slot they chose;
// the shrink gives each thread whole rank rows of A (every row of the group against one A row),
// the expand whole 16-column chunks of B, so each adapter's A and B are read once per call
// however many rows use it. An A row or a B chunk stored in f16 / bf16 / q8_0 is converted to f32
// once per call (into an L1-sized buffer) and dotted by the same f32 kernel as an f32 one, so the
// stored bytes are read once and the results are those of the f32 update with those values. Each
// output element is one fixed-order dot product of its row's own values, scaled by its row's
// request scale: a row's result does not depend on its batch.
#include <algorithm>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/cpu_kernels.h"
#include "backend/op_checks.h"
#include "core/error.h"
#include "quant/quant.h"

namespace ferrum {

namespace {

constexpr int64_t kExpandCols = 16;

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

// Calls fn(group, update, offset of the update's ranks in a row of scratch, unit) for the units
// [begin, end) of all groups' updates, where an update has units_of(update) units.
template <typename Units, typename Fn>
void for_units(const std::vector<SlotRows>& groups, int64_t begin, int64_t end, const Units& units_of, const Fn& fn) {
  int64_t u0 = 0;
  for (const SlotRows& g : groups) {
    int64_t offset = 0;
    for (const LoraUpdate& up : *g.updates) {
      const int64_t n = units_of(up);
      for (int64_t u = std::max(begin, u0); u < std::min(end, u0 + n); ++u) fn(g, up, offset, u - u0);
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

int64_t rank_units(const LoraUpdate& up) { return up.a.dim(0); }

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
int64_t col_units(const LoraUpdate& up) { return (up.b.dim(0) + kExpandCols - 1) / kExpandCols; }

}  // namespace

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
    thread_local std::vector<float> buf;
    for_units(g, b, e, rank_units, [&](const SlotRows& grp, const LoraUpdate& up, int64_t offset, int64_t j) {
      const float* a = f32_rows(up.a, j, 1, buf);
      for (int64_t r : grp.rows) t[r * site_rank + offset + j] = cpu::dot_f32(host_ptr<float>(x) + r * K, a, K);
    });
  });
  cs.record("lora_expand", [=](int ith, int nth) {
    const std::vector<SlotRows>& g = *groups;
    int64_t b, e;
    split_range(count_units(g, col_units), ith, nth, &b, &e);
    const float* t = reinterpret_cast<const float*>(tmp->data());
    const float* row_scale = host_ptr<float>(row_scales);
    thread_local std::vector<float> buf;
    for_units(g, b, e, col_units, [&](const SlotRows& grp, const LoraUpdate& up, int64_t offset, int64_t chunk) {
      const int64_t r = up.b.dim(1), n0 = chunk * kExpandCols, n1 = std::min(up.b.dim(0), n0 + kExpandCols);
      const float* bm = f32_rows(up.b, n0, n1 - n0, buf);  // rows n0 ..
      for (int64_t row : grp.rows) {
        const float* v = t + row * site_rank + offset;
        float* o = host_ptr<float>(out) + row * ld + up.out_col;
        const float scale = up.scale * row_scale[row];
        for (int64_t n = n0; n < n1; ++n) o[n] += scale * cpu::dot_f32(v, bm + (n - n0) * r, r);
      }
    });
  });
}

}  // namespace ferrum
