// Runs a loaded decoder over many sequences that share one paged KV pool: sequences grow
// block by block, release their blocks when done, and can adopt cached prefix blocks.
// step() runs one varlen forward (prefill chunks and decode tokens of any sequences together)
// and replays a recorded stream whenever the step's shape was seen before.
#pragma once
#include <list>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine/block_allocator.h"
#include "model/decoder.h"

namespace ferrum {

struct RunnerOptions {
  std::string device = "cpu";
  int num_threads = 0;
  DType kv_dtype = DType::F16;
  int64_t max_model_len = 0;     // 0: the model's max_position_embeddings
  int64_t kv_cache_tokens = 0;   // 0: sized from kv_cache_bytes
  int64_t kv_cache_bytes = int64_t(1) << 30;
  bool prefix_cache = true;
};

struct StepItem {
  int64_t seq = 0;
  std::vector<int32_t> tokens;  // appended to the sequence at positions len .. len + n - 1
  enum class Logits { None, Last, All } logits = Logits::Last;
};

struct RunnerStats {
  int64_t kv_blocks_total, kv_blocks_used, kv_blocks_cached, block_size, sequences;
  int64_t prefix_queries, prefix_hit_tokens, prefix_query_tokens;
  int64_t steps, replays;
};

class ModelRunner {
 public:
  ModelRunner(const std::string& path, const RunnerOptions& opt);
  const ModelConfig& config() const { return decoder_->config(); }
  const std::string& format() const { return format_; }
  int64_t max_model_len() const { return max_model_len_; }
  int64_t block_size() const { return kBlockSize; }
  Backend& backend() { return *be_; }

  int64_t add_sequence();
  void release_sequence(int64_t seq);
  int64_t sequence_length(int64_t seq) const;
  // Adopts the longest cached prefix of `prompt` (whole blocks, always leaving at least one
  // token to compute); returns how many tokens the sequence now holds. Empty sequences only.
  int64_t adopt_prefix(int64_t seq, const std::vector<int32_t>& prompt);
  // Blocks a sequence of this many tokens needs; whether the pool could ever hold it.
  int64_t blocks_for(int64_t tokens) const { return (tokens + kBlockSize - 1) / kBlockSize; }

  // One forward; returns logits [rows, vocab] for the rows asked for, in item order.
  std::vector<float> step(const std::vector<StepItem>& items, int64_t* rows);
  RunnerStats stats() const;
  // Drops recorded streams (e.g. to compare replay with eager execution).
  void set_replay(bool on) { replay_ = on; graphs_.clear(); }

  static constexpr int64_t kBlockSize = 16;

 private:
  struct Sequence {
    std::vector<int32_t> blocks;
    std::vector<int32_t> tokens;  // every token whose K/V is in the cache
    int64_t hashed_blocks = 0;    // leading full blocks registered in the prefix cache
    uint64_t last_hash = 0;
  };
  struct Graph {
    StepBuffers buffers;
    std::unique_ptr<Stream> stream;
  };
  Graph& graph_for(int64_t tokens, int64_t seqs, int64_t rows);
  void register_full_blocks(Sequence& s);

  std::shared_ptr<Backend> be_;
  std::unique_ptr<Decoder> decoder_;
  std::string format_;
  int64_t max_model_len_ = 0, max_blocks_ = 0;
  std::vector<KvLayer> kv_;
  std::unique_ptr<BlockAllocator> alloc_;
  bool prefix_cache_ = true, replay_ = true;
  std::map<int64_t, Sequence> seqs_;
  int64_t next_seq_ = 1;
  std::list<std::pair<std::string, Graph>> graphs_;  // most recently used first
  RunnerStats stats_{};
  std::vector<int32_t> h_ids_, h_seq_, h_pos_, h_slot_, h_tables_, h_rows_;  // host staging
};

}  // namespace ferrum
