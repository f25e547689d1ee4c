#include "engine/scheduler.h"

#include <algorithm>
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

int64_t Scheduler::add(const std::vector<int32_t>& prompt) {
  const int64_t n = int64_t(prompt.size());
  if (n == 0) throw ValueError("the prompt is empty (no tokens)");
  if (n >= opt_.max_model_len)
    throw ValueError("the prompt has " + std::to_string(n) + " tokens; max_model_len is " +
                     std::to_string(opt_.max_model_len) + " (room is needed for at least one generated token)");
  if (BlockManager::blocks_for(n + 1) > blocks_.num_blocks())
    throw ValueError("the prompt (" + std::to_string(n) + " tokens) can never fit in the KV cache (" +
                     std::to_string(blocks_.num_blocks() * BlockManager::kBlockSize) + " tokens)");
  Sequence s;
  s.id = next_id_++;
  s.tokens = prompt;
  s.prompt_len = n;
  seqs_[s.id] = std::move(s);
  waiting_.insert(next_id_ - 1);
  return next_id_ - 1;
}

void Scheduler::finish(int64_t id) {
  auto it = seqs_.find(id);
  if (it == seqs_.end()) return;
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

void Scheduler::schedule_chunk(Sequence& s, int64_t count, SchedulerOutput* out) {
  blocks_.grow(s.kv, count);
  out->chunks.push_back({s.id, s.kv, s.computed, count, s.computed + count == s.length()});
  out->num_tokens += count;
}

bool Scheduler::preempt_younger(int64_t than, SchedulerOutput* out, int64_t* budget) {
  if (running_.empty() || *running_.rbegin() <= than) return false;
  const int64_t victim = *running_.rbegin();
  Sequence& v = seq(victim);
  // It may already have a chunk in this step: take it back.
  for (auto it = out->chunks.begin(); it != out->chunks.end(); ++it)
    if (it->seq == victim) {
      *budget += it->count;
      out->num_tokens -= it->count;
      out->chunks.erase(it);
      break;
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

bool Scheduler::try_admit(Sequence& s, int64_t budget, SchedulerOutput* out) {
  int64_t hit_blocks = 0, hit_free = 0;
  blocks_.probe_prefix(s.tokens, &hit_blocks, &hit_free);
  const int64_t need = BlockManager::blocks_for(s.length() + 1) - hit_blocks;
  if (need > blocks_.num_free() - hit_free) return false;
  s.kv = blocks_.add_sequence();
  s.computed = blocks_.adopt_prefix(s.kv, s.tokens);
  waiting_.erase(s.id);
  running_.insert(s.id);
  schedule_chunk(s, std::min(s.remaining(), budget), out);
  return true;
}

SchedulerOutput Scheduler::schedule() {
  SchedulerOutput out;
  int64_t budget = opt_.max_num_batched_tokens;
  bool hold_admission = false;
  for (const bool decodes : {true, false}) {
    const std::vector<int64_t> order(running_.begin(), running_.end());  // oldest first
    for (int64_t id : order) {
      if (!running_.count(id)) continue;  // preempted earlier in this step
      Sequence& s = seq(id);
      if (s.remaining() == 0 || (s.remaining() == 1) != decodes) continue;  // awaiting a sample, or other pass
      if (budget == 0) {
        hold_admission = true;
        break;
      }
      while (fitting_tokens(s, 1) == 0 && preempt_younger(id, &out, &budget)) {
      }
      const int64_t take = fitting_tokens(s, std::min(s.remaining(), budget));
      if (take > 0) {
        schedule_chunk(s, take, &out);
        budget -= take;
      } else if (id == *running_.begin()) {
        // Oldest, nobody younger left to preempt, and still no block: it fills the pool alone.
        out.ended.push_back(id);
        finish(id);
      } else {
        hold_admission = true;  // an older sequence holds the blocks; wait for them
      }
    }
  }
  if (!out.preempted.empty()) hold_admission = true;
  while (!hold_admission && budget > 0 && !waiting_.empty() && int64_t(running_.size()) < opt_.max_num_seqs) {
    Sequence& s = seq(*waiting_.begin());
    if (!try_admit(s, budget, &out)) break;
    budget -= out.chunks.back().count;
  }
  return out;
}

void Scheduler::computed(const SchedulerOutput& out) {
  for (const ScheduledChunk& c : out.chunks) {
    Sequence& s = seq(c.seq);
    s.computed += c.count;
    if (s.kv != c.kv || blocks_.length(s.kv) != s.computed)
      throw std::logic_error("Scheduler: sequence " + std::to_string(c.seq) + " lost track of its cache");
  }
}

bool Scheduler::append_token(int64_t id, int32_t token) {
  Sequence& s = seq(id);
  if (!running_.count(id) || s.remaining() != 0)
    throw ValueError("sequence " + std::to_string(id) + " is not waiting for a sampled token");
  s.tokens.push_back(token);
  return s.length() >= opt_.max_model_len;
}

}  // namespace ferrum
