#include "io/llama2c.h"

#include <cstdint>
#include <cstring>

#include "core/error.h"

namespace ferrum {

WeightSource open_llama2c(const std::string& path, Llama2cHeader* h) {
  auto file = MappedFile::open(path);
  int32_t hdr[7];
  if (file->size() < sizeof(hdr)) throw FormatError(path + ": too short for a llama2.c checkpoint");
  std::memcpy(hdr, file->data(), sizeof(hdr));
  // A negative vocab_size says the classifier is not shared (INT32_MIN has no positive twin).
  *h = {hdr[0], hdr[1], hdr[2], hdr[3], hdr[4], hdr[5] < 0 && hdr[5] != INT32_MIN ? -hdr[5] : hdr[5], hdr[6], hdr[5] > 0};
  if (h->dim <= 0 || h->hidden_dim <= 0 || h->n_layers <= 0 || h->n_heads <= 0 || h->n_kv_heads <= 0 ||
      h->vocab_size <= 0 || h->seq_len <= 0 || h->dim % h->n_heads || h->n_heads % h->n_kv_heads ||
      (h->dim / h->n_heads) % 2 || h->dim > (1 << 16) || h->n_layers > 1024)
    throw FormatError(path + ": implausible llama2.c header (dim " + std::to_string(h->dim) +
                      ", layers " + std::to_string(h->n_layers) + ", heads " + std::to_string(h->n_heads) +
                      ", kv heads " + std::to_string(h->n_kv_heads) + ", vocab " + std::to_string(hdr[5]) +
                      ", seq_len " + std::to_string(h->seq_len) + ")");
  const int64_t D = h->dim, F = h->hidden_dim, L = h->n_layers, V = h->vocab_size;
  const int64_t hd = D / h->n_heads, KVD = hd * h->n_kv_heads;

  WeightSource ws;
  ws.path = path;
  size_t pos = sizeof(hdr);
  // The next `bytes` bytes, which `what` needs.
  auto next = [&](const std::string& what, size_t bytes) {
    if (bytes > file->size() - pos)
      throw FormatError(path + ": truncated llama2.c checkpoint (" + what + " needs " + std::to_string(bytes) +
                        " bytes at " + std::to_string(pos) + ", file has " + std::to_string(file->size()) + ")");
    const char* at = file->data() + pos;
    pos += bytes;
    return at;
  };
  // Reads `count` consecutive f32 tensors (one per layer when count == L).
  auto take = [&](const std::string& name_fmt, int64_t count, const Shape& shape) {
    const size_t each = tensor_file_bytes(DType::F32, shape, path + ": " + name_fmt);
    for (int64_t i = 0; i < count; ++i) {
      std::string name = name_fmt;
      size_t at = name.find("{}");
      if (at != std::string::npos) name.replace(at, 2, std::to_string(i));
      ws.tensors[name] = TensorInfo{name, DType::F32, shape, next(name_fmt, each), each, file, {}, {}};
    }
  };
  auto skip = [&](const std::string& what, const Shape& shape) {
    next(what, tensor_file_bytes(DType::F32, shape, path + ": " + what));
  };
  take("token_embd.weight", 1, {V, D});
  take("blk.{}.attn_norm.weight", L, {D});
  take("blk.{}.attn_q.weight", L, {D, D});
  take("blk.{}.attn_k.weight", L, {KVD, D});
  take("blk.{}.attn_v.weight", L, {KVD, D});
  take("blk.{}.attn_output.weight", L, {D, D});
  take("blk.{}.ffn_norm.weight", L, {D});
  take("blk.{}.ffn_gate.weight", L, {F, D});  // w1
  take("blk.{}.ffn_down.weight", L, {D, F});  // w2
  take("blk.{}.ffn_up.weight", L, {F, D});    // w3
  take("output_norm.weight", 1, {D});
  skip("freq_cis_real", {h->seq_len, hd / 2});  // RoPE tables are recomputed
  skip("freq_cis_imag", {h->seq_len, hd / 2});
  if (!h->shared_classifier) take("output.weight", 1, {V, D});
  if (pos != file->size())
    throw FormatError(path + ": llama2.c checkpoint has " + std::to_string(file->size() - pos) +
                      " unexpected trailing bytes (header and size disagree)");
  return ws;
}

}  // namespace ferrum
