// Runs a loaded decoder over many sequences that share one paged KV pool. forward() runs one
// varlen forward (prompt chunks, decode tokens and score chunks of any sequences together) as
// the scheduler planned it, and replays a recorded stream whenever the step's shape was seen
// before. The scheduler is what drives it; step() is a direct way in for tests and tools.
//
// With tensor parallelism (RunnerOptions::group) each rank's runner holds its share of the
// weights and of the KV heads (model/tensor_split.h). Rank 0's runner is the one the scheduler
// drives: it tells the other ranks' runners what to load and then each forward's plan (the host
// arrays and the graph key), which they all run through the same recorded steps
// (engine/follower.h, engine/rank_orders.h); the logits come together on rank 0. LoRA adapters
// made on rank 0 reach the others in orders too, each rank keeping its share of them.
#pragma once
#include <deque>
#include <list>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dist/communicator.h"
#include "engine/block_manager.h"
#include "engine/sequence.h"
#include "model/decoder.h"
#include "model/model_file.h"
#include "model/tensor_split.h"

namespace ferrum {

class SentOrder;

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
  // Tensor parallelism: the ranks that share the model (null: this process holds all of it). On
  // one machine, num_threads 0 gives each rank its share of the cores; the KV cache sizes are
  // each rank's (the ranks agree on the smallest pool).
  std::shared_ptr<Communicator> group;
  // LoRA: up to max_loras different adapters per step (0: none), each of rank <= max_lora_rank,
  // on a backend that supports(Op::Lora). In a group each rank holds its share of each adapter
  // (model/lora.h's make_lora_adapter).
  int64_t max_loras = 0;
  int64_t max_lora_rank = 16;
  // Pipeline parallelism: the group's ranks form this many stages of group size / stages
  // tensor-parallel ranks each (stage s: ranks [s * T, (s + 1) * T)), each stage holding a range
  // of the layers and a KV pool for them (model/pipeline_split.h). layer_partition: layers per
  // stage (empty: the cheapest split).
  int pipeline_stages = 1;
  std::vector<int64_t> layer_partition;
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
  // A prompt given as embeddings: f32 rows [embeds_len, hidden] from position 0, fed instead of
  // the tokens at those positions.
  const float* embeds = nullptr;
  int64_t embeds_len = 0;
  // The LoRA adapter its tokens run with (null: the base model), and the request's scale of it.
  std::shared_ptr<const LoraAdapter> lora;
  float lora_scale = 1.0f;
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

// A forward as every rank runs it: its shape (the key of its recorded step) and the host arrays
// uploaded into that step. Rank 0 plans it from the scheduler's items and sends it to the others.
struct StepPlan {
  int64_t tokens = 0, seqs = 0, rows = 0;  // token rows (padded to a bucket), sequences, output rows (>= 1)
  StepRows split;
  int64_t logit_rows = 0, hidden_rows = 0;  // rows wanted: logits, then final hidden states
  bool replay = true;
  // Some tokens given as embeddings: every token row's input is row input_rows[t] of
  // [the ids' embedding rows; embeds] (t for an id, tokens + t for an embedding).
  bool embeds = false;
  std::vector<float> embed_rows;    // [tokens, hidden] when embeds
  std::vector<int32_t> input_rows;  // [tokens] when embeds
  std::vector<int32_t> ids, token_seq, token_pos, slots;  // [tokens]
  std::vector<int32_t> block_tables;                      // [seqs, max_blocks]
  std::vector<int32_t> row_index;                         // [rows]: the token row of each output row
  // With LoRA: the step's adapters (one per slot used) and each token row's slot (-1: none). The
  // other ranks of a group know the adapters by rank 0's numbers for them (LoraAdapter::number).
  std::vector<std::shared_ptr<const LoraAdapter>> loras;
  std::vector<int64_t> lora_numbers;                      // [loras]
  std::vector<int32_t> lora_rows;                         // [tokens]
  std::vector<float> lora_scales;                         // [tokens]: each row's request scale
};

struct RunnerStats {
  int64_t kv_blocks_total, kv_blocks_used, kv_blocks_cached, block_size, sequences;
  int64_t prefix_queries, prefix_hit_tokens, prefix_query_tokens;
  int64_t steps, replays;
  int64_t weight_bytes;  // this rank's
  int64_t ranks;         // tensor-parallel ranks (1: none)
  int64_t stages;        // pipeline stages (1: none)
  ReduceTime all_reduce; // this rank's sums across the ranks
  ReduceTime hand_offs;  // this rank's hidden rows received from / sent to the neighbouring stages
};

// One rank's memory: its weights' and KV pool's buffers, its process's resident set (now, at its
// peak, and what loading the weights added to it), the process, the pipeline stage and layers
// [layer0, layer0 + layers) it holds, and the LoRA adapters it holds (its shares) and their bytes.
struct RankMemory {
  int64_t weight_bytes = 0, kv_bytes = 0, rss_bytes = 0, peak_rss_bytes = 0, load_rss_bytes = 0;
  int64_t pid = 0;
  int64_t stage = 0, layer0 = 0, layers = 0;
  int64_t loras = 0, lora_bytes = 0;
};

class ModelRunner {
 public:
  ModelRunner(const std::string& path, const RunnerOptions& opt);
  // Loads an opened model file (its tokenizer metadata is dropped first).
  ModelRunner(ModelFile file, const RunnerOptions& opt);
  // Rank 0 of a group tells the others the model is done with.
  ~ModelRunner();
  ModelRunner(const ModelRunner&) = delete;
  ModelRunner& operator=(const ModelRunner&) = delete;
  const ModelConfig& config() const { return cfg_; }
  const std::string& format() const { return format_; }
  int64_t max_model_len() const { return max_model_len_; }
  int64_t block_size() const { return kBlockSize; }
  Backend& backend() { return *be_; }
  int64_t max_loras() const { return max_loras_; }
  int64_t max_lora_rank() const { return max_lora_rank_; }
  // An adapter from its updates (model/lora.h: checked against this model, then uploaded);
  // ValueError when LoRA is off. In a group, the other ranks are sent its updates before the next
  // step (or memory report), and told once it is freed; any thread may make and free adapters.
  std::shared_ptr<const LoraAdapter> make_lora(std::vector<LoraPart> parts, uint64_t cache_key);
  // The other ranks of a group: rank 0's AddLora and DropLora orders (engine/rank_orders.h).
  void add_lora(const std::vector<char>& order);
  void drop_lora(const std::vector<char>& order);

  BlockManager& blocks() { return *blocks_; }
  const BlockManager& blocks() const { return *blocks_; }

  // One forward as planned; returns the rows asked for. Nothing may be in flight.
  ForwardOutput forward(const std::vector<ForwardItem>& items);
  // A forward in two halves, so that with pipeline stages several are in flight: begin() plans
  // it, sends it on its way and runs rank 0's stage (without stages: all of it); end() returns
  // the rows of the oldest begun, once the last stage has sent them. While the later stages run
  // one forward, rank 0 runs the next; every stage takes them in the order begun, so a KV block
  // freed and reused between two of them is written in that order on every stage.
  void begin(const std::vector<ForwardItem>& items);
  ForwardOutput end();
  int64_t in_flight() const { return int64_t(in_flight_.size()); }
  // Forwards worth keeping in flight: one per pipeline stage.
  int64_t pipeline_depth() const { return stage_.stages; }
  // Runs a planned forward as the other ranks of a group do with rank 0's plan (the last stage
  // sends its rows to rank 0); its adapters are looked up by their numbers (plan.loras).
  void run(StepPlan& plan);

  // Each rank's memory, gathered on rank 0 (one entry without a group). Rank 0 calls it; the
  // others answer in the follower's loop (report_memory).
  std::vector<RankMemory> rank_memory();
  void report_memory();

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
    std::unique_ptr<RecordedStep> step;
  };
  Graph& graph_for(const StepPlan& plan);
  bool leads() const { return group_ && group_->rank() == 0; }
  RankMemory memory() const;
  // The logits rows of this rank's vocabulary, gathered into `out` [rows, vocab] on rank 0.
  void gather_logits(const Tensor& logits, int64_t rows, std::vector<float>& out);
  // Fills plan_ from the items.
  void plan(const std::vector<ForwardItem>& items);
  // Runs this rank's share of a planned forward; on the last stage `out` gets its rows.
  void compute(const StepPlan& plan, ForwardOutput& out);
  // Pipeline parallelism: the last stage's first rank starts sending its rows to rank 0 (the
  // previous forward's sent by now), and keeps them until they are.
  void rows_to_rank0(const StepPlan& plan, ForwardOutput out);
  // Rank 0 in a group: the AddLora and DropLora orders queued since the last were sent, sent now.
  void send_lora_orders(std::vector<std::unique_ptr<SentOrder>>& sent);
  // A begun forward: its orders to the other ranks (adapters, then the step) and its rows, on their way.
  struct InFlight {
    std::vector<std::unique_ptr<SentOrder>> lora_orders;
    std::unique_ptr<SentOrder> order;
    ForwardOutput out;
    std::vector<std::unique_ptr<Communicator::Pending>> rows;
  };
  StageLinks links() const;

  std::shared_ptr<Communicator> group_;  // every rank: rank 0's orders
  // The ranks of this rank's stage, whose sums its steps take (group_ without pipeline stages;
  // null for one rank), and its stage's layers and neighbours.
  std::shared_ptr<Communicator> tp_;
  PipelineStage stage_;
  int tp_rank_ = 0, tp_size_ = 1;
  int64_t model_number_ = 0;  // rank 0's, in its orders about this model
  int64_t load_rss_bytes_ = 0;
  ModelConfig cfg_;
  TensorSplit split_;
  std::shared_ptr<Backend> be_;
  std::unique_ptr<Decoder> decoder_;
  std::string format_;
  int64_t max_model_len_ = 0, max_blocks_ = 0;
  int64_t max_loras_ = 0, max_lora_rank_ = 0;
  // With LoRA: rank 0's (or one process's) adapters alive, and the orders about them for the others.
  struct LoraRegistry;
  std::shared_ptr<LoraRegistry> loras_;
  std::map<int64_t, std::shared_ptr<const LoraAdapter>> rank_loras_;  // the other ranks': by rank 0's number
  std::vector<KvLayer> kv_;
  std::unique_ptr<BlockManager> blocks_;
  bool replay_ = true;
  std::list<std::pair<std::string, Graph>> graphs_;  // most recently used first
  RunnerStats stats_{};
  StepPlan plan_;                          // begin()'s, reused
  std::deque<InFlight> in_flight_;         // oldest first
  std::vector<int32_t> local_ids_;         // a rank's ids into its share of the embedding
  std::vector<float> logits_share_, logits_gathered_;
  ForwardOutput rows_sending_;  // the last stage's rows on their way to rank 0
  std::vector<std::unique_ptr<Communicator::Pending>> rows_sent_;
};

}  // namespace ferrum
