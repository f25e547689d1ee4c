// One sequence the engine computes, and the one owner of its tokens: the prompt (then, for a
// generation, each sampled token), how many of them have K/V in the cache, and which
// BlockManager sequence holds those blocks while it runs.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "model/lora.h"

namespace ferrum {

// What a sequence is computed for; this, not what shares its steps, decides its numerics.
enum class SeqKind : uint8_t {
  Generate,  // sampled token by token; its matmuls may quantize activations to 8 bits
  Score,     // teacher-forced over known tokens: logits rows, f32 activations (scores agree
             // with a float reference)
  Embed,     // like a score, but its rows are the final hidden states (after the final norm)
};

struct Sequence {
  int64_t id = 0;                // engine-wide, increasing: a smaller id arrived earlier
  SeqKind kind = SeqKind::Generate;
  std::vector<int32_t> tokens;   // prompt + generated (a score or embedding: every token it feeds)
  int64_t prompt_len = 0;
  // A prompt given as embeddings: f32 [prompt_len, hidden] rows that positions [0, prompt_len)
  // feed instead of their tokens (placeholders, 0); generated tokens feed their ids as usual.
  // Its cached blocks are keyed by the rows' content (cache_domain), so only the same rows share them.
  std::shared_ptr<const std::vector<float>> embeds;
  // The LoRA adapter it runs with (null: the base model) and the request's scale of its updates;
  // its blocks cache under the adapter's key and the scale.
  std::shared_ptr<const LoraAdapter> lora;
  float lora_scale = 1.0f;
  int64_t cache_domain = 0;
  int64_t computed = 0;          // leading tokens whose K/V are in the cache
  // First position whose row is still to be returned. A generation returns rows from there (its
  // prompt's logits, when asked for) besides the row it samples from; each row comes out once.
  int64_t rows_from = 0;
  int64_t kv = -1;               // BlockManager sequence while it holds blocks, else -1
  bool in_flight = false;        // in a forward whose rows are not back yet (pipeline stages)
  int64_t preemptions = 0;
  // Speculative decoding: tokens proposed to follow a generation's last token, verified by the
  // step that computes it; `verified` of them have K/V written after the computed tokens since,
  // waiting for sampling to accept some (Scheduler::append).
  std::vector<int32_t> draft;
  int64_t verified = 0;

  bool generates() const { return kind == SeqKind::Generate; }
  int64_t length() const { return int64_t(tokens.size()); }
  int64_t generated() const { return length() - prompt_len; }
  // Tokens still to compute: before the next sample (1 for a decode), or before a score is done.
  int64_t remaining() const { return length() - computed; }
};

}  // namespace ferrum
