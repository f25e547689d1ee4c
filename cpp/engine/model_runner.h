// Runs a loaded decoder over many sequences that share one paged KV pool. forward() runs one
// varlen forward (prompt chunks, decode tokens and score chunks of any sequences together) as
// the scheduler planned it, and replays a recorded stream whenever the step's shape was seen
// before. The scheduler is what drives it; step() is a direct way in for tests and tools.
#pragma once
#include <list>
#include <memory>
#include <string>
#include <vector>

#include "engine/block_manager.h"
#include "engine/sequence.h"
#include "model/decoder.h"
#include "model/model_file.h"

namespace ferrum {

struct RunnerOptions {
  std::string device = "cpu";
  int num_threads = 0;
  DType kv_dtype = DType::F16;
  int64_t max_model_len = 0;     // 0: the model's max_position_embeddings
  int64_t kv_cache_tokens = 0;   // 0: sized from kv_cache_bytes
  int64_t kv_cache_bytes = int64_t(1) << 30;
  double kv_cache_fraction = 0;  // > 0: this fraction of the memory available now (wins over bytes)
  bool prefix_cache = true;
  LoadProgress load_progress;    // optional: reports layers loaded (used only while constructing)
};

// One sequence's part of a forward: its tokens at positions [start, start + count), whose
// blocks BlockManager sequence `kv` already holds, and the rows wanted at positions
// [rows_from, rows_from + rows): logits, or for an embedding the final hidden states. The kind
// states the numerics (generation: the backend's 8-bit paths may be taken; score and embedding:
// f32 activations). Items come generations first, then scores, then embeddings.
struct ForwardItem {
  int64_t kv = 0;
  const int32_t* tokens = nullptr;  // `count` tokens
  SeqKind kind = SeqKind::Generate;
  int64_t start = 0, count = 0;
  int64_t rows_from = 0, rows = 0;
  // A generation's next token, with any proposals after it: when every generation item of a
  // forward is one, their matmuls take the backend's decode path, so a token computes the same
  // decoded alone, batched or verified with proposals.
  bool decode = false;
};

struct ForwardOutput {
  std::vector<float> logits;  // [generation and score rows, vocab], in item order
  std::vector<float> hidden;  // [embedding rows, hidden], in item order
};

// A direct step's item (tests and tools): tokens appended to BlockManager sequence `seq` at
// positions len .. len + n - 1; logits at its last position, all of them (computed as scoring),
// or none.
struct StepItem {
  int64_t seq = 0;
  std::vector<int32_t> tokens;
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
  // Loads an opened model file (its tokenizer metadata is dropped first).
  ModelRunner(ModelFile file, const RunnerOptions& opt);
  const ModelConfig& config() const { return decoder_->config(); }
  const std::string& format() const { return format_; }
  int64_t max_model_len() const { return max_model_len_; }
  int64_t block_size() const { return kBlockSize; }
  Backend& backend() { return *be_; }

  BlockManager& blocks() { return *blocks_; }
  const BlockManager& blocks() const { return *blocks_; }

  // One forward as planned; returns the rows asked for.
  ForwardOutput forward(const std::vector<ForwardItem>& items);

  // Direct use without a scheduler (tests, tools): sequences of the block manager, extended by
  // step() (checked first, nothing changed on error). They never enter the prefix cache.
  int64_t add_sequence() { return blocks_->add_sequence(); }
  void release_sequence(int64_t seq) { blocks_->release_sequence(seq); }
  int64_t sequence_length(int64_t seq) const { return blocks_->length(seq); }
  std::vector<float> step(const std::vector<StepItem>& items, int64_t* rows);
  RunnerStats stats() const;
  // Drops recorded streams (e.g. to compare replay with eager execution).
  void set_replay(bool on) { replay_ = on; graphs_.clear(); }

  static constexpr int64_t kBlockSize = BlockManager::kBlockSize;

 private:
  struct Graph {
    StepBuffers buffers;
    std::unique_ptr<Stream> stream;
  };
  Graph& graph_for(int64_t tokens, int64_t seqs, int64_t rows, const StepRows& split);

  std::shared_ptr<Backend> be_;
  std::unique_ptr<Decoder> decoder_;
  std::string format_;
  int64_t max_model_len_ = 0, max_blocks_ = 0;
  std::vector<KvLayer> kv_;
  std::unique_ptr<BlockManager> blocks_;
  bool replay_ = true;
  std::list<std::pair<std::string, Graph>> graphs_;  // most recently used first
  RunnerStats stats_{};
  std::vector<int32_t> h_ids_, h_seq_, h_pos_, h_slot_, h_tables_, h_rows_;  // host staging
};

}  // namespace ferrum
