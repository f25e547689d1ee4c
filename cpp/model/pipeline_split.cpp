#include "model/pipeline_split.h"

#include <algorithm>
#include <limits>
#include <string>

#include "core/error.h"

namespace ferrum {

namespace {

double layer_cost(const ModelConfig& c, int64_t l) {
  const double H = double(c.hidden);
  const double attention = H * double(c.q_dim() + 2 * c.kv_dim()) + double(c.q_dim()) * H;
  const double mlp = c.is_moe_layer(l) ? double(c.experts) * (3.0 * H * double(c.expert_intermediate) + H)
                                       : 3.0 * H * double(c.intermediate);
  return attention + mlp;
}

std::string counts(const std::vector<int64_t>& p) {
  std::string s;
  for (size_t i = 0; i < p.size(); ++i) s += (i ? "," : "") + std::to_string(p[i]);
  return s;
}

// The contiguous split of the layers into `stages` non-empty ranges whose costliest range
// (the last with the lm_head) costs least: dynamic programming over (stage, layers so far).
std::vector<int64_t> cheapest_split(const ModelConfig& c, int stages) {
  const int64_t L = c.layers;
  std::vector<double> prefix(size_t(L + 1), 0.0);
  for (int64_t l = 0; l < L; ++l) prefix[size_t(l + 1)] = prefix[size_t(l)] + layer_cost(c, l);
  const double head = double(c.hidden) * double(c.vocab);
  const double inf = std::numeric_limits<double>::infinity();
  // best[s][n]: the least costliest-stage cost of the first n layers over stages [0, s]
  std::vector<std::vector<double>> best(size_t(stages), std::vector<double>(size_t(L + 1), inf));
  std::vector<std::vector<int64_t>> from(size_t(stages), std::vector<int64_t>(size_t(L + 1), 0));
  for (int64_t n = 1; n <= L; ++n) best[0][size_t(n)] = prefix[size_t(n)] + (stages == 1 ? head : 0.0);
  for (int s = 1; s < stages; ++s)
    for (int64_t n = s + 1; n <= L; ++n)
      for (int64_t m = s; m < n; ++m) {
        const double own = prefix[size_t(n)] - prefix[size_t(m)] + (s == stages - 1 ? head : 0.0);
        const double cost = std::max(best[size_t(s - 1)][size_t(m)], own);
        if (cost < best[size_t(s)][size_t(n)]) best[size_t(s)][size_t(n)] = cost, from[size_t(s)][size_t(n)] = m;
      }
  std::vector<int64_t> p(static_cast<size_t>(stages));
  int64_t n = L;
  for (int s = stages - 1; s > 0; --s) {
    const int64_t m = from[size_t(s)][size_t(n)];
    p[size_t(s)] = n - m;
    n = m;
  }
  p[0] = n;
  return p;
}

}  // namespace

std::vector<int64_t> partition_layers(const ModelConfig& c, int stages, const std::vector<int64_t>& partition) {
  if (stages < 1) throw ValueError("pipeline_parallel_size must be at least 1, got " + std::to_string(stages));
  if (stages > c.layers)
    throw ValueError("pipeline_parallel_size " + std::to_string(stages) + " exceeds the model's " +
                     std::to_string(c.layers) + " layers (each stage needs at least one)");
  if (partition.empty()) return cheapest_split(c, stages);
  const std::string given = "the pipeline layer partition \"" + counts(partition) + "\"";
  if (int64_t(partition.size()) != stages)
    throw ValueError(given + " has " + std::to_string(partition.size()) + " counts for " + std::to_string(stages) +
                     " stages");
  int64_t sum = 0;
  for (int64_t n : partition) {
    if (n < 1) throw ValueError(given + " gives a stage no layers (each needs at least one)");
    sum += n;
  }
  if (sum != c.layers)
    throw ValueError(given + " adds up to " + std::to_string(sum) + " layers, the model has " +
                     std::to_string(c.layers));
  return partition;
}

PipelineStage pipeline_stage(const ModelConfig& c, int stage, int stages, const std::vector<int64_t>& partition) {
  const std::vector<int64_t> p = partition_layers(c, stages, partition);
  if (stage < 0 || stage >= stages) throw ValueError("stage " + std::to_string(stage) + " of " + std::to_string(stages));
  PipelineStage s;
  s.stage = stage;
  s.stages = stages;
  for (int k = 0; k < stage; ++k) s.layer0 += p[size_t(k)];
  s.layers = p[size_t(stage)];
  return s;
}

}  // namespace ferrum
