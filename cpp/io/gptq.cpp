#include "io/gptq.h"

#include <cstring>
#include <fstream>
#include <iterator>
#include <optional>
#include <vector>

#include "core/error.h"
#include "io/json_strict.h"
#include "quant/formats.h"

namespace ferrum {

using json = nlohmann::json;

namespace {

constexpr int kBlock = quant::kQK;

struct GptqConfig {
  std::string where;  // "<file>: quantization_config", for messages
  int bits = 4;
  int64_t group_size = 128;  // -1: one group per row
  bool v1 = true;            // checkpoint_format gptq: zeros stored as z - 1
};

std::optional<json> read_json_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in.good()) return std::nullopt;
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return parse_json_strict(text.data(), text.data() + text.size(), path);
}

const json* field(const json& q, const char* key) {
  auto it = q.find(key);
  return it == q.end() || it->is_null() ? nullptr : &*it;
}

int64_t int_field(const json& q, const char* key, int64_t fallback, const std::string& where) {
  const json* v = field(q, key);
  if (!v) return fallback;
  if (!v->is_number_integer()) throw ValueError(where + " '" + key + "' must be an integer, not " + v->dump());
  return v->get<int64_t>();
}

std::string string_field(const json& q, const char* key, const std::string& fallback, const std::string& where) {
  const json* v = field(q, key);
  if (!v) return fallback;
  if (!v->is_string()) throw ValueError(where + " '" + key + "' must be a string, not " + v->dump());
  return v->get<std::string>();
}

GptqConfig parse_config(const json& q, const std::string& where) {
  if (!q.is_object()) throw ValueError(where + " is not a JSON object");
  GptqConfig c;
  c.where = where;
  const std::string method = string_field(q, "quant_method", "gptq", where);
  if (method != "gptq")
    throw ValueError(where + " 'quant_method' is '" + method + "', which ferrum does not read (it reads 'gptq')");
  // GPTQModel writes `format`, AutoGPTQ `checkpoint_format`.
  const std::string format =
      string_field(q, "checkpoint_format", string_field(q, "format", "gptq", where), where);
  if (format != "gptq" && format != "gptq_v2")
    throw ValueError(where + " checkpoint format '" + format + "' is not supported (ferrum reads 'gptq' and 'gptq_v2')");
  c.v1 = format == "gptq";
  c.bits = int(int_field(q, "bits", 4, where));
  if (c.bits != 4 && c.bits != 8)
    throw ValueError(where + " 'bits' is " + std::to_string(c.bits) + ": ferrum reads 4- and 8-bit GPTQ only");
  c.group_size = int_field(q, "group_size", 128, where);
  if (c.group_size != -1 && (c.group_size <= 0 || c.group_size % kBlock != 0))
    throw ValueError(where + " 'group_size' is " + std::to_string(c.group_size) +
                     ": ferrum reads -1 or a multiple of " + std::to_string(kBlock));
  const std::string pack_dtype = string_field(q, "pack_dtype", "int32", where);
  if (pack_dtype != "int32")
    throw ValueError(where + " 'pack_dtype' is '" + pack_dtype + "': ferrum reads int32 packing only");
  if (const json* d = field(q, "dynamic"); d && !(d->is_object() && d->empty()))
    throw ValueError(where + " 'dynamic' (per-module overrides) is not supported yet");
  return c;
}

// The tensor `name` as a packed GPTQ tensor must be: present, of dtype `dtype` and shape `shape`.
const TensorInfo& packed(const WeightSource& ws, const std::string& name, DType dtype, const Shape& shape,
                         const std::string& why) {
  const TensorInfo* t = ws.find(name);
  if (!t) throw ValueError(ws.path + ": GPTQ tensor '" + name + "' is missing");
  if (t->dtype != dtype)
    throw ValueError(ws.path + ": GPTQ tensor '" + name + "' has dtype " + dtype_name(t->dtype) + ", expected " +
                     dtype_name(dtype));
  if (t->shape != shape)
    throw ValueError(ws.path + ": GPTQ tensor '" + name + "' has shape " + shape_str(t->shape) + ", expected " +
                     shape_str(shape) + " (" + why + ")");
  return *t;
}

uint32_t word(const TensorInfo& t, int64_t i) {
  uint32_t w;
  std::memcpy(&w, t.data + 4 * i, 4);
  return w;
}

// One module: qweight [K / pf, N], qzeros [G, N / pf], scales f16 [G, N], g_idx [K] ->
// `<module>.weight` [N, K] of a block type.
void translate_module(WeightSource& ws, const std::string& module, const GptqConfig& c) {
  const std::string qw_name = module + ".qweight";
  const TensorInfo& qw = ws.tensors.at(qw_name);
  const int pf = 32 / c.bits;
  const uint32_t maxq = (1u << c.bits) - 1;
  if (qw.dtype != DType::I32 || qw.shape.size() != 2)
    throw ValueError(ws.path + ": GPTQ tensor '" + qw_name + "' must be a 2-D I32 tensor, not " +
                     dtype_name(qw.dtype) + " " + shape_str(qw.shape));
  const int64_t K = qw.shape[0] * pf, N = qw.shape[1];
  if (K % kBlock != 0)
    throw ValueError(ws.path + ": GPTQ tensor '" + qw_name + "' holds " + std::to_string(K) +
                     " input features, not a multiple of " + std::to_string(kBlock));
  const int64_t gs = c.group_size == -1 ? K : c.group_size;
  const int64_t G = (K + gs - 1) / gs;
  if (N % pf != 0)
    throw ValueError(ws.path + ": GPTQ tensor '" + qw_name + "' has " + std::to_string(N) +
                     " output features, which qzeros cannot pack by " + std::to_string(pf));
  const std::string groups = std::to_string(G) + " groups of " + std::to_string(gs) + " of " +
                             std::to_string(K) + " inputs, " + std::to_string(N) + " outputs";
  const TensorInfo& sc = packed(ws, module + ".scales", DType::F16, {G, N}, groups);
  const TensorInfo& qz = packed(ws, module + ".qzeros", DType::I32, {G, N / pf}, groups);
  const std::string gi_name = module + ".g_idx";
  if (const TensorInfo* gi = ws.find(gi_name)) {
    packed(ws, gi_name, DType::I32, {K}, "one group index per input");
    for (int64_t k = 0; k < K; ++k) {
      const int32_t g = int32_t(word(*gi, k));
      if (g < 0 || g >= G)
        throw ValueError(ws.path + ": GPTQ tensor '" + gi_name + "' entry " + std::to_string(k) + " is " +
                         std::to_string(g) + ", outside the " + std::to_string(G) + " groups");
      if (g != k / gs)
        throw ValueError(ws.path + ": GPTQ tensor '" + gi_name +
                         "' orders inputs out of group order (act-order / desc_act), which ferrum does not "
                         "read yet");
    }
  }
  const std::string out_name = module + ".weight";
  if (ws.find(out_name))
    throw ValueError(ws.path + ": module '" + module + "' has both a float 'weight' and a GPTQ 'qweight'");

  // Zeros, unpacked; v1 stores z - 1 with the borrow carried across the word (GPTQModel's v2 ->
  // v1 conversion subtracts 0x11111111 from the whole word), so the whole word is added back.
  const uint32_t v1_offset = c.bits == 4 ? 0x11111111u : 0x01010101u;
  std::vector<uint8_t> zeros(size_t(G * N));
  bool symmetric = true;
  const uint32_t mid = 1u << (c.bits - 1);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t n = 0; n < N; ++n) {
      const uint32_t w = word(qz, g * (N / pf) + n / pf) + (c.v1 ? v1_offset : 0u);
      const uint8_t z = uint8_t((w >> (c.bits * (n % pf))) & maxq);
      zeros[size_t(g * N + n)] = z;
      symmetric = symmetric && z == mid;
    }
  if (c.bits == 8 && !symmetric)
    throw ValueError(ws.path + ": GPTQ module '" + module +
                     "' is asymmetric 8-bit (a zero other than 128 in qzeros), which ferrum does not read yet");
  // Codes [N, K], row by row as the block type stores them.
  std::vector<uint8_t> q(size_t(N * K));
  for (int64_t r = 0; r < K / pf; ++r)
    for (int64_t n = 0; n < N; ++n) {
      const uint32_t w = word(qw, r * N + n);
      for (int i = 0; i < pf; ++i) q[size_t(n * K + r * pf + i)] = uint8_t((w >> (c.bits * i)) & maxq);
    }

  const DType dtype = c.bits == 8 ? DType::Q8_0 : symmetric ? DType::Q4_0 : DType::Q5_0;
  const int64_t blocks = K / kBlock;
  const size_t row_bytes = dtype_bytes(dtype, K);
  auto home = MappedFile::anonymous(ws.path + ": " + out_name + " (from GPTQ)", row_bytes * size_t(N));
  char* out = home->writable();
  for (int64_t n = 0; n < N; ++n) {
    const uint8_t* qn = q.data() + n * K;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t g = b * kBlock / gs;
      uint16_t d;
      std::memcpy(&d, sc.data + 2 * (g * N + n), 2);
      const int z = zeros[size_t(g * N + n)];
      const uint8_t* v = qn + b * kBlock;
      char* dst = out + size_t(n) * row_bytes + size_t(b) * dtype_bytes(dtype, kBlock);
      if (dtype == DType::Q4_0) {
        quant::BlockQ4_0 blk;
        blk.d = d;
        for (int j = 0; j < kBlock / 2; ++j) blk.qs[j] = uint8_t(v[j] | (v[j + kBlock / 2] << 4));
        std::memcpy(dst, &blk, sizeof blk);
      } else if (dtype == DType::Q5_0) {
        quant::BlockQ5_0 blk;
        blk.d = d;
        uint32_t qh = 0;
        uint8_t u[kBlock];
        for (int j = 0; j < kBlock; ++j) {
          u[j] = uint8_t(int(v[j]) - z + 16);  // 1..31
          qh |= uint32_t(u[j] >> 4) << j;
        }
        for (int j = 0; j < kBlock / 2; ++j) blk.qs[j] = uint8_t((u[j] & 15) | ((u[j + kBlock / 2] & 15) << 4));
        std::memcpy(blk.qh, &qh, 4);
        std::memcpy(dst, &blk, sizeof blk);
      } else {
        quant::BlockQ8_0 blk;
        blk.d = d;
        for (int j = 0; j < kBlock; ++j) blk.qs[j] = int8_t(int(v[j]) - 128);
        std::memcpy(dst, &blk, sizeof blk);
      }
    }
  }

  for (const std::string& suffix : {".qweight", ".qzeros", ".scales", ".g_idx"}) {
    auto it = ws.tensors.find(module + suffix);
    if (it == ws.tensors.end()) continue;
    it->second.file->release_pages(it->second.data, it->second.nbytes);
    ws.tensors.erase(it);
  }
  TensorInfo t;
  t.name = out_name;
  t.dtype = dtype;
  t.shape = {N, K};
  t.data = home->data();
  t.nbytes = home->size();
  t.file = home;
  ws.tensors[out_name] = std::move(t);
}

}  // namespace

void translate_quantized_weights(const std::string& dir, WeightSource& ws) {
  std::optional<json> q;
  std::string where;
  if (auto cfg = read_json_file(dir + "/config.json"); cfg && cfg->is_object() && cfg->contains("quantization_config")) {
    q = (*cfg)["quantization_config"];
    where = dir + "/config.json: quantization_config";
  } else if (auto qc = read_json_file(dir + "/quantize_config.json")) {
    q = std::move(qc);
    where = dir + "/quantize_config.json";
  }
  std::vector<std::string> modules;
  const std::string suffix = ".qweight";
  for (const auto& [name, t] : ws.tensors)
    if (name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0)
      modules.push_back(name.substr(0, name.size() - suffix.size()));
  if (!q) {
    if (!modules.empty())
      throw ValueError(ws.path + ": tensor '" + modules[0] + suffix +
                       "' is GPTQ-packed but there is no quantization_config (config.json) or quantize_config.json");
    return;
  }
  const GptqConfig c = parse_config(*q, where);
  for (const std::string& m : modules) translate_module(ws, m, c);
}

}  // namespace ferrum
