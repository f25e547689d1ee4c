// LoRA adapters as the decoder applies them: each rides on a projection (model/weights.h's
// Linear) without changing it, adding its low-rank update into the projection's output after the
// matmul, whatever the base weights' dtype. Sites are the decoder's projections, numbered
// layer * kLoraSitesPerLayer + LoraSite; q/k/v and gate/up updates fill their part's columns of
// the fused output.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "backend/backend.h"
#include "model/config.h"
#include "model/pipeline_split.h"
#include "model/tensor_split.h"

namespace ferrum {

enum class LoraSite : int64_t { Qkv = 0, O = 1, GateUp = 2, Down = 3 };
constexpr int64_t kLoraSitesPerLayer = 4;
inline int64_t lora_site(int64_t layer, LoraSite s) { return layer * kLoraSitesPerLayer + int64_t(s); }

// A site's projection: in_features, out_features (the fused output's), and the updates it may
// take (3 for q/k/v, 2 for gate/up, else 1). Zero features: the layer has no such projection (the
// MLP of a mixture-of-experts layer).
struct LoraSiteShape {
  int64_t in = 0, out = 0, parts = 0;
};
LoraSiteShape lora_site_shape(const ModelConfig& cfg, int64_t site);

// A loaded adapter: its weights, and the key its sequences' prefix-cache blocks are filed under
// (a hash of its content and scales: the same prompt under two adapters never shares blocks).
// In a group of ranks, `number` is what rank 0's orders call it (engine/rank_orders.h).
struct LoraAdapter : LoraWeights {
  uint64_t cache_key = 0;
  int64_t number = 0;
};

// One update as read from a file, on the host: a [rank, in] and b [n, rank] row-major, each the
// raw bytes of its storage dtype (F32, F16, BF16, or Q8_0 for rows that are whole blocks).
struct LoraPart {
  int64_t site = 0, rank = 0, n = 0, out_col = 0;
  float scale = 1.0f;
  DType a_dtype = DType::F32, b_dtype = DType::F32;
  std::vector<uint8_t> a, b;
};

// Checks the parts against the model (site, dtypes, shapes, column ranges that do not overlap,
// rank <= max_rank, finite values; ValueError naming the site) and uploads them in their dtypes.
std::shared_ptr<LoraAdapter> make_lora_adapter(Backend& be, const ModelConfig& cfg, int64_t max_rank,
                                               std::vector<LoraPart> parts, uint64_t cache_key);
// As above (checked against the whole model), but only the share of rank `split` of pipeline
// stage `stage` is uploaded, cut as its weights are (model/tensor_split.h):
//   q/k/v and gate/up (split by output rows): the rows of B in the rank's rows of its part, A
//     whole; an update that spans two parts of the fused output is refused (ValueError);
//   o and down (split by input columns): A's columns of the rank's inputs (in f32 when a q8_0 A
//     would not be whole blocks: the same values), B whole; the ranks' partial updates add up in
//     the sum of the projection's partial outputs, which they are added to;
//   the stage's layers only. Sites keep the whole model's numbers; the rank's update shapes are
//   those of split.local(cfg).
std::shared_ptr<LoraAdapter> make_lora_adapter(Backend& be, const ModelConfig& cfg, int64_t max_rank,
                                               std::vector<LoraPart> parts, uint64_t cache_key,
                                               const TensorSplit& split, const PipelineStage& stage);

}  // namespace ferrum
