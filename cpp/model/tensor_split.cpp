#include "model/tensor_split.h"

#include <algorithm>
#include <string>

#include "core/error.h"

namespace ferrum {

namespace {
// Vocabulary shares are whole groups of this many rows where the vocabulary allows: the CPU
// backend keeps weights of whole 16-row groups in its R16 layout (Backend::pack_weight), so the
// ranks' lm_head shares run the kernels the whole matrix runs.
constexpr int64_t kRowGroup = 16;

std::string of(int64_t n, const char* what) { return std::to_string(n) + " " + what; }
}  // namespace

ModelConfig TensorSplit::local(const ModelConfig& c) const {
  ModelConfig l = c;
  l.heads = heads;
  l.kv_heads = kv_heads;
  l.intermediate = intermediate;
  l.expert_intermediate = expert_intermediate;
  l.vocab = vocab;
  return l;
}

TensorSplit split_model(const ModelConfig& c, int rank, int ranks) {
  if (ranks < 1 || rank < 0 || rank >= ranks) throw ValueError("rank " + std::to_string(rank) + " of " + std::to_string(ranks));
  const std::string among = " between " + of(ranks, "ranks");
  auto divided = [&](int64_t n, const char* what) {
    if (n % ranks != 0)
      throw ValueError("the model's " + of(n, what) + " do not divide" + among + " (tensor parallelism splits them evenly)");
    return n / ranks;
  };
  TensorSplit s;
  s.rank = rank;
  s.ranks = ranks;
  s.heads = divided(c.heads, "attention heads");
  s.head0 = rank * s.heads;
  if (c.kv_heads % ranks == 0) {
    s.kv_heads = c.kv_heads / ranks;
    s.kv_head0 = rank * s.kv_heads;
  } else if (ranks % c.kv_heads == 0) {  // each KV head on the ranks that hold its query heads
    s.kv_heads = 1;
    s.kv_head0 = rank / (ranks / c.kv_heads);
  } else {
    throw ValueError("the model's " + of(c.kv_heads, "KV heads") + " can be neither divided" + among +
                     " nor shared by them (use a rank count that divides the KV heads or that they divide)");
  }
  if (c.has_dense_layer()) {
    s.intermediate = divided(c.intermediate, "MLP intermediate rows");
    s.inter0 = rank * s.intermediate;
  }
  if (c.experts > 0) {
    s.expert_intermediate = divided(c.expert_intermediate, "expert intermediate rows");
    s.expert_inter0 = rank * s.expert_intermediate;
  }
  const int64_t even = (c.vocab + ranks - 1) / ranks;
  const int64_t grouped = (even + kRowGroup - 1) / kRowGroup * kRowGroup;
  s.vocab_chunk = grouped * (ranks - 1) < c.vocab ? grouped : even;
  if (s.vocab_chunk * (ranks - 1) >= c.vocab)  // the last rank would have no rows
    throw ValueError("the model's " + of(c.vocab, "vocabulary rows") + " are too few to split" + among);
  s.vocab0 = rank * s.vocab_chunk;
  s.vocab = std::min(s.vocab_chunk, c.vocab - s.vocab0);
  return s;
}

}  // namespace ferrum
