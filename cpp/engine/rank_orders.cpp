#include "engine/rank_orders.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <stdexcept>

#include "core/error.h"

namespace ferrum {

namespace {

// Values appended to / read from a byte buffer in order.
class Writer {
 public:
  template <typename T>
  Writer& put(const T& v) {
    const char* p = reinterpret_cast<const char*>(&v);
    bytes.insert(bytes.end(), p, p + sizeof(T));
    return *this;
  }
  Writer& put(const std::string& s) {
    put(int64_t(s.size()));
    bytes.insert(bytes.end(), s.begin(), s.end());
    return *this;
  }
  template <typename T>
  Writer& put(const std::vector<T>& v) {
    const char* p = reinterpret_cast<const char*>(v.data());
    bytes.insert(bytes.end(), p, p + v.size() * sizeof(T));
    return *this;
  }
  std::vector<char> bytes;
};

class Reader {
 public:
  explicit Reader(const std::vector<char>& b) : bytes_(b) {}
  template <typename T>
  T get() {
    T v;
    std::memcpy(&v, take(sizeof(T)), sizeof(T));
    return v;
  }
  std::string get_string() {
    const size_t n = size_t(get<int64_t>());
    return std::string(take(n), n);
  }
  template <typename T>
  void get_into(std::vector<T>& v, size_t n) {
    v.resize(n);
    std::memcpy(v.data(), take(n * sizeof(T)), n * sizeof(T));
  }

 private:
  const char* take(size_t n) {
    if (n > bytes_.size() - at_) throw std::logic_error("a tensor-parallel order shorter than its contents");
    at_ += n;
    return bytes_.data() + at_ - n;
  }
  const std::vector<char>& bytes_;
  size_t at_ = 0;
};

struct OrderHeader {
  int64_t kind, model, payload_bytes;
};

// A rank's load outcome as the ranks exchange it.
struct LoadStatus {
  int64_t error_kind;  // ErrorKind
  int64_t kv_blocks;
  char message[1008];
};
enum ErrorKind : int64_t { kNone, kValue, kFormat, kResource, kRuntime };

LoadStatus status_of(std::exception_ptr error, int64_t kv_blocks) {
  LoadStatus s{};
  s.kv_blocks = kv_blocks;
  if (!error) return s;
  std::string message;
  try {
    std::rethrow_exception(error);
  } catch (const FormatError& e) {
    s.error_kind = kFormat, message = e.what();
  } catch (const ValueError& e) {
    s.error_kind = kValue, message = e.what();
  } catch (const ResourceError& e) {
    s.error_kind = kResource, message = e.what();
  } catch (const std::exception& e) {
    s.error_kind = kRuntime, message = e.what();
  } catch (...) {
    s.error_kind = kRuntime, message = "an unknown error";
  }
  message.resize(std::min(message.size(), sizeof s.message - 1));
  std::memcpy(s.message, message.c_str(), message.size() + 1);
  return s;
}

[[noreturn]] void throw_status(const LoadStatus& s, int rank) {
  const std::string m = "rank " + std::to_string(rank) + ": " + s.message;
  switch (s.error_kind) {
    case kFormat: throw FormatError(m);
    case kValue: throw ValueError(m);
    case kResource: throw ResourceError(m);
    default: throw std::runtime_error(m);
  }
}

}  // namespace

void send_order(Communicator& group, OrderKind kind, int64_t model, const std::vector<char>& payload) {
  OrderHeader h{int64_t(kind), model, int64_t(payload.size())};
  group.broadcast(&h, sizeof h, 0);
  if (!payload.empty()) group.broadcast(const_cast<char*>(payload.data()), payload.size(), 0);
}

SentOrder::SentOrder(Communicator& group, OrderKind kind, int64_t model, std::vector<char> payload)
    : header_{int64_t(kind), model, int64_t(payload.size())}, payload_(std::move(payload)) {
  static_assert(sizeof header_ == sizeof(OrderHeader), "an order's header as receive_order reads it");
  header_sent_ = group.start_broadcast(header_, sizeof header_);
  if (!payload_.empty()) payload_sent_ = group.start_broadcast(payload_.data(), payload_.size());
}

void SentOrder::wait() {
  header_sent_->wait();
  if (payload_sent_) payload_sent_->wait();
}

Order receive_order(Communicator& group) {
  OrderHeader h{};
  group.broadcast(&h, sizeof h, 0, Communicator::Wait::Forever);
  if (h.kind < int64_t(OrderKind::Load) || h.kind > int64_t(OrderKind::DropLora) || h.payload_bytes < 0)
    throw std::logic_error("an unknown tensor-parallel order");
  Order o{OrderKind(h.kind), h.model, std::vector<char>(size_t(h.payload_bytes))};
  if (!o.payload.empty()) group.broadcast(o.payload.data(), o.payload.size(), 0);
  return o;
}

int64_t next_model_number() {
  static std::atomic<int64_t> next{0};
  return ++next;
}

void end_group(Communicator& group) {
  if (!group.is_open()) return;
  send_order(group, OrderKind::End, 0);
  group.close();
}

std::vector<char> encode_load(const std::string& path, const RunnerOptions& o) {
  Writer w;
  w.put(std::filesystem::absolute(path).string()).put(o.device).put(int64_t(o.num_threads)).put(int64_t(o.kv_dtype)).put(o.max_model_len);
  w.put(o.kv_cache_tokens).put(o.kv_cache_bytes).put(o.kv_cache_fraction).put(int64_t(o.prefix_cache));
  w.put(int64_t(o.pipeline_stages)).put(int64_t(o.layer_partition.size())).put(o.layer_partition);
  w.put(o.max_loras).put(o.max_lora_rank);
  return std::move(w.bytes);
}

void decode_load(const std::vector<char>& payload, std::string* path, RunnerOptions* o) {
  Reader r(payload);
  *path = r.get_string();
  o->device = r.get_string();
  o->num_threads = int(r.get<int64_t>());
  o->kv_dtype = DType(r.get<int64_t>());
  o->max_model_len = r.get<int64_t>();
  o->kv_cache_tokens = r.get<int64_t>();
  o->kv_cache_bytes = r.get<int64_t>();
  o->kv_cache_fraction = r.get<double>();
  o->prefix_cache = r.get<int64_t>() != 0;
  o->pipeline_stages = int(r.get<int64_t>());
  r.get_into(o->layer_partition, size_t(r.get<int64_t>()));
  o->max_loras = r.get<int64_t>();
  o->max_lora_rank = r.get<int64_t>();
}

std::vector<char> encode_step(const StepPlan& p) {
  Writer w;
  w.put(p.tokens).put(p.seqs).put(p.rows).put(p.split.gen_tokens).put(p.split.gen_rows);
  w.put(int64_t(p.split.decodes)).put(p.split.logit_rows).put(p.logit_rows).put(p.hidden_rows);
  w.put(int64_t(p.replay)).put(int64_t(p.block_tables.size()));
  w.put(p.ids).put(p.token_seq).put(p.token_pos).put(p.slots).put(p.block_tables).put(p.row_index);
  w.put(int64_t(p.embeds)).put(int64_t(p.embed_rows.size())).put(p.embed_rows).put(p.input_rows);
  w.put(int64_t(p.lora_numbers.size())).put(p.lora_numbers);
  w.put(int64_t(p.lora_rows.size())).put(p.lora_rows).put(p.lora_scales);
  return std::move(w.bytes);
}

void decode_step(const std::vector<char>& payload, StepPlan* p) {
  Reader r(payload);
  p->tokens = r.get<int64_t>();
  p->seqs = r.get<int64_t>();
  p->rows = r.get<int64_t>();
  p->split.gen_tokens = r.get<int64_t>();
  p->split.gen_rows = r.get<int64_t>();
  p->split.decodes = r.get<int64_t>() != 0;
  p->split.logit_rows = r.get<int64_t>();
  p->logit_rows = r.get<int64_t>();
  p->hidden_rows = r.get<int64_t>();
  p->replay = r.get<int64_t>() != 0;
  const size_t tables = size_t(r.get<int64_t>()), T = size_t(p->tokens);
  r.get_into(p->ids, T);
  r.get_into(p->token_seq, T);
  r.get_into(p->token_pos, T);
  r.get_into(p->slots, T);
  r.get_into(p->block_tables, tables);
  r.get_into(p->row_index, size_t(p->rows));
  p->embeds = r.get<int64_t>() != 0;
  const size_t embed_values = size_t(r.get<int64_t>());
  r.get_into(p->embed_rows, embed_values);
  r.get_into(p->input_rows, p->embeds ? T : 0);
  r.get_into(p->lora_numbers, size_t(r.get<int64_t>()));
  const size_t lora_rows = size_t(r.get<int64_t>());
  r.get_into(p->lora_rows, lora_rows);
  r.get_into(p->lora_scales, lora_rows);
}

std::vector<char> encode_lora(int64_t number, uint64_t cache_key, const std::vector<LoraPart>& parts) {
  Writer w;
  w.put(number).put(cache_key).put(int64_t(parts.size()));
  for (const LoraPart& p : parts) {
    w.put(p.site).put(p.rank).put(p.n).put(p.out_col).put(p.scale).put(int64_t(p.a_dtype)).put(int64_t(p.b_dtype));
    w.put(int64_t(p.a.size())).put(p.a).put(int64_t(p.b.size())).put(p.b);
  }
  return std::move(w.bytes);
}

void decode_lora(const std::vector<char>& payload, int64_t* number, uint64_t* cache_key, std::vector<LoraPart>* parts) {
  Reader r(payload);
  *number = r.get<int64_t>();
  *cache_key = r.get<uint64_t>();
  parts->resize(size_t(r.get<int64_t>()));
  for (LoraPart& p : *parts) {
    p.site = r.get<int64_t>();
    p.rank = r.get<int64_t>();
    p.n = r.get<int64_t>();
    p.out_col = r.get<int64_t>();
    p.scale = r.get<float>();
    p.a_dtype = DType(r.get<int64_t>());
    p.b_dtype = DType(r.get<int64_t>());
    r.get_into(p.a, size_t(r.get<int64_t>()));
    r.get_into(p.b, size_t(r.get<int64_t>()));
  }
}

std::vector<char> encode_drop_lora(int64_t number) {
  Writer w;
  w.put(number);
  return std::move(w.bytes);
}

int64_t decode_drop_lora(const std::vector<char>& payload) { return Reader(payload).get<int64_t>(); }

int64_t agree_on_load(Communicator& group, std::exception_ptr error, int64_t kv_blocks) {
  const LoadStatus mine = status_of(error, kv_blocks);
  std::vector<LoadStatus> all(size_t(group.size()));
  // Without a deadline: a rank may take much longer than another to read its share.
  group.all_gather(&mine, sizeof mine, all.data(), Communicator::Wait::Forever);
  if (error) std::rethrow_exception(error);
  int64_t blocks = kv_blocks;
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r].error_kind != kNone) throw_status(all[r], int(r));
    blocks = std::min(blocks, all[r].kv_blocks);
  }
  return blocks;
}

}  // namespace ferrum
