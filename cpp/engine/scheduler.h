// Continuous batching: decides, step by step, which tokens of which sequences go into the next
// varlen forward. Generations, scores and embeddings are kinds of the same sequences: a score or
// an embedding feeds known tokens, returns rows (logits, or hidden states) at the positions it
// asks for, then ends by itself.
//
// Per step, within max_num_batched_tokens tokens and max_num_seqs running sequences:
//   1. running generations with one token left (decodes), oldest first;
//   2. running sequences mid-prompt (or mid-score), oldest first, a chunk each (chunked prefill);
//   3. waiting sequences, oldest first: adopt their cached prefix, then a first chunk.
// Blocks are taken as chunks are scheduled. A running sequence that cannot get a block takes
// them from the youngest running sequence younger than itself, which is preempted (blocks
// freed, recomputed later from its tokens); so the oldest always progresses, and the oldest
// alone filling the pool ends ("length") instead of waiting forever. Admission needs blocks
// for the whole sequence (plus one generated token for a generation), and is held in any step
// that had to preempt or defer, so new work does not push out running work.
#pragma once
#include <climits>
#include <cstdint>
#include <map>
#include <set>
#include <vector>

#include "engine/block_manager.h"
#include "engine/sequence.h"

namespace ferrum {

// A prompt given as embeddings (Sequence::embeds): its rows, and the hash of their content that
// keys its cached blocks. Empty: a prompt of token ids.
struct PromptEmbeds {
  std::shared_ptr<const std::vector<float>> rows;
  uint64_t content_hash = 0;
};

struct SchedulerOptions {
  int64_t max_num_seqs = 32;
  int64_t max_num_batched_tokens = 512;
  int64_t max_model_len = 0;  // a sequence ends ("length") when it holds this many tokens
  // At most this many different LoRA adapters in one step (0: no limit); sequences on others wait.
  int64_t max_loras = 0;
};

// One sequence's share of a step: tokens [start, start + count) of its tokens, and the rows
// the step returns for it: those at positions [rows_from, rows_from + rows).
struct ScheduledChunk {
  int64_t seq = 0;    // Sequence id
  int64_t kv = 0;     // its BlockManager sequence
  SeqKind kind = SeqKind::Generate;
  int64_t start = 0, count = 0;
  int64_t rows_from = 0, rows = 0;
  bool sample = false;  // a generation reaching its last token: that token's row is sampled from
  bool decode = false;  // a generation's next token (and proposals): nothing else of it is new
  int64_t drafted = 0;  // of `count`, proposed tokens after the last, verified by their rows
};

struct SchedulerOutput {
  std::vector<ScheduledChunk> chunks;  // in order: decodes, prompt / score chunks, admissions
  std::vector<int64_t> ended;          // sequences that filled the KV pool alone; now finished
  std::vector<int64_t> preempted;
  int64_t num_tokens = 0;
};

class Scheduler {
 public:
  Scheduler(BlockManager& blocks, const SchedulerOptions& opt);

  // Queues a generation; ValueError when it could never run (empty, too long, too big for the
  // pool). Rows of its prompt's positions rows_from .. come out too (prompt logprobs); the
  // default, the prompt's length, asks for none.
  // lora: the adapter it runs with (null: the base model), lora_scale the request's scale of it
  // (finite; ValueError otherwise).
  int64_t add(const std::vector<int32_t>& prompt, int64_t rows_from = -1, PromptEmbeds embeds = {},
              std::shared_ptr<const LoraAdapter> lora = nullptr, float lora_scale = 1.0f);
  // Queues a score (or an embedding) of `tokens` returning its rows at positions rows_from ..
  // end; ValueError when it could never run.
  int64_t add_score(const std::vector<int32_t>& tokens, int64_t rows_from, SeqKind kind = SeqKind::Score,
                    PromptEmbeds embeds = {}, std::shared_ptr<const LoraAdapter> lora = nullptr,
                    float lora_scale = 1.0f);
  // Ends a sequence (finished or aborted) and frees its blocks; full blocks stay in the prefix
  // cache. Unknown ids are ignored, so aborting twice is harmless.
  void finish(int64_t seq);

  // The next step, of at most max_seqs sequences and max_tokens tokens (decodes exceed it rather
  // than wait: it limits the prompt and score chunks). Its sequences are in flight until
  // computed(): no later step takes them (and none preempts them) before, so several steps may be
  // in flight.
  SchedulerOutput schedule(int64_t max_seqs = INT64_MAX, int64_t max_tokens = INT64_MAX);
  // Prompt (and score) tokens still to compute in sequences not in flight.
  int64_t prompt_tokens_waiting() const;
  // The forward of `out` ran: every chunk's tokens now have K/V in the cache (chunks of sequences
  // ended meanwhile are passed over). Returns the scores and embeddings whose last rows it
  // computed: they are finished.
  std::vector<int64_t> computed(const SchedulerOutput& out);
  // The forward of `out` did not run (it threw): its sequences are no longer in flight, and the
  // next schedule takes them again (their blocks are kept).
  void not_run(const SchedulerOutput& out);
  // Appends a token sampled for generation `seq` (which must be waiting for one); true when the
  // sequence now holds max_model_len tokens and has to end.
  bool append_token(int64_t seq, int32_t token) { return append(seq, 0, token, {}); }
  // What sampling decided after a step computed generation `seq`'s last token: the first
  // `accepted` of the proposals it verified (their K/V are already in the cache) and `token`
  // after them; `draft` is proposed to follow (verified by the next step, as far as the budget,
  // the pool and max_model_len allow). Blocks taken for rejected proposals are released. True
  // when the sequence now holds max_model_len tokens and has to end.
  bool append(int64_t seq, int64_t accepted, int32_t token, std::vector<int32_t> draft);
  // Replaces generation `seq`'s tokens from position `keep` on with `tokens` (a draft model's
  // sequence following what its target accepted): K/V beyond keep are dropped.
  void rewind(int64_t seq, int64_t keep, const std::vector<int32_t>& tokens);

  bool contains(int64_t seq) const { return seqs_.count(seq) != 0; }
  const Sequence& sequence(int64_t seq) const;
  const std::set<int64_t>& running() const { return running_; }
  const std::set<int64_t>& waiting() const { return waiting_; }
  bool has_unfinished() const { return !seqs_.empty(); }
  int64_t num_sequences() const { return int64_t(seqs_.size()); }
  int64_t num_preemptions() const { return preemptions_; }
  const SchedulerOptions& options() const { return opt_; }

 private:
  Sequence& seq(int64_t id);
  int64_t enqueue(Sequence s);
  // Most of `want` next tokens of s whose blocks fit in what is free now.
  int64_t fitting_tokens(const Sequence& s, int64_t want) const;
  void schedule_chunk(Sequence& s, int64_t count, SchedulerOutput* out, bool decode = false);
  // Preempts the youngest running sequence younger than `than` and not in flight; false when
  // there is none.
  bool preempt_younger(int64_t than, SchedulerOutput* out, int64_t* budget);
  bool try_admit(Sequence& s, int64_t budget, SchedulerOutput* out);
  // Whether s's adapter may join this step's (`loras`, which it then joins): within max_loras.
  bool lora_fits(const Sequence& s, std::vector<const LoraAdapter*>* loras) const;

  BlockManager& blocks_;
  SchedulerOptions opt_;
  std::map<int64_t, Sequence> seqs_;  // every unfinished sequence
  std::set<int64_t> running_;         // hold blocks; ids ascend with age, oldest first
  std::set<int64_t> waiting_;         // no blocks: new, or preempted (then older than any new)
  int64_t next_id_ = 1;
  int64_t preemptions_ = 0;
  int64_t in_flight_ = 0;             // sequences in flight
};

}  // namespace ferrum
