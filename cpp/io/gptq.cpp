#include "io/gptq.h"

#include <cstring>
#include <fstream>
#include <iterator>
#include <optional>
#include <regex>
#include <vector>

#include "core/error.h"
#include "io/awq.h"
#include "io/compressed_tensors.h"
#include "io/group_quant.h"
#include "io/json_strict.h"
#include "quant/formats.h"

namespace ferrum {

using json = nlohmann::json;

namespace {

std::optional<std::string> read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in.good()) return std::nullopt;
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

std::optional<json> read_json_file(const std::string& path) {
  const std::optional<std::string> text = read_text(path);
  if (!text) return std::nullopt;
  return parse_json_strict(text->data(), text->data() + text->size(), path);
}

constexpr int kBlock = quant::kQK;

struct GptqConfig {
  std::string where;  // "<file>: quantization_config", for messages
  int bits = 4;
  int64_t group_size = 128;  // -1: one group per row
  bool v1 = true;            // checkpoint_format gptq: zeros stored as z - 1
};

// GPTQModel's `dynamic`: per-module overrides, the first pattern (in order) that matches the
// module's name from its start deciding: "-:pattern" leaves the module in float, "+:pattern" or
// "pattern" overrides the config's fields for it.
struct DynamicRule {
  std::string pattern;
  std::regex re;
  bool skip = false;
  json overrides;
};

void check_bits_and_group(const GptqConfig& c) {
  if (c.bits != 4 && c.bits != 8)
    throw ValueError(c.where + " 'bits' is " + std::to_string(c.bits) + ": ferrum reads 4- and 8-bit GPTQ only");
  if (c.group_size != -1 && (c.group_size <= 0 || c.group_size % kBlock != 0))
    throw ValueError(c.where + " 'group_size' is " + std::to_string(c.group_size) +
                     ": ferrum reads -1 or a multiple of " + std::to_string(kBlock));
}

// `dynamic` of the quantization config q read from `file` (nested under quantization_config
// when `nested`), its patterns in the file's order (json objects sort their keys).
std::vector<DynamicRule> parse_dynamic(const json& q, const std::string& where, const std::string& file, bool nested) {
  std::vector<DynamicRule> rules;
  const json* d = config_field(q, "dynamic");
  if (!d) return rules;
  if (!d->is_object()) throw ValueError(where + " 'dynamic' must be an object of module patterns");
  const nlohmann::ordered_json doc = nlohmann::ordered_json::parse(*read_text(file));  // already read strictly
  const nlohmann::ordered_json& in_order = nested ? doc.at("quantization_config").at("dynamic") : doc.at("dynamic");
  for (const auto& [key, ignored] : in_order.items()) {
    const json& value = d->at(key);
    DynamicRule r;
    r.pattern = key;
    r.skip = key.rfind("-:", 0) == 0;
    const std::string raw = key.rfind("-:", 0) == 0 || key.rfind("+:", 0) == 0 ? key.substr(2) : key;
    try {
      r.re = std::regex(raw, std::regex::ECMAScript);
    } catch (const std::regex_error& e) {
      throw ValueError(where + " 'dynamic' pattern '" + key + "' is not a regular expression (" + e.what() + ")");
    }
    if (!value.is_object()) throw ValueError(where + " 'dynamic' entry '" + key + "' must be an object");
    r.overrides = value;
    rules.push_back(std::move(r));
  }
  return rules;
}

// The rule deciding for `module`, or null.
const DynamicRule* dynamic_rule(const std::vector<DynamicRule>& rules, const std::string& module) {
  for (const DynamicRule& r : rules)
    if (std::regex_search(module, r.re, std::regex_constants::match_continuous)) return &r;
  return nullptr;
}

GptqConfig parse_config(const json& q, const std::string& where) {
  GptqConfig c;
  c.where = where;
  // GPTQModel writes `format`, AutoGPTQ `checkpoint_format`.
  const std::string format =
      config_string(q, "checkpoint_format", config_string(q, "format", "gptq", where), where);
  if (format != "gptq" && format != "gptq_v2")
    throw ValueError(where + " checkpoint format '" + format + "' is not supported (ferrum reads 'gptq' and 'gptq_v2')");
  c.v1 = format == "gptq";
  c.bits = int(config_int(q, "bits", 4, where));
  c.group_size = config_int(q, "group_size", 128, where);
  check_bits_and_group(c);
  const std::string pack_dtype = config_string(q, "pack_dtype", "int32", where);
  if (pack_dtype != "int32")
    throw ValueError(where + " 'pack_dtype' is '" + pack_dtype + "': ferrum reads int32 packing only");
  return c;
}

// The config for one module: the rule's overrides of bits and group size (the others it may
// set steer how GPTQModel quantized it; symmetry and act-order are read from the tensors).
GptqConfig module_config(const GptqConfig& base, const std::vector<DynamicRule>& rules, const std::string& module,
                         const WeightSource& ws) {
  const DynamicRule* r = dynamic_rule(rules, module);
  if (!r) return base;
  if (r->skip)
    throw ValueError(ws.path + ": module '" + module + "' has a 'qweight' but 'dynamic' rule '" + r->pattern +
                     "' leaves it unquantized");
  GptqConfig c = base;
  c.where = base.where + " 'dynamic' rule '" + r->pattern + "':";
  c.bits = int(config_int(r->overrides, "bits", base.bits, c.where));
  c.group_size = config_int(r->overrides, "group_size", base.group_size, c.where);
  check_bits_and_group(c);
  return c;
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
  const TensorInfo& sc = packed_tensor(ws, module + ".scales", DType::F16, {G, N}, groups, "GPTQ");
  const TensorInfo& qz = packed_tensor(ws, module + ".qzeros", DType::I32, {G, N / pf}, groups, "GPTQ");
  // Act-order (desc_act) is read from g_idx itself: inputs out of group order.
  const std::string gi_name = module + ".g_idx";
  std::vector<int32_t> g_idx;
  bool act_order = false;
  if (const TensorInfo* gi = ws.find(gi_name)) {
    packed_tensor(ws, gi_name, DType::I32, {K}, "one group index per input", "GPTQ");
    g_idx.resize(size_t(K));
    for (int64_t k = 0; k < K; ++k) {
      const int32_t g = int32_t(packed_word(*gi, k));
      if (g < 0 || g >= G)
        throw ValueError(ws.path + ": GPTQ tensor '" + gi_name + "' entry " + std::to_string(k) + " is " +
                         std::to_string(g) + ", outside the " + std::to_string(G) + " groups");
      g_idx[size_t(k)] = g;
      act_order = act_order || g != k / gs;
    }
  }
  const std::string out_name = module + ".weight";
  if (ws.find(out_name))
    throw ValueError(ws.path + ": module '" + module + "' has both a float 'weight' and a GPTQ 'qweight'");

  // Zeros, unpacked; v1 stores z - 1 with the borrow carried across the word (GPTQModel's v2 ->
  // v1 conversion subtracts 0x11111111 from the whole word), so the whole word is added back.
  const uint32_t v1_offset = c.bits == 4 ? 0x11111111u : 0x01010101u;
  GroupCodes codes;
  codes.bits = c.bits;
  codes.N = N;
  codes.K = K;
  codes.group_size = gs;
  codes.zeros.resize(size_t(N * G));
  codes.scales.resize(size_t(N * G));
  for (int64_t g = 0; g < G; ++g)
    for (int64_t n = 0; n < N; ++n) {
      const uint32_t w = packed_word(qz, g * (N / pf) + n / pf) + (c.v1 ? v1_offset : 0u);
      codes.zeros[size_t(n * G + g)] = uint8_t((w >> (c.bits * (n % pf))) & maxq);
      std::memcpy(&codes.scales[size_t(n * G + g)], sc.data + 2 * (g * N + n), 2);
    }
  codes.q.resize(size_t(N * K));
  for (int64_t r = 0; r < K / pf; ++r)
    for (int64_t n = 0; n < N; ++n) {
      const uint32_t w = packed_word(qw, r * N + n);
      for (int i = 0; i < pf; ++i) codes.q[size_t(n * K + r * pf + i)] = uint8_t((w >> (c.bits * i)) & maxq);
    }
  if (act_order) group_inputs(codes, g_idx, ws.path + ": GPTQ", gi_name);
  store_as_blocks(ws, module, codes, "GPTQ", {".qweight", ".qzeros", ".scales", ".g_idx"});
}

}  // namespace

void translate_quantized_weights(const std::string& dir, WeightSource& ws) {
  std::optional<json> q;
  std::string where, method_fallback = "gptq", file;
  if (auto cfg = read_json_file(dir + "/config.json"); cfg && cfg->is_object() && cfg->contains("quantization_config")) {
    q = (*cfg)["quantization_config"];
    where = dir + "/config.json: quantization_config";
    file = dir + "/config.json";
  } else if (auto qc = read_json_file(dir + "/quantize_config.json")) {
    q = std::move(qc);
    where = dir + "/quantize_config.json";
    file = where;
  } else if (auto ac = read_json_file(dir + "/quant_config.json")) {
    // AutoAWQ's own file, which names no quant_method.
    q = std::move(ac);
    where = dir + "/quant_config.json";
    method_fallback = "awq";
  }
  std::vector<std::string> modules;
  const std::string suffix = ".qweight";
  for (const auto& [name, t] : ws.tensors)
    if (name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0)
      modules.push_back(name.substr(0, name.size() - suffix.size()));
  if (!q) {
    std::string packed = modules.empty() ? "" : modules[0] + suffix;
    for (const auto& [name, t] : ws.tensors)
      if (packed.empty() && name.size() > 14 && name.compare(name.size() - 14, 14, ".weight_packed") == 0) packed = name;
    if (!packed.empty())
      throw ValueError(ws.path + ": tensor '" + packed +
                       "' is packed (GPTQ / AWQ / compressed-tensors) but there is no quantization_config "
                       "(config.json), quantize_config.json or quant_config.json");
    return;
  }
  if (!q->is_object()) throw ValueError(where + " is not a JSON object");
  const std::string method = config_string(*q, "quant_method", method_fallback, where);
  if (method == "awq") {
    translate_awq_weights(*q, where, modules, ws);
    return;
  }
  if (method == "compressed-tensors") {
    if (!modules.empty())
      throw ValueError(ws.path + ": tensor '" + modules[0] + suffix + "' is GPTQ / AWQ-packed but " + where +
                       " 'quant_method' is 'compressed-tensors'");
    translate_compressed_tensors_weights(*q, where, ws);
    return;
  }
  if (method != "gptq")
    throw ValueError(where + " 'quant_method' is '" + method +
                     "', which ferrum does not read (it reads 'gptq', 'awq' and 'compressed-tensors')");
  const GptqConfig c = parse_config(*q, where);
  const std::vector<DynamicRule> rules = parse_dynamic(*q, where, file, file == dir + "/config.json");
  for (const std::string& m : modules) translate_module(ws, m, module_config(c, rules, m, ws));
}

}  // namespace ferrum
