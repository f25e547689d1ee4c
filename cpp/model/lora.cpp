#include "model/lora.h"

#include <algorithm>
#include <cmath>
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

std::shared_ptr<const LoraAdapter> make_lora_adapter(Backend& be, const ModelConfig& cfg, int64_t max_rank,
                                                     std::vector<LoraPart> parts, uint64_t cache_key) {
  auto adapter = std::make_shared<LoraAdapter>();
  adapter->cache_key = cache_key;
  adapter->sites.resize(size_t(cfg.layers * kLoraSitesPerLayer));
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
    std::vector<LoraUpdate>& site = adapter->sites[size_t(p.site)];
    if (int64_t(site.size()) >= shape.parts) throw ValueError(where + ": more updates than the projection has parts");
    LoraUpdate u;
    u.a = be.from_host(p.a.data(), p.a_dtype, {p.rank, shape.in});
    u.b = be.from_host(p.b.data(), p.b_dtype, {p.n, p.rank});
    u.out_col = p.out_col;
    u.scale = p.scale;
    adapter->bytes += int64_t(u.a.nbytes() + u.b.nbytes());
    site.push_back(u);
  }
  if (parts.empty()) throw ValueError("the LoRA adapter updates no projection");
  return adapter;
}

}  // namespace ferrum
