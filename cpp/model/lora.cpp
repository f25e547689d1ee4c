#include "model/lora.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <tuple>

#include "core/error.h"
#include "quant/quant.h"

namespace ferrum {

LoraSiteShape lora_site_shape(const ModelConfig& c, int64_t site) {
  const int64_t layer = site / kLoraSitesPerLayer;
  if (site < 0 || layer >= c.layers) return {};
  switch (LoraSite(site % kLoraSitesPerLayer)) {
    case LoraSite::Qkv:
      return {c.hidden, c.q_dim() + 2 * c.kv_dim(), 3};
    case LoraSite::O:
      return {c.q_dim(), c.hidden, 1};
    case LoraSite::GateUp:
      if (c.is_moe_layer(layer)) return {};
      return {c.hidden, 2 * c.intermediate, 2};
    case LoraSite::Down:
      if (c.is_moe_layer(layer)) return {};
      return {c.intermediate, c.hidden, 1};
  }
  return {};
}

namespace {

// A fused projection's parts (q, k, v; gate, up) as columns [begin, begin + count) of its whole
// output, with this rank's rows of each: its fused output is its rows of each part in turn.
struct FusedPart {
  int64_t begin = 0, count = 0;
  IndexRange share;
};

std::vector<FusedPart> fused_parts(const ModelConfig& c, const TensorSplit& split, LoraSite site) {
  if (site == LoraSite::Qkv)
    return {{0, c.q_dim(), split.q_rows(c)}, {c.q_dim(), c.kv_dim(), split.kv_rows(c)},
            {c.q_dim() + c.kv_dim(), c.kv_dim(), split.kv_rows(c)}};
  return {{0, c.intermediate, split.inter_rows()}, {c.intermediate, c.intermediate, split.inter_rows()}};
}

bool column_parallel(int64_t site) {
  const LoraSite s = LoraSite(site % kLoraSitesPerLayer);
  return s == LoraSite::Qkv || s == LoraSite::GateUp;
}

// Whether the update's columns lie within one part of its fused projection's output.
bool within_one_part(const ModelConfig& c, const TensorSplit& split, const LoraPart& p) {
  for (const FusedPart& f : fused_parts(c, split, LoraSite(p.site % kLoraSitesPerLayer)))
    if (p.out_col < f.begin + f.count) return p.out_col + p.n <= f.begin + f.count;
  return false;
}

// Columns [c0, c0 + n) of each row of a [rows, cols] matrix of dtype *t: in that dtype when they
// are whole blocks of it, else in f32 (their values).
void keep_columns(DType* t, std::vector<uint8_t>* m, int64_t rows, int64_t cols, int64_t c0, int64_t n) {
  std::vector<uint8_t> out;
  const int64_t block = dtype_info(*t).block_elems;
  if (c0 % block == 0 && n % block == 0) {
    const size_t row = dtype_bytes(*t, cols), skip = dtype_bytes(*t, c0), keep = dtype_bytes(*t, n);
    out.resize(size_t(rows) * keep);
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(out.data() + size_t(r) * keep, m->data() + size_t(r) * row + skip, keep);
  } else {
    std::vector<float> values(static_cast<size_t>(cols));
    out.resize(size_t(rows * n) * 4);
    for (int64_t r = 0; r < rows; ++r) {
      quant::dequantize_row(*t, m->data() + size_t(r) * dtype_bytes(*t, cols), values.data(), cols);
      std::memcpy(out.data() + size_t(r * n) * 4, values.data() + c0, size_t(n) * 4);
    }
    *t = DType::F32;
  }
  *m = std::move(out);
}

// Cuts p (checked against the whole model c) down to the share of rank `split`, in the columns of
// its fused output; false when the rank holds none of p's columns.
bool keep_share(const ModelConfig& c, const TensorSplit& split, LoraPart& p) {
  if (split.whole()) return true;
  const LoraSite kind = LoraSite(p.site % kLoraSitesPerLayer);
  if (!column_parallel(p.site)) {  // o, down: the rank's input columns of A
    const IndexRange in = kind == LoraSite::O ? split.q_rows(c) : split.inter_rows();
    keep_columns(&p.a_dtype, &p.a, p.rank, lora_site_shape(c, p.site).in, in.begin, in.count);
    return true;
  }
  int64_t local = 0;  // the first column of the part's rows in the rank's fused output
  for (const FusedPart& f : fused_parts(c, split, kind)) {
    if (p.out_col >= f.begin + f.count) {
      local += f.share.count;
      continue;
    }
    const int64_t r0 = f.begin + f.share.begin, r1 = r0 + f.share.count;  // the rank's columns of the part
    const int64_t lo = std::max(p.out_col, r0), hi = std::min(p.out_col + p.n, r1);
    if (lo >= hi) return false;
    const size_t row = dtype_bytes(p.b_dtype, p.rank);  // B's rows are the update's columns
    p.b.erase(p.b.begin() + int64_t(size_t(hi - p.out_col) * row), p.b.end());
    p.b.erase(p.b.begin(), p.b.begin() + int64_t(size_t(lo - p.out_col) * row));
    p.out_col = local + lo - r0;
    p.n = hi - lo;
    return true;
  }
  return false;
}

}  // namespace

std::shared_ptr<LoraAdapter> make_lora_adapter(Backend& be, const ModelConfig& cfg, int64_t max_rank,
                                               std::vector<LoraPart> parts, uint64_t cache_key) {
  return make_lora_adapter(be, cfg, max_rank, std::move(parts), cache_key, TensorSplit{},
                           PipelineStage{0, 1, 0, cfg.layers});
}

std::shared_ptr<LoraAdapter> make_lora_adapter(Backend& be, const ModelConfig& cfg, int64_t max_rank,
                                               std::vector<LoraPart> parts, uint64_t cache_key,
                                               const TensorSplit& split, const PipelineStage& stage) {
  auto adapter = std::make_shared<LoraAdapter>();
  adapter->cache_key = cache_key;
  adapter->sites.resize(size_t(cfg.layers * kLoraSitesPerLayer));
  const ModelConfig local = split.whole() ? cfg : split.local(cfg);
  // A part's own bytes, for from_host to wrap (a host backend copies them once, in pack_lora).
  const auto held = [](std::vector<uint8_t>& bytes) {
    return std::make_shared<std::vector<uint8_t>>(std::move(bytes));
  };
  std::sort(parts.begin(), parts.end(), [](const LoraPart& x, const LoraPart& y) {
    return x.site != y.site ? x.site < y.site : x.out_col < y.out_col;
  });
  for (size_t i = 0; i < parts.size(); ++i) {
    const LoraPart& p = parts[i];
    const LoraSiteShape shape = lora_site_shape(cfg, p.site);
    const std::string where = "LoRA update at site " + std::to_string(p.site) + " (layer " +
                              std::to_string(p.site / kLoraSitesPerLayer) + ")";
    if (shape.in == 0) throw ValueError(where + ": the model has no such projection");
    if (p.rank < 1 || p.rank > max_rank)
      throw ValueError(where + ": rank " + std::to_string(p.rank) + " is not in [1, max_lora_rank " +
                       std::to_string(max_rank) + "]");
    if (p.n < 1 || p.out_col < 0 || p.out_col + p.n > shape.out)
      throw ValueError(where + ": columns [" + std::to_string(p.out_col) + ", " + std::to_string(p.out_col + p.n) +
                       ") are outside the projection's " + std::to_string(shape.out));
    if (i > 0 && parts[i - 1].site == p.site && parts[i - 1].out_col + parts[i - 1].n > p.out_col)
      throw ValueError(where + ": two updates overlap in columns");
    if (i >= size_t(shape.parts) && parts[i - size_t(shape.parts)].site == p.site)
      throw ValueError(where + ": more updates than the projection has parts");
    if (!split.whole() && column_parallel(p.site) && !within_one_part(cfg, split, p))
      throw ValueError(where + ": under tensor parallelism an update of a fused projection must lie within one of "
                               "its parts (q, k or v; gate or up)");
    for (const auto& [name, t, rows, cols] : {std::tuple{"A", p.a_dtype, p.rank, shape.in},
                                              std::tuple{"B", p.b_dtype, p.n, p.rank}}) {
      if (!lora_storage_dtype(t))
        throw ValueError(where + ": " + name + " is " + dtype_name(t) +
                         "; adapters are kept in f32, f16, bf16 or q8_0");
      if (cols % dtype_info(t).block_elems != 0)
        throw ValueError(where + ": " + name + "'s rows of " + std::to_string(cols) + " are not whole " +
                         dtype_name(t) + " blocks");
    }
    if (p.a.size() != dtype_bytes(p.a_dtype, p.rank * shape.in) || p.b.size() != dtype_bytes(p.b_dtype, p.n * p.rank))
      throw ValueError(where + ": A must be [" + std::to_string(p.rank) + ", " + std::to_string(shape.in) +
                       "] and B [" + std::to_string(p.n) + ", " + std::to_string(p.rank) + "]");
    if (!std::isfinite(p.scale)) throw ValueError(where + ": the scale is not finite");
    for (const auto& [t, bytes, n] : {std::tuple{p.a_dtype, &p.a, p.rank * shape.in},
                                      std::tuple{p.b_dtype, &p.b, p.n * p.rank}}) {
      std::vector<float> values(static_cast<size_t>(n));
      quant::dequantize_row(t, bytes->data(), values.data(), n);
      for (float f : values)
        if (!std::isfinite(f)) throw ValueError(where + ": non-finite value " + std::to_string(f));
    }
    const int64_t layer = p.site / kLoraSitesPerLayer;
    if (layer < stage.layer0 || layer >= stage.layer0 + stage.layers) continue;
    LoraPart mine = std::move(parts[i]);  // its bytes; the columns stay for the next part's check
    if (!keep_share(cfg, split, mine)) continue;
    LoraUpdate u;
    const auto a = held(mine.a), b = held(mine.b);
    u.a = be.from_host(a->data(), mine.a_dtype, {mine.rank, lora_site_shape(local, mine.site).in}, a);
    u.b = be.from_host(b->data(), mine.b_dtype, {mine.n, mine.rank}, b);
    u.out_col = mine.out_col;
    u.scale = mine.scale;
    adapter->bytes += int64_t(u.a.nbytes() + u.b.nbytes());
    adapter->sites[size_t(mine.site)].push_back(u);
  }
  if (parts.empty()) throw ValueError("the LoRA adapter updates no projection");
  be.pack_lora(*adapter);
  return adapter;
}

}  // namespace ferrum
