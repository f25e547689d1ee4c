#include "engine/engine.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <memory>
#include <string>

#include "core/error.h"

namespace ferrum {

namespace {
// With pipeline stages, a forward takes at most 1 / (this x stages) of the prompt tokens waiting,
// and at least kMinPipelineForward tokens (the runner pads a forward's tokens to multiples of it).
constexpr int64_t kPipelinePromptForwards = 8;
constexpr int64_t kMinPipelineForward = 32;

SchedulerOptions scheduler_options(const ModelRunner& runner, const EngineOptions& opt) {
  SchedulerOptions s;
  s.max_num_seqs = opt.max_num_seqs;
  s.max_num_batched_tokens = opt.max_num_batched_tokens;
  s.max_model_len = runner.max_model_len();
  s.max_loras = runner.max_loras();
  return s;
}
}  // namespace

Engine::Engine(ModelRunner& runner, const EngineOptions& opt)
    : runner_(runner), sched_(runner.blocks(), scheduler_options(runner, opt)) {}

void Engine::note_busy() {
  const bool busy = sched_.has_unfinished();
  if (busy == busy_) return;
  const Clock::time_point now = Clock::now();
  if (busy) busy_since_ = now;
  else busy_seconds_ += std::chrono::duration<double>(now - busy_since_).count();
  busy_ = busy;
}

std::vector<int32_t> Engine::admitted(const std::vector<int64_t>& tokens) const {
  const int64_t vocab = runner_.config().vocab;
  for (int64_t t : tokens)
    if (t < 0 || t >= vocab)
      throw ValueError("token id " + std::to_string(t) + " is out of range [0, " + std::to_string(vocab) + ")");
  return std::vector<int32_t>(tokens.begin(), tokens.end());
}

void Engine::check_lora(const LoraRef& lora) const {
  if (lora && runner_.max_loras() == 0) throw ValueError("a LoRA adapter needs a model loaded with enable_lora");
}

int64_t Engine::add_sequence(const std::vector<int64_t>& prompt, int64_t rows_from, LoraRef lora, float lora_scale) {
  const std::vector<int32_t> tokens = admitted(prompt);
  check_lora(lora);
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t id = sched_.add(tokens, rows_from, {}, std::move(lora), lora_scale);
  note_busy();
  return id;
}

int64_t Engine::add_score(const std::vector<int64_t>& tokens, int64_t rows_from, SeqKind kind, LoraRef lora,
                          float lora_scale) {
  const std::vector<int32_t> admitted_tokens = admitted(tokens);
  check_lora(lora);
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t id = sched_.add_score(admitted_tokens, rows_from, kind, {}, std::move(lora), lora_scale);
  note_busy();
  return id;
}

namespace {
uint64_t fnv1a(const void* data, size_t bytes) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < bytes; ++i) h = (h ^ static_cast<const unsigned char*>(data)[i]) * 0x100000001b3ull;
  return h;
}
}  // namespace

int64_t Engine::add_prompt_embeds(std::vector<float> rows, SeqKind kind, int64_t rows_from, LoraRef lora,
                                  float lora_scale) {
  check_lora(lora);
  const int64_t hidden = runner_.config().hidden;
  if (rows.empty() || rows.size() % size_t(hidden) != 0)
    throw ValueError("prompt embeddings must be a non-empty [tokens, " + std::to_string(hidden) + "] array");
  for (float v : rows)
    if (!std::isfinite(v)) throw ValueError("prompt embeddings must be finite (found " + std::to_string(v) + ")");
  const int64_t n = int64_t(rows.size()) / hidden;
  PromptEmbeds embeds;
  embeds.content_hash = fnv1a(rows.data(), rows.size() * sizeof(float));
  embeds.rows = std::make_shared<const std::vector<float>>(std::move(rows));
  const std::vector<int32_t> placeholders(size_t(n), 0);
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t id = kind == SeqKind::Generate
                         ? sched_.add(placeholders, rows_from, std::move(embeds), std::move(lora), lora_scale)
                         : sched_.add_score(placeholders, rows_from, kind, std::move(embeds), std::move(lora),
                                            lora_scale);
  note_busy();
  return id;
}

void Engine::abort(int64_t seq) {
  std::lock_guard<std::mutex> lock(mu_);
  sched_.finish(seq);
  note_busy();
}

EngineStep Engine::step() {
  std::lock_guard<std::mutex> lock(mu_);
  // With pipeline stages, one forward per stage is kept in flight, each on its share of the
  // sequences (those in flight are not scheduled again until their rows are back), so that every
  // stage computes one of them at a time. Prompts pass in forwards of a small share of the prompt
  // tokens waiting: the later stages idle through the first stage's first forward, and the first
  // stage through the last stage's last prompt forward.
  const int64_t depth = runner_.pipeline_depth();
  while (int64_t(in_flight_.size()) < depth) {
    int64_t share = INT64_MAX, tokens = INT64_MAX;
    if (depth > 1) {
      share = (sched_.num_sequences() + depth - 1) / depth;
      tokens = std::max(kMinPipelineForward, sched_.prompt_tokens_waiting() / (kPipelinePromptForwards * depth));
    }
    SchedulerOutput plan = sched_.schedule(share, tokens);
    ended_.insert(ended_.end(), plan.ended.begin(), plan.ended.end());
    preempted_ += int64_t(plan.preempted.size());
    if (plan.chunks.empty()) break;
    launch(std::move(plan));
  }
  EngineStep result;
  result.ended = std::move(ended_);
  ended_.clear();
  result.num_preempted = preempted_;
  preempted_ = 0;
  if (!in_flight_.empty()) finish_oldest(result);
  note_busy();
  return result;
}

void Engine::launch(SchedulerOutput plan) {
  // In kind order (generations, scores, embeddings): the runner computes each group with its
  // own numerics, and returns logits rows before hidden-state rows.
  std::stable_sort(plan.chunks.begin(), plan.chunks.end(),
                   [](const ScheduledChunk& a, const ScheduledChunk& b) { return a.kind < b.kind; });
  Launched l;
  std::vector<ForwardItem> items;
  items.reserve(plan.chunks.size());
  std::vector<std::vector<int32_t>> verify_tokens(plan.chunks.size());  // a last token + its proposals
  for (size_t i = 0; i < plan.chunks.size(); ++i) {
    const ScheduledChunk& c = plan.chunks[i];
    const Sequence& s = sched_.sequence(c.seq);
    ForwardItem f;
    f.kv = c.kv;
    f.tokens = s.tokens.data() + c.start;
    if (c.drafted > 0) {  // the sequence's last token, then the proposals it verifies
      std::vector<int32_t>& v = verify_tokens[i];
      v.assign(s.tokens.begin() + c.start, s.tokens.end());
      v.insert(v.end(), s.draft.begin(), s.draft.begin() + c.drafted);
      f.tokens = v.data();
    }
    if (s.embeds) {
      f.embeds = s.embeds->data();
      f.embeds_len = s.prompt_len;
    }
    f.lora = s.lora;
    f.lora_scale = s.lora_scale;
    f.kind = c.kind;
    f.decode = c.decode;
    f.start = c.start;
    f.count = c.count;
    f.rows_from = c.rows_from;
    f.rows = c.rows;
    items.push_back(f);
    const int64_t first_row = int64_t(l.row_seqs.size());
    for (int64_t p = c.rows_from; p < c.rows_from + c.rows; ++p) {
      l.row_seqs.push_back(c.seq);
      l.row_positions.push_back(p);
    }
    // The last token's row; the proposals' rows follow it.
    if (c.sample) l.sample_rows.push_back(first_row + c.rows - c.drafted - 1);
  }
  try {
    runner_.begin(items);
  } catch (...) {
    sched_.not_run(plan);
    throw;
  }
  l.plan = std::move(plan);
  in_flight_.push_back(std::move(l));
  max_in_flight_ = std::max(max_in_flight_, int64_t(in_flight_.size()));
}

void Engine::finish_oldest(EngineStep& result) {
  Launched l = std::move(in_flight_.front());
  in_flight_.pop_front();
  ForwardOutput rows = runner_.end();
  result.row_seqs = std::move(l.row_seqs);
  result.row_positions = std::move(l.row_positions);
  result.sample_rows = std::move(l.sample_rows);
  result.logits = std::move(rows.logits);
  result.hidden = std::move(rows.hidden);
  result.scored = sched_.computed(l.plan);
  result.num_tokens = l.plan.num_tokens;
  computed_ += l.plan.num_tokens;
  steps_++;
}

std::vector<int64_t> Engine::commit(const std::vector<int64_t>& seqs, const std::vector<int64_t>& sampled,
                                    const std::vector<bool>& finished, const std::vector<int64_t>& accepted,
                                    const std::vector<std::vector<int64_t>>& drafts) {
  if (seqs.size() != sampled.size() || seqs.size() != finished.size())
    throw ValueError("commit needs one token and one finished flag per sequence");
  if ((!accepted.empty() && accepted.size() != seqs.size()) || (!drafts.empty() && drafts.size() != seqs.size()))
    throw ValueError("commit needs an accepted count and a draft per sequence, or none");
  const std::vector<int32_t> tokens = admitted(sampled);
  std::vector<std::vector<int32_t>> proposals(drafts.size());
  for (size_t i = 0; i < drafts.size(); ++i) proposals[i] = admitted(drafts[i]);
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int64_t> ended;
  for (size_t i = 0; i < seqs.size(); ++i) {
    if (!sched_.contains(seqs[i])) continue;  // aborted since the step
    const int64_t took = accepted.empty() ? 0 : accepted[i];
    generated_ += 1 + took;
    if (finished[i]) {
      sched_.finish(seqs[i]);
    } else if (sched_.append(seqs[i], took, tokens[i],
                             drafts.empty() ? std::vector<int32_t>{} : std::move(proposals[i]))) {
      sched_.finish(seqs[i]);
      ended.push_back(seqs[i]);
    }
  }
  note_busy();
  return ended;
}

void Engine::rewind(int64_t seq, int64_t keep, const std::vector<int64_t>& tokens) {
  const std::vector<int32_t> admitted_tokens = admitted(tokens);
  std::lock_guard<std::mutex> lock(mu_);
  sched_.rewind(seq, keep, admitted_tokens);
}

bool Engine::has_unfinished() const {
  std::lock_guard<std::mutex> lock(mu_);
  return sched_.has_unfinished() || !in_flight_.empty();
}

EngineStats Engine::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  EngineStats s;
  s.running = int64_t(sched_.running().size());
  s.waiting = int64_t(sched_.waiting().size());
  s.preemptions = sched_.num_preemptions();
  s.steps = steps_;
  s.generated_tokens = generated_;
  s.computed_tokens = computed_;
  s.max_in_flight = max_in_flight_;
  s.busy_seconds = busy_seconds_ + (busy_ ? std::chrono::duration<double>(Clock::now() - busy_since_).count() : 0.0);
  return s;
}

}  // namespace ferrum
