#include "model/lora.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "core/error.h"

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
    if (p.a.size() != size_t(p.rank * shape.in) || p.b.size() != size_t(p.n * p.rank))
      throw ValueError(where + ": A must be [" + std::to_string(p.rank) + ", " + std::to_string(shape.in) +
                       "] and B [" + std::to_string(p.n) + ", " + std::to_string(p.rank) + "]");
    if (!std::isfinite(p.scale)) throw ValueError(where + ": the scale is not finite");
    for (const std::vector<float>* v : {&p.a, &p.b})
      for (float f : *v)
        if (!std::isfinite(f)) throw ValueError(where + ": non-finite value " + std::to_string(f));
    std::vector<LoraUpdate>& site = adapter->sites[size_t(p.site)];
    if (int64_t(site.size()) >= shape.parts) throw ValueError(where + ": more updates than the projection has parts");
    LoraUpdate u;
    u.a = be.from_host(p.a.data(), DType::F32, {p.rank, shape.in});
    u.b = be.from_host(p.b.data(), DType::F32, {p.n, p.rank});
    u.out_col = p.out_col;
    u.scale = p.scale;
    adapter->bytes += int64_t(u.a.nbytes() + u.b.nbytes());
    site.push_back(u);
  }
  if (parts.empty()) throw ValueError("the LoRA adapter updates no projection");
  return adapter;
}

}  // namespace ferrum
