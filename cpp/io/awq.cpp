#include "io/awq.h"

#include <algorithm>
#include <cctype>
#include <cstring>
#include <regex>

#include "core/error.h"
#include "io/group_quant.h"
#include "quant/formats.h"

namespace ferrum {

using json = nlohmann::json;

namespace {

constexpr int kBlock = quant::kQK;
constexpr int kPack = 8;  // 4-bit codes in an int32
// Where output column n % 8 sits in a gemm word (the inverse of AWQ's order 0 2 4 6 1 3 5 7).
constexpr int kGemmNibble[kPack] = {0, 4, 1, 5, 2, 6, 3, 7};

struct AwqConfig {
  std::string where;
  bool gemv = false;
  int64_t group_size = 128;  // -1: one group per row
  std::vector<std::string> not_convert;
};

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  return s;
}

AwqConfig parse_config(const json& q, const std::string& where) {
  AwqConfig c;
  c.where = where;
  // AutoAWQ and transformers write `version` (AutoAWQ in capitals), GPTQModel `format` as well.
  std::string version;
  const char* version_key = nullptr;
  for (const char* key : {"version", "format", "checkpoint_format"}) {
    if (!config_field(q, key)) continue;
    const std::string v = lower(config_string(q, key, "", where));
    if (!version_key) {
      version = v;
      version_key = key;
    } else if (v != version) {
      throw ValueError(where + " '" + version_key + "' is '" + version + "' but '" + key + "' is '" + v + "'");
    }
  }
  if (!version_key) version = "gemm";
  if (version != "gemm" && version != "gemv")
    throw ValueError(where + " AWQ version '" + version + "' is not supported (ferrum reads 'gemm' and 'gemv')");
  c.gemv = version == "gemv";
  if (lower(config_string(q, "backend", "", where)) == "llm-awq")
    throw ValueError(where + " 'backend' is 'llm-awq', whose packing ferrum does not read");
  const int64_t bits = config_int(q, "bits", config_int(q, "w_bit", 4, where), where);
  if (bits != 4) throw ValueError(where + " 'bits' is " + std::to_string(bits) + ": ferrum reads 4-bit AWQ only");
  c.group_size = config_int(q, "group_size", config_int(q, "q_group_size", 128, where), where);
  if (c.group_size != -1 && (c.group_size <= 0 || c.group_size % kBlock != 0))
    throw ValueError(where + " 'group_size' is " + std::to_string(c.group_size) +
                     ": ferrum reads -1 or a multiple of " + std::to_string(kBlock));
  // Symmetry is read from the zeros themselves, as the AWQ kernels use qzeros either way.
  config_bool(q, "zero_point", true, where);
  const std::string pack_dtype = config_string(q, "pack_dtype", "int32", where);
  if (pack_dtype != "int32")
    throw ValueError(where + " 'pack_dtype' is '" + pack_dtype + "': ferrum reads int32 packing only");
  if (const json* d = config_field(q, "dynamic"); d && !(d->is_object() && d->empty()))
    throw ValueError(where + " 'dynamic' (per-module overrides) is not supported yet");
  if (const json* m = config_field(q, "modules_to_not_convert")) {
    if (!m->is_array()) throw ValueError(where + " 'modules_to_not_convert' must be a list, not " + m->dump());
    for (const json& e : *m) {
      if (!e.is_string())
        throw ValueError(where + " 'modules_to_not_convert' entries must be strings, not " + e.dump());
      c.not_convert.push_back(e.get<std::string>());
    }
  }
  return c;
}

// transformers' rule (should_convert_module): `key` names the module as a suffix, or as a
// regex matching a prefix of the name up to a '.' boundary.
bool names_module(const std::string& key, const std::string& module, const std::string& where) {
  if (module.size() >= key.size() && module.compare(module.size() - key.size(), key.size(), key) == 0) return true;
  std::regex re;
  try {
    re = std::regex("(?:" + key + ")");
  } catch (const std::regex_error&) {
    throw ValueError(where + " 'modules_to_not_convert' entry '" + key + "' is not a regular expression");
  }
  for (size_t len = 0; len <= module.size(); ++len) {
    const bool boundary = (len > 0 && module[len - 1] == '.') || len == module.size() || module[len] == '.';
    if (boundary && std::regex_match(module.begin(), module.begin() + std::ptrdiff_t(len), re)) return true;
  }
  return false;
}

// Words of zeros per output row in a gemv file: AutoAWQ's calculate_zeros_width.
int64_t gemv_zero_words(int64_t K, int64_t gs, const std::string& where) {
  const int64_t multiplier = gs >= 128 ? 1 : gs == 64 ? 2 : gs == 32 ? 4 : 0;
  if (!multiplier)
    throw ValueError(where + " 'group_size' is " + std::to_string(gs) +
                     ": the gemv version packs groups of 32, 64 or at least 128 only");
  const int64_t words = (K / gs + kPack - 1) / kPack;
  return (words + multiplier - 1) / multiplier * multiplier;
}

// Scales are f16, or bf16 where the model was bf16 (GPTQModel keeps the model's dtype); a bf16
// scale is taken when f16 holds it exactly, and refused otherwise.
DType scales_dtype(const WeightSource& ws, const std::string& name) {
  const TensorInfo* t = ws.find(name);
  return t && t->dtype == DType::BF16 ? DType::BF16 : DType::F16;
}

uint16_t scale_f16(const WeightSource& ws, const TensorInfo& sc, int64_t i) {
  uint16_t h;
  std::memcpy(&h, sc.data + 2 * i, 2);
  if (sc.dtype == DType::F16) return h;
  const float f = bf16_to_f32(h);
  const uint16_t as_f16 = f32_to_f16(f);
  if (f16_to_f32(as_f16) != f)
    throw ValueError(ws.path + ": AWQ tensor '" + sc.name + "' entry " + std::to_string(i) + " (" +
                     std::to_string(f) + ") is a bf16 scale that f16 does not hold exactly");
  return as_f16;
}

void translate_module(WeightSource& ws, const std::string& module, const AwqConfig& c) {
  for (const std::string& key : c.not_convert)
    if (names_module(key, module, c.where))
      throw ValueError(ws.path + ": module '" + module + "' is AWQ-packed but " + c.where +
                       " 'modules_to_not_convert' lists it ('" + key + "')");
  const std::string qw_name = module + ".qweight";
  const TensorInfo& qw = ws.tensors.at(qw_name);
  if (qw.dtype != DType::I32 || qw.shape.size() != 2)
    throw ValueError(ws.path + ": AWQ tensor '" + qw_name + "' must be a 2-D I32 tensor, not " +
                     dtype_name(qw.dtype) + " " + shape_str(qw.shape));
  const int64_t K = c.gemv ? qw.shape[1] * kPack : qw.shape[0];
  const int64_t N = c.gemv ? qw.shape[0] : qw.shape[1] * kPack;
  if (K % kBlock != 0)
    throw ValueError(ws.path + ": AWQ tensor '" + qw_name + "' holds " + std::to_string(K) +
                     " input features, not a multiple of " + std::to_string(kBlock));
  GroupCodes codes;
  codes.N = N;
  codes.K = K;
  codes.group_size = c.group_size == -1 ? K : c.group_size;
  const int64_t G = codes.groups();
  const std::string groups = std::to_string(G) + " groups of " + std::to_string(codes.group_size) + " of " +
                             std::to_string(K) + " inputs, " + std::to_string(N) + " outputs";
  for (const char* extra : {".g_idx", ".weight"})
    if (ws.find(module + extra))
      throw ValueError(ws.path + ": AWQ module '" + module + "' has a '" + (extra + 1) + "' beside its 'qweight'");
  codes.q.resize(size_t(N * K));
  codes.zeros.resize(size_t(N * G));
  codes.scales.resize(size_t(N * G));
  if (!c.gemv) {
    const TensorInfo& sc =
        packed_tensor(ws, module + ".scales", scales_dtype(ws, module + ".scales"), {G, N}, groups, "AWQ");
    const TensorInfo& qz = packed_tensor(ws, module + ".qzeros", DType::I32, {G, N / kPack}, groups, "AWQ");
    for (int64_t g = 0; g < G; ++g)
      for (int64_t n = 0; n < N; ++n) {
        const uint32_t w = packed_word(qz, g * (N / kPack) + n / kPack);
        codes.zeros[size_t(n * G + g)] = uint8_t((w >> (4 * kGemmNibble[n % kPack])) & 15);
        codes.scales[size_t(n * G + g)] = scale_f16(ws, sc, g * N + n);
      }
    for (int64_t k = 0; k < K; ++k)
      for (int64_t n = 0; n < N; ++n) {
        const uint32_t w = packed_word(qw, k * (N / kPack) + n / kPack);
        codes.q[size_t(n * K + k)] = uint8_t((w >> (4 * kGemmNibble[n % kPack])) & 15);
      }
  } else {
    const int64_t W = gemv_zero_words(K, codes.group_size, c.where);
    if (W * kPack < G)
      throw ValueError(ws.path + ": AWQ module '" + module + "' has " + std::to_string(G) +
                       " groups, more than the gemv version's " + std::to_string(W * kPack) + " zeros hold");
    const TensorInfo& sc =
        packed_tensor(ws, module + ".scales", scales_dtype(ws, module + ".scales"), {N, W * kPack}, groups, "AWQ");
    const TensorInfo& qz = packed_tensor(ws, module + ".qzeros", DType::I32, {N, W}, groups, "AWQ");
    for (int64_t n = 0; n < N; ++n)
      for (int64_t g = 0; g < G; ++g) {
        const uint32_t w = packed_word(qz, n * W + g / kPack);
        codes.zeros[size_t(n * G + g)] = uint8_t((w >> (4 * (g % kPack))) & 15);
        codes.scales[size_t(n * G + g)] = scale_f16(ws, sc, n * W * kPack + g);
      }
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k) {
        const uint32_t w = packed_word(qw, n * (K / kPack) + k / kPack);
        codes.q[size_t(n * K + k)] = uint8_t((w >> (4 * (k % kPack))) & 15);
      }
  }
  store_as_blocks(ws, module, codes, "AWQ", {".qweight", ".qzeros", ".scales"});
}

}  // namespace

void translate_awq_weights(const json& q, const std::string& where, const std::vector<std::string>& modules,
                           WeightSource& ws) {
  const AwqConfig c = parse_config(q, where);
  for (const std::string& m : modules) translate_module(ws, m, c);
}

}  // namespace ferrum
