// The serving engine: a Scheduler over a ModelRunner, and the only driver of the model. step()
// schedules and runs one varlen forward and hands back its rows, each tagged with its sequence
// and position: a generation's row to sample from (then one per proposal it verifies), or rows
// a score or an embedding asked for. The
// caller samples (sampling, stop strings and detokenisation live in Python) and hands the
// tokens back with commit(), saying which sequences are finished so their blocks return to the
// pool (and, full ones, to the prefix cache); a score ends by itself with its last rows.
// Every method locks, so a server thread may add or abort meanwhile.
//
// With pipeline stages, a step begins forwards until one per stage is in flight and returns the
// oldest's rows: its sequences are sampled and committed while the others are computed.
#pragma once
#include <chrono>
#include <cstdint>
#include <deque>
#include <mutex>
#include <vector>

#include "engine/model_runner.h"
#include "engine/scheduler.h"

namespace ferrum {

struct EngineOptions {
  int64_t max_num_seqs = 32;
  int64_t max_num_batched_tokens = 512;
};

// The LoRA adapter a sequence runs with (ModelRunner::make_lora); null: the base model.
using LoraRef = std::shared_ptr<const LoraAdapter>;

// A step's rows: the logits rows (generations', then scores') and after them the embeddings'
// hidden-state rows, each tagged with its sequence and position (logits at a position predict
// the token after it).
struct EngineStep {
  std::vector<int64_t> row_seqs;
  std::vector<int64_t> row_positions;
  std::vector<int64_t> sample_rows;    // the rows generations sample from (indices into the rows)
  std::vector<float> logits;           // [logits rows, vocab]
  std::vector<float> hidden;           // [hidden rows, hidden size]
  std::vector<int64_t> scored;         // scores and embeddings whose last rows came: finished
  std::vector<int64_t> ended;          // generations the engine ended ("length": the pool is full)
  int64_t num_tokens = 0;            // tokens computed by this forward
  int64_t num_preempted = 0;
};

struct EngineStats {
  int64_t running = 0, waiting = 0, preemptions = 0, steps = 0;
  int64_t generated_tokens = 0, computed_tokens = 0;
  double busy_seconds = 0;  // wall time with unfinished sequences in the engine
  int64_t max_in_flight = 0;  // the most forwards in flight at once (pipeline stages)
};

class Engine {
 public:
  Engine(ModelRunner& runner, const EngineOptions& opt);

  // Queues a generation; ValueError when it could never run. Returns its id. The logits of its
  // prompt's positions rows_from .. come out too (-1: none).
  // lora_scale: the request's scale of the adapter's updates (finite), on top of the file's.
  int64_t add_sequence(const std::vector<int64_t>& prompt, int64_t rows_from = -1, LoraRef lora = nullptr,
                       float lora_scale = 1.0f);
  // Queues a score of `tokens` (logits rows) or an embedding (hidden-state rows): rows at positions
  // rows_from .. end come out of the steps that compute them, with f32 activations. ValueError
  // when it could never run.
  int64_t add_score(const std::vector<int64_t>& tokens, int64_t rows_from, SeqKind kind = SeqKind::Score,
                    LoraRef lora = nullptr, float lora_scale = 1.0f);
  // Queues a prompt given as embeddings: f32 rows [tokens, hidden] (row-major) fed instead of
  // token ids. A generation (kind Generate; rows_from as add_sequence's) continues from its
  // sampled ids; a score or embedding returns rows from rows_from. ValueError for a width other
  // than the hidden size, no rows, a non-finite value, or one that could never run.
  int64_t add_prompt_embeds(std::vector<float> rows, SeqKind kind, int64_t rows_from, LoraRef lora = nullptr,
                            float lora_scale = 1.0f);
  // Ends a sequence wherever it is (waiting, mid-prefill, decoding); unknown ids are ignored.
  void abort(int64_t seq);
  EngineStep step();
  // Tokens sampled for the sample rows of the last step (any subset, any order). A finished
  // sequence is ended instead of extended. With speculative decoding, `accepted[i]` of the
  // proposals seqs[i] had verified come before its token, and `drafts[i]` is proposed to follow
  // (both empty: none). Returns the sequences that thereby reached max_model_len and were ended.
  std::vector<int64_t> commit(const std::vector<int64_t>& seqs, const std::vector<int64_t>& tokens,
                              const std::vector<bool>& finished, const std::vector<int64_t>& accepted = {},
                              const std::vector<std::vector<int64_t>>& drafts = {});
  // Replaces generation `seq`'s tokens from position `keep` on with `tokens` (a draft model's
  // sequences follow their target's this way).
  void rewind(int64_t seq, int64_t keep, const std::vector<int64_t>& tokens);
  bool has_unfinished() const;
  EngineStats stats() const;
  int64_t vocab_size() const { return runner_.config().vocab; }
  int64_t hidden_size() const { return runner_.config().hidden; }

 private:
  using Clock = std::chrono::steady_clock;
  void note_busy();  // keeps busy_seconds in step with has_unfinished
  // Token ids as sequences hold them, after the one check of their values: in [0, vocab).
  std::vector<int32_t> admitted(const std::vector<int64_t>& tokens) const;
  // ValueError for an adapter on a runner without LoRA.
  void check_lora(const LoraRef& lora) const;

  // A forward begun and not yet returned: its schedule and its rows' tags.
  struct Launched {
    SchedulerOutput plan;
    std::vector<int64_t> row_seqs, row_positions, sample_rows;
  };
  void launch(SchedulerOutput plan);
  void finish_oldest(EngineStep& result);  // its rows into result

  mutable std::mutex mu_;
  ModelRunner& runner_;
  Scheduler sched_;
  int64_t steps_ = 0, generated_ = 0, computed_ = 0;
  std::deque<Launched> in_flight_;   // oldest first
  std::vector<int64_t> ended_;       // by schedules since the last step returned
  int64_t preempted_ = 0;
  int64_t max_in_flight_ = 0;
  bool busy_ = false;
  Clock::time_point busy_since_{};
  double busy_seconds_ = 0;
};

}  // namespace ferrum
