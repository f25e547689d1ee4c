#include "engine/model_runner.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <fstream>
#include <mutex>
#include <thread>

#include <unistd.h>

#include "core/error.h"
#include "engine/rank_orders.h"
#include "model/rope.h"

namespace ferrum {

namespace {
constexpr size_t kMaxGraphs = 8;

// Token rows are padded up to a bucket so prefills of similar length share a recorded stream.
int64_t token_bucket(int64_t t) { return t <= 32 ? t : (t + 31) / 32 * 32; }
}  // namespace

ModelRunner::ModelRunner(const std::string& path, const RunnerOptions& opt) : ModelRunner(open_model_file(path), opt) {}

// Adapters are freed on whichever thread drops the last reference to one (a request ending, the
// Python cache evicting it), and made on any: they count themselves here and queue their orders,
// which the thread that drives the runner sends before the next step.
struct ModelRunner::LoraRegistry {
  std::mutex mutex;
  int64_t numbered = 0;             // numbers given
  int64_t live = 0, live_bytes = 0;  // adapters alive
  std::vector<std::pair<OrderKind, std::vector<char>>> orders;  // AddLora / DropLora, in order
};

namespace {

// The KV blocks a pool of these options holds, checked against the memory the backend has left.
int64_t kv_pool_blocks(const RunnerOptions& opt, const ModelConfig& local, int64_t max_model_len, Backend& be) {
  // [blocks, kv_heads, 16, head_dim] per layer for K and V
  const int64_t row = local.kv_heads * local.head_dim;
  const double elem = opt.kv_dtype == DType::F32 ? 4.0 : opt.kv_dtype == DType::F16 ? 2.0 : 1.0 + 4.0 / double(local.head_dim);
  const double bytes_per_token = 2.0 * double(local.layers * row) * elem;
  const double available = double(be.memory_available_bytes());
  const double bytes = opt.kv_cache_fraction > 0 ? opt.kv_cache_fraction * available : double(opt.kv_cache_bytes);
  int64_t tokens = opt.kv_cache_tokens > 0 ? opt.kv_cache_tokens : int64_t(std::min(bytes / bytes_per_token, 1e15));
  if (opt.kv_cache_tokens <= 0) tokens = std::max(tokens, std::min<int64_t>(max_model_len, 4096));
  const int64_t blocks = std::max<int64_t>(1, BlockManager::blocks_for(tokens));
  if (blocks > INT32_MAX / ModelRunner::kBlockSize) throw ValueError("kv cache too large");
  const double pool_bytes = double(blocks * ModelRunner::kBlockSize) * bytes_per_token;
  if (pool_bytes > available)
    throw ResourceError("cannot allocate a KV cache of " + std::to_string(blocks * ModelRunner::kBlockSize) +
                        " tokens: it needs " + std::to_string(int64_t(pool_bytes)) + " bytes, the " + be.name() +
                        " device has " + std::to_string(int64_t(available)) +
                        " available (lower kv_cache_memory or kv_cache_tokens)");
  return blocks;
}

// Ranks on one machine share its cores.
int threads_of(const RunnerOptions& opt) {
  if (opt.num_threads > 0 || !opt.group) return opt.num_threads;
  const int cores = int(std::thread::hardware_concurrency());
  return std::max(1, cores / std::max(1, opt.group->ranks_on_this_host()));
}

// "VmRSS:  1234 kB" -> bytes, from /proc/self/status.
int64_t proc_status_bytes(const char* key) {
  std::ifstream f("/proc/self/status");
  std::string line;
  const size_t n = std::strlen(key);
  while (std::getline(f, line))
    if (line.compare(0, n, key) == 0) return std::atoll(line.c_str() + n) * 1024;
  return 0;
}

}  // namespace

ModelRunner::ModelRunner(ModelFile file, const RunnerOptions& opt) : group_(opt.group) {
  if (group_ && group_->size() == 1) group_.reset();
  if (leads()) {
    model_number_ = next_model_number();
    send_order(*group_, OrderKind::Load, model_number_, encode_load(file.path, opt));
  }
  int64_t blocks = 0;
  ModelWeights w;
  std::exception_ptr failed;
  try {
    if (!(opt.kv_cache_fraction >= 0 && opt.kv_cache_fraction <= 1))
      throw ValueError("kv_cache_fraction must be in (0, 1]");
    if (opt.kv_cache_tokens < 0 || opt.kv_cache_bytes < 0) throw ValueError("KV cache sizes must be positive");
    if (opt.kv_dtype != DType::F16 && opt.kv_dtype != DType::F32 && opt.kv_dtype != DType::I8)
      throw ValueError("kv_dtype must be f16, f32 or int8");
    file.tokenizer_metadata.clear();  // the tokenizer's arrays (~15 MB parsed) would add to the load's peak memory
    cfg_ = file.config;
    format_ = file.format;
    // Stage s of P is ranks [s * T, (s + 1) * T): rank 0 is the first stage's first.
    const int ranks = group_ ? group_->size() : 1, rank = group_ ? group_->rank() : 0;
    const int stages = opt.pipeline_stages;
    if (stages < 1 || ranks % stages != 0)
      throw ValueError("pipeline_parallel_size " + std::to_string(stages) + " does not divide the group's " +
                       std::to_string(ranks) + " ranks");
    tp_size_ = ranks / stages;
    tp_rank_ = rank % tp_size_;
    stage_ = pipeline_stage(cfg_, rank / tp_size_, stages, opt.layer_partition);
    split_ = split_model(cfg_, tp_rank_, tp_size_);
    max_model_len_ = opt.max_model_len > 0 ? opt.max_model_len : cfg_.max_positions;
    if (max_model_len_ > cfg_.max_positions)
      throw ValueError("max_model_len " + std::to_string(max_model_len_) + " exceeds the model's " +
                       std::to_string(cfg_.max_positions) + " positions");
    be_ = make_backend(opt.device, threads_of(opt));
    if (opt.max_loras < 0 || opt.max_lora_rank < 1) throw ValueError("max_loras must be >= 0 and max_lora_rank >= 1");
    if (opt.max_loras > 0 && !be_->supports(Op::Lora))
      throw ValueError("the " + be_->name() + " backend does not run LoRA adapters (enable_lora): use device='cpu'");
    max_loras_ = opt.max_loras;
    max_lora_rank_ = opt.max_lora_rank;
    if (max_loras_ > 0) loras_ = std::make_shared<LoraRegistry>();
    const int64_t rss = proc_status_bytes("VmRSS:");
    w = load_weights(*be_, file.weights, cfg_, split_, stage_, opt.load_progress);
    file.weights = WeightSource{};  // the file stays mapped only where weights are used as stored
    load_rss_bytes_ = proc_status_bytes("VmRSS:") - rss;
    ModelConfig kv_cfg = split_.local(cfg_);
    kv_cfg.layers = stage_.layers;  // a stage's pool holds its layers'
    blocks = kv_pool_blocks(opt, kv_cfg, max_model_len_, *be_);
  } catch (...) {
    if (!group_) throw;
    failed = std::current_exception();
  }
  if (group_) blocks = agree_on_load(*group_, failed, blocks);  // every rank throws if one failed
  try {
    // The sums of a stage's tensor-parallel ranks run among them alone.
    if (stage_.whole()) tp_ = group_;
    else if (tp_size_ > 1) tp_ = group_->split(stage_.stage, tp_rank_);
    const ModelConfig local = split_.local(cfg_);
    stats_.weight_bytes = weight_bytes(w);
    // No sequence outgrows the pool: tables indexed by position or block stop there.
    const int64_t positions = std::min(max_model_len_, blocks * kBlockSize);
    max_blocks_ = BlockManager::blocks_for(positions);
    RopeTable rope = make_rope_table(*be_, cfg_, positions, w.rope_freq_factors);
    for (int64_t l = 0; l < stage_.layers; ++l) {
      KvLayer kv;
      Shape shape{blocks, local.kv_heads, kBlockSize, local.head_dim};
      kv.k = be_->alloc(opt.kv_dtype, shape);
      kv.v = be_->alloc(opt.kv_dtype, shape);
      if (opt.kv_dtype == DType::I8) {
        kv.k_scale = be_->alloc(DType::F32, {blocks, local.kv_heads, kBlockSize});
        kv.v_scale = be_->alloc(DType::F32, {blocks, local.kv_heads, kBlockSize});
      }
      for (const Tensor* t : {&kv.k, &kv.v, &kv.k_scale, &kv.v_scale})
        if (t->defined()) be_->materialize(*t);
      kv_.push_back(kv);
    }
    blocks_ = std::make_unique<BlockManager>(blocks, opt.prefix_cache);
    decoder_ = std::make_unique<Decoder>(be_, local, std::move(w), rope, stage_, max_loras_, max_lora_rank_);
  } catch (...) {
    if (leads()) send_order(*group_, OrderKind::Close, model_number_);  // the followers' runners are built: drop them
    throw;
  }
  stats_.block_size = kBlockSize;
  stats_.ranks = tp_size_;
  stats_.stages = stage_.stages;
}

ModelRunner::~ModelRunner() {
  if (!leads() || !group_->is_open()) return;
  try {
    while (!in_flight_.empty()) end();  // the other ranks finish them before they close the model
    send_order(*group_, OrderKind::Close, model_number_);
  } catch (...) {  // a group that failed has ended its ranks already
  }
}

ModelRunner::Graph& ModelRunner::graph_for(const StepPlan& p) {
  const StepRows& split = p.split;
  std::string key = std::to_string(p.tokens) + "," + std::to_string(p.seqs) + "," + std::to_string(p.rows) + "," +
                    std::to_string(split.gen_tokens) + "," + std::to_string(split.gen_rows) + "," +
                    std::to_string(int(split.decodes)) + "," + std::to_string(split.logit_rows) + "," +
                    std::to_string(int(p.embeds));
  for (auto it = graphs_.begin(); it != graphs_.end(); ++it)
    if (it->first == key) {
      graphs_.splice(graphs_.begin(), graphs_, it);
      stats_.replays++;
      return graphs_.front().second;
    }
  Graph g;
  g.buffers = decoder_->alloc_step(p.tokens, p.seqs, p.rows, max_blocks_, split, p.embeds);
  g.step = std::make_unique<RecordedStep>(*be_, tp_.get(), links());
  decoder_->record(*g.step, g.buffers, kv_);
  graphs_.emplace_front(key, std::move(g));
  if (graphs_.size() > kMaxGraphs) graphs_.pop_back();
  return graphs_.front().second;
}

ForwardOutput ModelRunner::forward(const std::vector<ForwardItem>& items) {
  if (!in_flight_.empty()) throw std::logic_error("ModelRunner::forward: forwards are in flight");
  begin(items);
  return end();
}

void ModelRunner::begin(const std::vector<ForwardItem>& items) {
  plan(items);
  const StepPlan& p = plan_;
  InFlight f;
  if (group_) {
    send_lora_orders(f.lora_orders);
    f.order = std::make_unique<SentOrder>(*group_, OrderKind::Step, model_number_, encode_step(p));
  }
  compute(p, f.out);
  plan_.loras.clear();  // a removed adapter goes once its requests end, not with the next step
  if (!stage_.whole()) {  // rank 0 is the first stage: the last stage's first rank sends the rows
    const int last = (stage_.stages - 1) * tp_size_;
    f.out.logits.resize(size_t(p.logit_rows * cfg_.vocab));
    f.out.hidden.resize(size_t(p.hidden_rows * cfg_.hidden));
    for (std::vector<float>* rows : {&f.out.logits, &f.out.hidden})
      if (!rows->empty()) f.rows.push_back(group_->start_recv(rows->data(), rows->size() * 4, last));
  }
  in_flight_.push_back(std::move(f));
}

ForwardOutput ModelRunner::end() {
  if (in_flight_.empty()) throw std::logic_error("ModelRunner::end: no forward in flight");
  InFlight f = std::move(in_flight_.front());
  in_flight_.pop_front();
  for (auto& r : f.rows) r->wait();
  for (auto& o : f.lora_orders) o->wait();
  if (f.order) f.order->wait();
  return std::move(f.out);
}

void ModelRunner::plan(const std::vector<ForwardItem>& items) {
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
  StepPlan& p = plan_;
  const int64_t Tb = token_bucket(T), S = int64_t(items.size()), Rb = std::max<int64_t>(R, 1);
  p.tokens = Tb;
  p.seqs = S;
  p.rows = Rb;
  // Padding rows join the last group: with generations alone, the generation group.
  p.split = G == T ? StepRows{Tb, Rb, decodes, Rb} : StepRows{G, Rg, G > 0 && decodes, L};
  p.logit_rows = L;
  p.hidden_rows = R - L;
  p.replay = replay_;

  p.ids.assign(size_t(Tb), 0);
  p.token_seq.assign(size_t(Tb), 0);
  p.token_pos.assign(size_t(Tb), -1);  // padding rows: no position, no slot
  p.slots.assign(size_t(Tb), -1);
  p.block_tables.assign(size_t(S * max_blocks_), -1);
  p.row_index.assign(size_t(Rb), 0);
  p.loras.clear();
  p.lora_rows.assign(max_loras_ > 0 ? size_t(Tb) : 0, -1);
  p.lora_scales.assign(max_loras_ > 0 ? size_t(Tb) : 0, 0.0f);
  p.embeds = false;
  for (const ForwardItem& it : items) p.embeds = p.embeds || (it.embeds && it.start < it.embeds_len);
  const int64_t H = cfg_.hidden;
  if (p.embeds) {
    p.embed_rows.assign(size_t(Tb * H), 0.0f);
    p.input_rows.resize(size_t(Tb));
    for (int64_t k = 0; k < Tb; ++k) p.input_rows[size_t(k)] = int32_t(k);
  } else {
    p.embed_rows.clear();
    p.input_rows.clear();
  }
  int64_t t = 0, r = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    const ForwardItem& it = items[i];
    const std::vector<int32_t>& blocks = bm.blocks(it.kv);
    if (BlockManager::blocks_for(it.start + it.count) > int64_t(blocks.size()) || it.rows < 0 ||
        it.rows_from < it.start || it.rows_from + it.rows > it.start + it.count)
      throw std::logic_error("ModelRunner::forward: an item outside its blocks or tokens");
    std::copy(blocks.begin(), blocks.end(), p.block_tables.begin() + int64_t(i) * max_blocks_);
    int32_t slot = -1;
    if (it.lora) {
      if (max_loras_ == 0) throw ValueError("a LoRA adapter was given to a model loaded without enable_lora");
      const auto found = std::find(p.loras.begin(), p.loras.end(), it.lora);
      slot = int32_t(found - p.loras.begin());
      if (found == p.loras.end()) p.loras.push_back(it.lora);
      if (int64_t(p.loras.size()) > max_loras_)
        throw std::logic_error("ModelRunner::forward: more adapters in one step than max_loras");
    }
    for (int64_t j = 0; j < it.count; ++j, ++t) {
      if (slot >= 0) {
        p.lora_rows[size_t(t)] = slot;
        p.lora_scales[size_t(t)] = it.lora_scale;
      }
      const int64_t pos = it.start + j;
      p.ids[size_t(t)] = it.tokens[j];
      p.token_seq[size_t(t)] = int32_t(i);
      p.token_pos[size_t(t)] = int32_t(pos);
      p.slots[size_t(t)] = blocks[size_t(pos / kBlockSize)] * int32_t(kBlockSize) + int32_t(pos % kBlockSize);
      if (pos >= it.rows_from && pos < it.rows_from + it.rows) p.row_index[size_t(r++)] = int32_t(t);
      if (pos < it.embeds_len) {
        std::copy_n(it.embeds + pos * H, H, p.embed_rows.begin() + t * H);
        p.input_rows[size_t(t)] = int32_t(Tb + t);
      }
    }
  }
  p.lora_numbers.clear();
  for (const auto& lora : p.loras) p.lora_numbers.push_back(lora->number);
}

void ModelRunner::run(StepPlan& p) {
  p.loras.clear();
  for (int64_t number : p.lora_numbers) {
    const auto it = rank_loras_.find(number);
    if (it == rank_loras_.end()) throw std::logic_error("a step names a LoRA adapter this rank does not hold");
    p.loras.push_back(it->second);
  }
  ForwardOutput out;
  compute(p, out);
  p.loras.clear();
  if (!stage_.whole()) rows_to_rank0(p, std::move(out));
}

void ModelRunner::compute(const StepPlan& p, ForwardOutput& out) {
  if (p.replay != replay_) set_replay(p.replay);
  Graph& g = replay_ ? graph_for(p) : (graphs_.clear(), graph_for(p));
  const StepBuffers& b = g.buffers;
  const std::vector<int32_t>* ids = &p.ids;
  if (!split_.whole()) {  // ids outside this rank's vocabulary rows look up its zero row
    local_ids_.resize(p.ids.size());
    for (size_t i = 0; i < p.ids.size(); ++i) {
      const int64_t id = p.ids[i] - split_.vocab0;
      local_ids_[i] = int32_t(id >= 0 && id < split_.vocab ? id : split_.vocab);
    }
    ids = &local_ids_;
  }
  be_->upload(b.ids, ids->data(), ids->size() * 4);
  be_->upload(b.batch.token_seq, p.token_seq.data(), p.token_seq.size() * 4);
  be_->upload(b.batch.token_pos, p.token_pos.data(), p.token_pos.size() * 4);
  be_->upload(b.batch.slot_mapping, p.slots.data(), p.slots.size() * 4);
  be_->upload(b.batch.block_tables, p.block_tables.data(), p.block_tables.size() * 4);
  be_->upload(b.logit_rows, p.row_index.data(), p.row_index.size() * 4);
  if (LoraSlots* slots = decoder_->lora_slots()) {
    for (size_t k = 0; k < slots->slots.size(); ++k) slots->slots[k] = k < p.loras.size() ? p.loras[k] : nullptr;
    be_->upload(b.lora_rows, p.lora_rows.data(), p.lora_rows.size() * 4);
    be_->upload(b.lora_scales, p.lora_scales.data(), p.lora_scales.size() * 4);
  }
  if (p.embeds) {
    be_->upload(b.inputs.slice(p.tokens, p.tokens), p.embed_rows.data(), p.embed_rows.size() * 4);
    be_->upload(b.input_rows, p.input_rows.data(), p.input_rows.size() * 4);
  }
  g.step->run(stats_.all_reduce, &stats_.hand_offs);
  if (LoraSlots* slots = decoder_->lora_slots())  // a removed adapter's memory goes once its requests end
    std::fill(slots->slots.begin(), slots->slots.end(), nullptr);
  stats_.steps++;
  const int64_t L = p.logit_rows, H = p.hidden_rows;
  if (stage_.last()) {
    if (L > 0) gather_logits(b.logits, L, out.logits);
    if (H > 0 && tp_rank_ == 0) {
      out.hidden.resize(size_t(H * cfg_.hidden));
      be_->download(b.h_rows.slice(L, H), out.hidden.data(), out.hidden.size() * 4);
    }
  }
}

StageLinks ModelRunner::links() const {
  if (stage_.whole()) return {};
  const int rank = group_->rank();
  return {group_.get(), stage_.first() ? -1 : rank - tp_size_, stage_.last() ? -1 : rank + tp_size_};
}

void ModelRunner::rows_to_rank0(const StepPlan& p, ForwardOutput out) {
  if (group_->rank() != (stage_.stages - 1) * tp_size_) return;
  for (auto& sent : rows_sent_) sent->wait();
  rows_sent_.clear();
  rows_sending_ = std::move(out);
  const size_t logits = size_t(p.logit_rows * cfg_.vocab), hidden = size_t(p.hidden_rows * cfg_.hidden);
  if (logits > 0) rows_sent_.push_back(group_->start_send(rows_sending_.logits.data(), logits * 4, 0));
  if (hidden > 0) rows_sent_.push_back(group_->start_send(rows_sending_.hidden.data(), hidden * 4, 0));
}

void ModelRunner::gather_logits(const Tensor& logits, int64_t rows, std::vector<float>& out) {
  const int64_t V = cfg_.vocab;
  if (!tp_) {
    out.resize(size_t(rows * V));
    be_->download(logits.slice(0, rows), out.data(), out.size() * 4);
    return;
  }
  // Every rank sends `chunk` columns per row (the last rank's padded); rank 0 interleaves them.
  const int64_t chunk = split_.vocab_chunk, mine = split_.vocab, ranks = tp_->size();
  logits_share_.assign(size_t(rows * chunk), 0.0f);
  std::vector<float> rows_mine(size_t(rows * mine));
  be_->download(logits.slice(0, rows), rows_mine.data(), rows_mine.size() * 4);
  for (int64_t i = 0; i < rows; ++i)
    std::copy_n(rows_mine.begin() + i * mine, mine, logits_share_.begin() + i * chunk);
  if (tp_->rank() == 0) logits_gathered_.resize(size_t(ranks * rows * chunk));
  tp_->gather(logits_share_.data(), logits_share_.size() * 4, logits_gathered_.data(), 0);
  if (tp_->rank() != 0) return;
  out.resize(size_t(rows * V));
  for (int64_t k = 0; k < ranks; ++k) {
    const int64_t v0 = k * chunk, n = std::min(chunk, V - v0);
    for (int64_t i = 0; i < rows; ++i)
      std::copy_n(logits_gathered_.begin() + (k * rows + i) * chunk, n, out.begin() + i * V + v0);
  }
}

std::shared_ptr<const LoraAdapter> ModelRunner::make_lora(std::vector<LoraPart> parts, uint64_t cache_key) {
  if (max_loras_ == 0) throw ValueError("LoRA adapters need a model loaded with enable_lora");
  const std::shared_ptr<LoraRegistry> reg = loras_;
  int64_t number;
  {
    std::lock_guard<std::mutex> lock(reg->mutex);
    number = ++reg->numbered;
  }
  std::vector<char> order;  // the whole updates: each rank takes its share
  if (group_) order = encode_lora(number, cache_key, parts);
  std::shared_ptr<LoraAdapter> made =
      make_lora_adapter(*be_, cfg_, max_lora_rank_, std::move(parts), cache_key, split_, stage_);
  made->number = number;
  const bool told = bool(group_);
  {
    std::lock_guard<std::mutex> lock(reg->mutex);
    reg->live++;
    reg->live_bytes += made->bytes;
    if (told) reg->orders.emplace_back(OrderKind::AddLora, std::move(order));
  }
  // The caller's handle: freeing it frees the adapter, and tells the other ranks to free theirs.
  return std::shared_ptr<const LoraAdapter>(made.get(), [made, reg, told](const LoraAdapter*) mutable {
    {
      std::lock_guard<std::mutex> lock(reg->mutex);
      reg->live--;
      reg->live_bytes -= made->bytes;
      if (told) reg->orders.emplace_back(OrderKind::DropLora, encode_drop_lora(made->number));
    }
    made.reset();
  });
}

void ModelRunner::send_lora_orders(std::vector<std::unique_ptr<SentOrder>>& sent) {
  if (!loras_) return;
  std::vector<std::pair<OrderKind, std::vector<char>>> orders;
  {
    std::lock_guard<std::mutex> lock(loras_->mutex);
    orders.swap(loras_->orders);
  }
  for (auto& [kind, payload] : orders)
    sent.push_back(std::make_unique<SentOrder>(*group_, kind, model_number_, std::move(payload)));
}

void ModelRunner::add_lora(const std::vector<char>& order) {
  int64_t number = 0;
  uint64_t cache_key = 0;
  std::vector<LoraPart> parts;
  decode_lora(order, &number, &cache_key, &parts);
  std::shared_ptr<LoraAdapter> made =
      make_lora_adapter(*be_, cfg_, max_lora_rank_, std::move(parts), cache_key, split_, stage_);
  made->number = number;
  rank_loras_[number] = std::move(made);
}

void ModelRunner::drop_lora(const std::vector<char>& order) { rank_loras_.erase(decode_drop_lora(order)); }

RankMemory ModelRunner::memory() const {
  RankMemory m;
  m.weight_bytes = stats_.weight_bytes;
  for (const KvLayer& kv : kv_)
    for (const Tensor* t : {&kv.k, &kv.v, &kv.k_scale, &kv.v_scale})
      if (t->defined()) m.kv_bytes += int64_t(t->nbytes());
  m.rss_bytes = proc_status_bytes("VmRSS:");
  m.peak_rss_bytes = proc_status_bytes("VmHWM:");
  m.load_rss_bytes = load_rss_bytes_;
  m.pid = getpid();
  m.stage = stage_.stage;
  m.layer0 = stage_.layer0;
  m.layers = stage_.layers;
  if (loras_ && (!group_ || leads())) {  // the others' are in rank_loras_
    std::lock_guard<std::mutex> lock(loras_->mutex);
    m.loras = loras_->live;
    m.lora_bytes = loras_->live_bytes;
  }
  for (const auto& held : rank_loras_) {
    m.loras++;
    m.lora_bytes += held.second->bytes;
  }
  return m;
}

std::vector<RankMemory> ModelRunner::rank_memory() {
  if (!group_) return {memory()};
  std::vector<std::unique_ptr<SentOrder>> lora_orders;  // the adapters freed since the last step go first
  send_lora_orders(lora_orders);
  for (auto& o : lora_orders) o->wait();
  send_order(*group_, OrderKind::Memory, model_number_);
  const RankMemory mine = memory();
  std::vector<RankMemory> all(size_t(group_->size()));
  group_->gather(&mine, sizeof mine, all.data(), 0);
  return all;
}

void ModelRunner::report_memory() {
  const RankMemory mine = memory();
  group_->gather(&mine, sizeof mine, nullptr, 0);
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
