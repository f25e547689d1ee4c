#include "engine/scheduler.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "core/error.h"

namespace ferrum {

Scheduler::Scheduler(BlockManager& blocks, const SchedulerOptions& opt) : blocks_(blocks), opt_(opt) {
  if (opt.max_num_seqs < 1) throw ValueError("max_num_seqs must be >= 1");
  if (opt.max_num_batched_tokens < 1) throw ValueError("max_num_batched_tokens must be >= 1");
  if (opt.max_model_len < 2) throw ValueError("max_model_len must be >= 2");
}

Sequence& Scheduler::seq(int64_t id) {
  auto it = seqs_.find(id);
  if (it == seqs_.end()) throw ValueError("unknown sequence " + std::to_string(id));
  return it->second;
}

const Sequence& Scheduler::sequence(int64_t id) const {
  auto it = seqs_.find(id);
  if (it == seqs_.end()) throw ValueError("unknown sequence " + std::to_string(id));
  return it->second;
}

namespace {
// Where a kind of sequence keeps its cached blocks (BlockManager::add_sequence): scores and
// embeddings compute alike (f32 activations), generations apart.
// A prompt given as embeddings caches in a domain of its rows' content, a sequence with a LoRA
// adapter in one of the adapter's key and the request's scale of it (both: of the two together;
// never 0 or 1).
int64_t cache_domain(SeqKind kind, const PromptEmbeds& embeds, const LoraAdapter* lora, float lora_scale) {
  const int64_t numerics = kind == SeqKind::Generate ? 0 : 1;
  if (!embeds.rows && !lora) return numerics;
  uint64_t h = embeds.rows ? embeds.content_hash : 0;
  if (lora) {
    uint32_t scale_bits = 0;
    std::memcpy(&scale_bits, &lora_scale, 4);
    h = (h ^ lora->cache_key) * 0x100000001b3ull + 0x9e3779b97f4a7c15ull;
    h = (h ^ scale_bits) * 0x100000001b3ull + 0x9e3779b97f4a7c15ull;
  }
  return int64_t(h & ~uint64_t(3)) | 2 | numerics;
}

void check_lora_scale(float scale) {
  if (!std::isfinite(scale)) throw ValueError("the LoRA scale must be finite, got " + std::to_string(scale));
}

void check_embeds(const PromptEmbeds& embeds, int64_t n) {
  if (embeds.rows && embeds.rows->size() % size_t(n) != 0)
    throw ValueError("prompt embeddings must have one row per prompt position");
}
}  // namespace

int64_t Scheduler::enqueue(Sequence s) {
  s.id = next_id_++;
  const int64_t id = s.id;
  seqs_[id] = std::move(s);
  waiting_.insert(id);
  return id;
}

int64_t Scheduler::add(const std::vector<int32_t>& prompt, int64_t rows_from, PromptEmbeds embeds,
                       std::shared_ptr<const LoraAdapter> lora, float lora_scale) {
  const int64_t n = int64_t(prompt.size());
  if (n == 0) throw ValueError("the prompt is empty (no tokens)");
  if (n >= opt_.max_model_len)
    throw ValueError("the prompt has " + std::to_string(n) + " tokens; max_model_len is " +
                     std::to_string(opt_.max_model_len) + " (room is needed for at least one generated token)");
  if (BlockManager::blocks_for(n + 1) > blocks_.num_blocks())
    throw ValueError("the prompt (" + std::to_string(n) + " tokens) can never fit in the KV cache (" +
                     std::to_string(blocks_.num_blocks() * BlockManager::kBlockSize) + " tokens)");
  if (rows_from > n) throw ValueError("the prompt's first returned row must be in [0, " + std::to_string(n) + "]");
  check_embeds(embeds, n);
  check_lora_scale(lora_scale);
  Sequence s;
  s.cache_domain = cache_domain(SeqKind::Generate, embeds, lora.get(), lora_scale);
  s.embeds = std::move(embeds.rows);
  s.lora = std::move(lora);
  s.lora_scale = lora_scale;
  s.tokens = prompt;
  s.prompt_len = n;
  s.rows_from = rows_from < 0 ? n : rows_from;
  return enqueue(std::move(s));
}

int64_t Scheduler::add_score(const std::vector<int32_t>& tokens, int64_t rows_from, SeqKind kind,
                             PromptEmbeds embeds, std::shared_ptr<const LoraAdapter> lora, float lora_scale) {
  const int64_t n = int64_t(tokens.size());
  if (kind == SeqKind::Generate) throw ValueError("add_score takes a score or an embedding");
  if (n == 0) throw ValueError("nothing to score (no tokens)");
  if (n > opt_.max_model_len)
    throw ValueError(std::to_string(n) + " tokens exceed max_model_len " + std::to_string(opt_.max_model_len));
  if (rows_from < 0 || rows_from >= n)
    throw ValueError("the first returned position must be in [0, " + std::to_string(n) + "), got " +
                     std::to_string(rows_from));
  if (BlockManager::blocks_for(n) > blocks_.num_blocks())
    throw ValueError("a sequence of " + std::to_string(n) + " tokens can never fit in the KV cache (" +
                     std::to_string(blocks_.num_blocks() * BlockManager::kBlockSize) + " tokens)");
  check_embeds(embeds, n);
  check_lora_scale(lora_scale);
  Sequence s;
  s.kind = kind;
  s.cache_domain = cache_domain(kind, embeds, lora.get(), lora_scale);
  s.embeds = std::move(embeds.rows);
  s.lora = std::move(lora);
  s.lora_scale = lora_scale;
  s.tokens = tokens;
  s.prompt_len = n;
  s.rows_from = rows_from;
  return enqueue(std::move(s));
}

void Scheduler::finish(int64_t id) {
  auto it = seqs_.find(id);
  if (it == seqs_.end()) return;
  if (it->second.in_flight) in_flight_--;
  if (it->second.kv >= 0) blocks_.release_sequence(it->second.kv);
  running_.erase(id);
  waiting_.erase(id);
  seqs_.erase(it);
}

int64_t Scheduler::fitting_tokens(const Sequence& s, int64_t want) const {
  const int64_t held = int64_t(blocks_.blocks(s.kv).size());
  const int64_t slots = (held + blocks_.num_free()) * BlockManager::kBlockSize - s.computed;
  return std::max<int64_t>(0, std::min(want, slots));
}

void Scheduler::schedule_chunk(Sequence& s, int64_t count, SchedulerOutput* out, bool decode) {
  blocks_.grow(s.kv, count);
  ScheduledChunk c;
  c.seq = s.id;
  c.kv = s.kv;
  c.kind = s.kind;
  c.start = s.computed;
  c.count = count;
  c.decode = decode;
  c.drafted = std::max<int64_t>(0, c.start + count - s.length());
  const int64_t end = c.start + count - c.drafted;  // of the sequence's own tokens
  c.rows_from = std::min(std::max(c.start, s.rows_from), end);
  c.rows = end - c.rows_from;
  if (s.generates() && end == s.length()) {
    c.sample = true;
    if (c.rows == 0) {  // the row sampled from, when no other row is asked for
      c.rows_from = end - 1;
      c.rows = 1;
    }
    c.rows += c.drafted;  // each proposal's row follows: what the model says after it
  }
  out->chunks.push_back(c);
  out->num_tokens += count;
  s.in_flight = true;
  in_flight_++;
}

bool Scheduler::preempt_younger(int64_t than, SchedulerOutput* out, int64_t* budget) {
  // In this step's chunks, or in no step: not in a forward begun before.
  const auto in_this_step = [&](int64_t id) {
    return std::find_if(out->chunks.begin(), out->chunks.end(), [&](const ScheduledChunk& c) { return c.seq == id; });
  };
  int64_t victim = -1;
  for (auto it = running_.rbegin(); it != running_.rend() && *it > than && victim < 0; ++it)
    if (!seq(*it).in_flight || in_this_step(*it) != out->chunks.end()) victim = *it;
  if (victim < 0) return false;
  Sequence& v = seq(victim);
  // It may already have a chunk in this step: take it back.
  const auto mine = in_this_step(victim);
  if (mine != out->chunks.end()) {
    *budget += mine->count;
    out->num_tokens -= mine->count;
    out->chunks.erase(mine);
    v.in_flight = false;
    in_flight_--;
  }
  blocks_.release_sequence(v.kv);
  v.kv = -1;
  v.computed = 0;
  v.preemptions++;
  running_.erase(victim);
  waiting_.insert(victim);
  out->preempted.push_back(victim);
  preemptions_++;
  return true;
}

bool Scheduler::lora_fits(const Sequence& s, std::vector<const LoraAdapter*>* loras) const {
  if (!s.lora || opt_.max_loras == 0) return true;
  if (std::find(loras->begin(), loras->end(), s.lora.get()) != loras->end()) return true;
  if (int64_t(loras->size()) >= opt_.max_loras) return false;
  loras->push_back(s.lora.get());
  return true;
}

bool Scheduler::try_admit(Sequence& s, int64_t budget, SchedulerOutput* out) {
  // Only positions whose rows are not wanted may come from the cache.
  const int64_t limit = std::min(s.length(), s.rows_from + 1);
  const int64_t domain = s.cache_domain;
  int64_t hit_blocks = 0, hit_free = 0;
  blocks_.probe_prefix(s.tokens, limit, domain, &hit_blocks, &hit_free);
  const int64_t need = BlockManager::blocks_for(s.length() + (s.generates() ? 1 : 0)) - hit_blocks;
  if (need > blocks_.num_free() - hit_free) return false;
  s.kv = blocks_.add_sequence(domain);
  s.computed = blocks_.adopt_prefix(s.kv, s.tokens, limit);
  waiting_.erase(s.id);
  running_.insert(s.id);
  schedule_chunk(s, std::min(s.remaining(), budget), out);
  return true;
}

int64_t Scheduler::prompt_tokens_waiting() const {
  int64_t tokens = 0;
  for (const auto& [id, s] : seqs_)
    if (!s.in_flight && !(s.generates() && s.remaining() <= 1)) tokens += s.remaining();
  return tokens;
}

SchedulerOutput Scheduler::schedule(int64_t max_seqs, int64_t max_tokens) {
  SchedulerOutput out;
  const auto full = [&] { return int64_t(out.chunks.size()) >= max_seqs; };
  int64_t budget = opt_.max_num_batched_tokens;
  std::vector<const LoraAdapter*> loras;  // this step's
  bool hold_admission = false;
  for (const bool decodes : {true, false}) {
    if (!decodes) budget = std::min(budget, std::max<int64_t>(0, max_tokens - out.num_tokens));
    const std::vector<int64_t> order(running_.begin(), running_.end());  // oldest first
    for (int64_t id : order) {
      if (!running_.count(id)) continue;  // preempted earlier in this step
      Sequence& s = seq(id);
      if (s.in_flight) continue;  // in this step already, or in one begun before
      const bool decode = s.generates() && s.remaining() == 1;
      if (s.remaining() == 0 || decode != decodes) continue;  // awaiting a sample, or other pass
      if (budget == 0 || full()) {
        hold_admission = true;
        break;
      }
      if (!lora_fits(s, &loras)) continue;  // its adapter waits for a step with a free slot
      while (fitting_tokens(s, 1) == 0 && preempt_younger(id, &out, &budget)) {
      }
      // A decode verifies its proposals as far as they fit: they never preempt anything.
      const int64_t proposals = decode ? int64_t(s.draft.size()) : 0;
      const int64_t take = fitting_tokens(s, std::min(s.remaining() + proposals, budget));
      if (take > 0) {
        schedule_chunk(s, take, &out, decode);
        budget -= take;
      } else if (id == *running_.begin() && in_flight_ == int64_t(out.chunks.size())) {
        // Oldest, nobody younger left to preempt, none in flight to wait for, and still no
        // block: it fills the pool alone.
        out.ended.push_back(id);
        finish(id);
      } else {
        hold_admission = true;  // an older sequence holds the blocks; wait for them
      }
    }
  }
  if (!out.preempted.empty()) hold_admission = true;
  while (!hold_admission && budget > 0 && !full() && !waiting_.empty() &&
         int64_t(running_.size()) < opt_.max_num_seqs) {
    Sequence& s = seq(*waiting_.begin());
    if (!lora_fits(s, &loras) || !try_admit(s, budget, &out)) break;
    budget -= out.chunks.back().count;
  }
  return out;
}

std::vector<int64_t> Scheduler::computed(const SchedulerOutput& out) {
  std::vector<int64_t> scored;
  for (const ScheduledChunk& c : out.chunks) {
    if (!contains(c.seq)) continue;  // aborted, or ended by a later schedule, while in flight
    Sequence& s = seq(c.seq);
    s.in_flight = false;
    in_flight_--;
    if (s.kv != c.kv || s.computed != c.start)
      throw std::logic_error("Scheduler: sequence " + std::to_string(c.seq) + " lost track of its cache");
    s.computed += c.count - c.drafted;  // proposals count once sampling accepts them
    s.verified = c.drafted;
    blocks_.computed(s.kv, s.tokens.data(), s.computed);
    s.rows_from = std::max(s.rows_from, s.computed);  // returned: never again, even if recomputed
    if (!s.generates() && s.remaining() == 0) {
      scored.push_back(s.id);
      finish(s.id);
    }
  }
  return scored;
}

void Scheduler::not_run(const SchedulerOutput& out) {
  for (const ScheduledChunk& c : out.chunks) {
    auto it = seqs_.find(c.seq);
    if (it == seqs_.end() || !it->second.in_flight) continue;
    it->second.in_flight = false;
    in_flight_--;
  }
}

bool Scheduler::append(int64_t id, int64_t accepted, int32_t token, std::vector<int32_t> draft) {
  Sequence& s = seq(id);
  if (!s.generates() || !running_.count(id) || s.remaining() != 0)
    throw ValueError("sequence " + std::to_string(id) + " is not waiting for a sampled token");
  if (accepted < 0 || accepted > s.verified)
    throw ValueError("sequence " + std::to_string(id) + " had " + std::to_string(s.verified) +
                     " proposals verified; " + std::to_string(accepted) + " cannot be accepted");
  s.tokens.insert(s.tokens.end(), s.draft.begin(), s.draft.begin() + accepted);
  s.computed += accepted;
  blocks_.computed(s.kv, s.tokens.data(), s.computed);
  blocks_.truncate(s.kv, s.computed);  // the rejected proposals' blocks
  s.tokens.push_back(token);
  // Room for the proposals and for the token sampled after them.
  draft.resize(size_t(std::clamp<int64_t>(opt_.max_model_len - 1 - s.length(), 0, int64_t(draft.size()))));
  s.draft = std::move(draft);
  s.verified = 0;
  return s.length() >= opt_.max_model_len;
}

void Scheduler::rewind(int64_t id, int64_t keep, const std::vector<int32_t>& tokens) {
  Sequence& s = seq(id);
  if (!s.generates() || keep < 1 || keep > s.length() || tokens.empty() ||
      keep + int64_t(tokens.size()) > opt_.max_model_len)
    throw ValueError("sequence " + std::to_string(id) + " cannot be rewound to " + std::to_string(keep) +
                     " tokens and " + std::to_string(tokens.size()) + " new ones");
  s.tokens.resize(size_t(keep));
  s.tokens.insert(s.tokens.end(), tokens.begin(), tokens.end());
  s.draft.clear();
  s.verified = 0;
  s.rows_from = s.length();  // only rows sampled from, from here on
  if (s.kv >= 0) s.computed = blocks_.truncate(s.kv, std::min(s.computed, keep));
}

}  // namespace ferrum
