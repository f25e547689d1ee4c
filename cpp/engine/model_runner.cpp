#include "engine/model_runner.h"

#include <algorithm>

#include "core/error.h"
#include "model/rope.h"

namespace ferrum {

namespace {
constexpr size_t kMaxGraphs = 8;

// Token rows are padded up to a bucket so prefills of similar length share a recorded stream.
int64_t token_bucket(int64_t t) { return t <= 32 ? t : (t + 31) / 32 * 32; }
}  // namespace

ModelRunner::ModelRunner(const std::string& path, const RunnerOptions& opt) : ModelRunner(open_model_file(path), opt) {}

ModelRunner::ModelRunner(ModelFile file, const RunnerOptions& opt) {
  if (!(opt.kv_cache_fraction >= 0 && opt.kv_cache_fraction <= 1))
    throw ValueError("kv_cache_fraction must be in (0, 1]");
  if (opt.kv_cache_tokens < 0 || opt.kv_cache_bytes < 0) throw ValueError("KV cache sizes must be positive");
  if (opt.kv_dtype != DType::F16 && opt.kv_dtype != DType::F32 && opt.kv_dtype != DType::I8)
    throw ValueError("kv_dtype must be f16, f32 or int8");
  file.tokenizer_metadata.clear();  // the tokenizer's arrays (~15 MB parsed) would add to the load's peak memory
  const ModelConfig& cfg = file.config;
  format_ = file.format;
  max_model_len_ = opt.max_model_len > 0 ? opt.max_model_len : cfg.max_positions;
  if (max_model_len_ > cfg.max_positions)
    throw ValueError("max_model_len " + std::to_string(max_model_len_) + " exceeds the model's " +
                     std::to_string(cfg.max_positions) + " positions");
  be_ = make_backend(opt.device, opt.num_threads);
  ModelWeights w = load_weights(*be_, file.weights, cfg, opt.load_progress);

  // KV pool: [blocks, kv_heads, 16, head_dim] per layer for K and V, checked against the memory
  // the backend has left before any of it is allocated.
  const int64_t row = cfg.kv_heads * cfg.head_dim;
  const double elem = opt.kv_dtype == DType::F32 ? 4.0 : opt.kv_dtype == DType::F16 ? 2.0 : 1.0 + 4.0 / double(cfg.head_dim);
  const double bytes_per_token = 2.0 * double(cfg.layers * row) * elem;
  const double available = double(be_->memory_available_bytes());
  const double bytes = opt.kv_cache_fraction > 0 ? opt.kv_cache_fraction * available : double(opt.kv_cache_bytes);
  int64_t tokens = opt.kv_cache_tokens > 0 ? opt.kv_cache_tokens : int64_t(std::min(bytes / bytes_per_token, 1e15));
  if (opt.kv_cache_tokens <= 0) tokens = std::max(tokens, std::min<int64_t>(max_model_len_, 4096));
  int64_t blocks = std::max<int64_t>(1, BlockManager::blocks_for(tokens));
  if (blocks > INT32_MAX / kBlockSize) throw ValueError("kv cache too large");
  const double pool_bytes = double(blocks * kBlockSize) * bytes_per_token;
  if (pool_bytes > available)
    throw ResourceError("cannot allocate a KV cache of " + std::to_string(blocks * kBlockSize) + " tokens: it needs " +
                        std::to_string(int64_t(pool_bytes)) + " bytes, the " + be_->name() + " device has " +
                        std::to_string(int64_t(available)) + " available (lower kv_cache_memory or kv_cache_tokens)");
  // No sequence outgrows the pool: tables indexed by position or block stop there.
  const int64_t positions = std::min(max_model_len_, blocks * kBlockSize);
  max_blocks_ = BlockManager::blocks_for(positions);
  RopeTable rope = make_rope_table(*be_, cfg, positions, w.rope_freq_factors);
  for (int64_t l = 0; l < cfg.layers; ++l) {
    KvLayer kv;
    Shape shape{blocks, cfg.kv_heads, kBlockSize, cfg.head_dim};
    kv.k = be_->alloc(opt.kv_dtype, shape);
    kv.v = be_->alloc(opt.kv_dtype, shape);
    if (opt.kv_dtype == DType::I8) {
      kv.k_scale = be_->alloc(DType::F32, {blocks, cfg.kv_heads, kBlockSize});
      kv.v_scale = be_->alloc(DType::F32, {blocks, cfg.kv_heads, kBlockSize});
    }
    for (const Tensor* t : {&kv.k, &kv.v, &kv.k_scale, &kv.v_scale})
      if (t->defined()) be_->materialize(*t);
    kv_.push_back(kv);
  }
  blocks_ = std::make_unique<BlockManager>(blocks, opt.prefix_cache);
  decoder_ = std::make_unique<Decoder>(be_, cfg, std::move(w), rope);
  stats_.block_size = kBlockSize;
}

ModelRunner::Graph& ModelRunner::graph_for(int64_t T, int64_t S, int64_t R, const StepRows& split) {
  std::string key = std::to_string(T) + "," + std::to_string(S) + "," + std::to_string(R) + "," +
                    std::to_string(split.gen_tokens) + "," + std::to_string(split.gen_rows) + "," +
                    std::to_string(int(split.decodes)) + "," + std::to_string(split.logit_rows);
  for (auto it = graphs_.begin(); it != graphs_.end(); ++it)
    if (it->first == key) {
      graphs_.splice(graphs_.begin(), graphs_, it);
      stats_.replays++;
      return graphs_.front().second;
    }
  Graph g;
  g.buffers = decoder_->alloc_step(T, S, R, max_blocks_, split);
  g.stream = be_->new_stream();
  decoder_->record(*g.stream, g.buffers, kv_);
  graphs_.emplace_front(key, std::move(g));
  if (graphs_.size() > kMaxGraphs) graphs_.pop_back();
  return graphs_.front().second;
}

ForwardOutput ModelRunner::forward(const std::vector<ForwardItem>& items) {
  const BlockManager& bm = *blocks_;
  if (items.empty()) throw ValueError("a forward needs at least one item");
  int64_t T = 0, R = 0, G = 0, Rg = 0, L = 0;
  bool decodes = true;
  for (size_t i = 0; i < items.size(); ++i) {
    const ForwardItem& it = items[i];
    if (i > 0 && it.kind < items[i - 1].kind)
      throw std::logic_error("ModelRunner::forward: items out of kind order");
    T += it.count;
    R += it.rows;
    if (it.kind != SeqKind::Embed) L += it.rows;
    if (it.kind != SeqKind::Generate) continue;
    G += it.count;
    Rg += it.rows;
    decodes = decodes && it.decode;
  }
  const int64_t Tb = token_bucket(T), S = int64_t(items.size()), Rb = std::max<int64_t>(R, 1);
  // Padding rows join the last group: with generations alone, the generation group.
  const StepRows split = G == T ? StepRows{Tb, Rb, decodes, Rb} : StepRows{G, Rg, G > 0 && decodes, L};

  h_ids_.assign(size_t(Tb), 0);
  h_seq_.assign(size_t(Tb), 0);
  h_pos_.assign(size_t(Tb), -1);  // padding rows: no position, no slot
  h_slot_.assign(size_t(Tb), -1);
  h_tables_.assign(size_t(S * max_blocks_), -1);
  h_rows_.assign(size_t(Rb), 0);
  int64_t t = 0, r = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    const ForwardItem& it = items[i];
    const std::vector<int32_t>& blocks = bm.blocks(it.kv);
    if (BlockManager::blocks_for(it.start + it.count) > int64_t(blocks.size()) || it.rows < 0 ||
        it.rows_from < it.start || it.rows_from + it.rows > it.start + it.count)
      throw std::logic_error("ModelRunner::forward: an item outside its blocks or tokens");
    std::copy(blocks.begin(), blocks.end(), h_tables_.begin() + int64_t(i) * max_blocks_);
    for (int64_t j = 0; j < it.count; ++j, ++t) {
      const int64_t pos = it.start + j;
      h_ids_[size_t(t)] = it.tokens[j];
      h_seq_[size_t(t)] = int32_t(i);
      h_pos_[size_t(t)] = int32_t(pos);
      h_slot_[size_t(t)] = blocks[size_t(pos / kBlockSize)] * int32_t(kBlockSize) + int32_t(pos % kBlockSize);
      if (pos >= it.rows_from && pos < it.rows_from + it.rows) h_rows_[size_t(r++)] = int32_t(t);
    }
  }

  Graph& g = replay_ ? graph_for(Tb, S, Rb, split) : (graphs_.clear(), graph_for(Tb, S, Rb, split));
  const StepBuffers& b = g.buffers;
  be_->upload(b.ids, h_ids_.data(), h_ids_.size() * 4);
  be_->upload(b.batch.token_seq, h_seq_.data(), h_seq_.size() * 4);
  be_->upload(b.batch.token_pos, h_pos_.data(), h_pos_.size() * 4);
  be_->upload(b.batch.slot_mapping, h_slot_.data(), h_slot_.size() * 4);
  be_->upload(b.batch.block_tables, h_tables_.data(), h_tables_.size() * 4);
  be_->upload(b.logit_rows, h_rows_.data(), h_rows_.size() * 4);
  g.stream->submit();
  g.stream->sync();
  ForwardOutput out;
  out.logits.resize(size_t(L * config().vocab));
  if (L > 0) be_->download(b.logits, out.logits.data(), out.logits.size() * 4);
  if (R > L) {
    out.hidden.resize(size_t((R - L) * config().hidden));
    be_->download(b.h_rows.slice(L, R - L), out.hidden.data(), out.hidden.size() * 4);
  }
  stats_.steps++;
  return out;
}

std::vector<float> ModelRunner::step(const std::vector<StepItem>& items, int64_t* rows_out) {
  const ModelConfig& c = config();
  BlockManager& bm = *blocks_;
  if (items.empty()) throw ValueError("step needs at least one item");
  // Validate everything before touching any state.
  int64_t new_blocks = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    const StepItem& it = items[i];
    const int64_t start = bm.length(it.seq);  // throws for an unknown sequence
    for (size_t j = 0; j < i; ++j)
      if (items[j].seq == it.seq) throw ValueError("sequence " + std::to_string(it.seq) + " appears twice in one step");
    if (it.tokens.empty()) throw ValueError("a step item needs at least one token");
    for (int32_t t : it.tokens)
      if (t < 0 || t >= c.vocab)
        throw ValueError("token id " + std::to_string(t) + " is out of range [0, " + std::to_string(c.vocab) + ")");
    const int64_t len = start + int64_t(it.tokens.size());
    if (len > max_model_len_)
      throw ValueError("sequence would hold " + std::to_string(len) + " tokens, more than max_model_len " +
                       std::to_string(max_model_len_));
    new_blocks += bm.blocks_needed(it.seq, int64_t(it.tokens.size()));
  }
  if (new_blocks > bm.num_free())
    throw ResourceError("KV cache exhausted: this step needs " + std::to_string(new_blocks) + " more blocks, " +
                        std::to_string(bm.num_free()) + " of " + std::to_string(bm.num_blocks()) + " are free");

  // Generation items first, as forward() takes them; rows come back in the caller's order.
  std::vector<ForwardItem> fwd;
  std::vector<size_t> order;
  for (const bool scoring : {false, true})
    for (size_t i = 0; i < items.size(); ++i) {
      const StepItem& it = items[i];
      if ((it.logits == StepItem::Logits::All) != scoring) continue;
      bm.grow(it.seq, int64_t(it.tokens.size()));
      ForwardItem f;
      f.kv = it.seq;
      f.tokens = it.tokens.data();
      f.kind = scoring ? SeqKind::Score : SeqKind::Generate;
      f.start = bm.length(it.seq);
      f.count = int64_t(it.tokens.size());
      f.rows = scoring ? f.count : it.logits == StepItem::Logits::Last ? 1 : 0;
      f.rows_from = f.start + f.count - f.rows;
      f.decode = !scoring && f.count == 1 && f.rows == 1;
      fwd.push_back(f);
      order.push_back(i);
    }
  const std::vector<float> logits = forward(fwd).logits;
  for (const ForwardItem& f : fwd) bm.computed(f.kv, nullptr, f.start + f.count);

  // Rows of each item, back in the order the items were given.
  std::vector<int64_t> first_row(items.size()), row_count(items.size());
  int64_t R = 0;
  for (size_t k = 0; k < fwd.size(); ++k) {
    first_row[order[k]] = R;
    row_count[order[k]] = fwd[k].rows;
    R += fwd[k].rows;
  }
  *rows_out = R;
  const int64_t vocab = c.vocab;
  std::vector<float> out(logits.size());
  auto dst = out.begin();
  for (size_t i = 0; i < items.size(); ++i)
    dst = std::copy_n(logits.begin() + first_row[i] * vocab, row_count[i] * vocab, dst);
  return out;
}

RunnerStats ModelRunner::stats() const {
  RunnerStats s = stats_;
  s.kv_blocks_total = blocks_->num_blocks();
  s.kv_blocks_used = blocks_->num_used();
  s.kv_blocks_cached = blocks_->num_cached();
  s.sequences = blocks_->num_sequences();
  s.prefix_queries = blocks_->prefix_stats().queries;
  s.prefix_hit_tokens = blocks_->prefix_stats().hit_tokens;
  s.prefix_query_tokens = blocks_->prefix_stats().query_tokens;
  return s;
}

}  // namespace ferrum
