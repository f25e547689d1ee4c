// How a model divides between the stages of a pipeline (pipeline parallelism): each stage holds
// a contiguous range of the decoder's layers, the first also the embedding, the last the final
// norm and the lm_head (a tied embedding on both). A step's hidden rows (the residual stream,
// f32 [tokens, hidden]) pass from each stage to the next.
//
// Layers are divided so that the costliest stage costs least: a layer costs its parameters (an
// MoE layer's experts counted whole, as their weights are what a step reads), and the last
// stage's lm_head adds its own.
#pragma once
#include <cstdint>
#include <vector>

#include "model/config.h"

namespace ferrum {

struct PipelineStage {
  int stage = 0, stages = 1;
  int64_t layer0 = 0, layers = 0;  // this stage's layers: [layer0, layer0 + layers)
  bool first() const { return stage == 0; }
  bool last() const { return stage == stages - 1; }
  bool whole() const { return stages == 1; }
};

// Layers per stage: `partition` when one is given (ValueError unless it has one positive count
// per stage and they add up to the model's layers), else the cheapest split as above.
std::vector<int64_t> partition_layers(const ModelConfig& c, int stages, const std::vector<int64_t>& partition = {});
// Stage `stage` of `stages` (ValueError as partition_layers, or for more stages than layers).
PipelineStage pipeline_stage(const ModelConfig& c, int stage, int stages, const std::vector<int64_t>& partition = {});

}  // namespace ferrum
