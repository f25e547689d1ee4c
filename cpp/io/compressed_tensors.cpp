#include "io/compressed_tensors.h"

#include <algorithm>
#include <cctype>
#include <cstring>
#include <map>
#include <regex>
#include <vector>

#include "core/error.h"
#include "io/group_quant.h"
#include "quant/formats.h"

namespace ferrum {

using json = nlohmann::json;

namespace {

constexpr int kBlock = quant::kQK;
constexpr const char* kMethod = "compressed-tensors";
const std::vector<std::string> kSuffixes = {".weight_packed", ".weight_scale", ".weight_zero_point",
                                            ".weight_shape", ".weight_g_idx"};

struct WeightScheme {
  std::string group;  // its config_groups key, for messages
  int bits = 4;
  bool symmetric = true;
  int64_t group_size = 0;  // 0: the channel strategy, one group over all of K
};

// A config_groups target or an `ignore` entry: "re:<regex>", a module's full name, or "Linear"
// (the class every packed module is).
struct Target {
  std::string text;
  bool is_regex = false;
  std::regex re;
};

struct CtConfig {
  std::string where;
  std::vector<std::pair<Target, const WeightScheme*>> targets;  // compressed-tensors' match order
  std::vector<Target> ignore;
  std::map<std::string, WeightScheme> schemes;  // by group name
};

bool is_linear_class(const std::string& t) { return t == "Linear" || t == "LinearBase"; }

Target make_target(const std::string& text, const std::string& field) {
  Target t;
  t.text = text;
  t.is_regex = text.rfind("re:", 0) == 0;
  if (t.is_regex) {
    try {
      t.re = std::regex(text.substr(3));
    } catch (const std::regex_error&) {
      throw ValueError(field + " entry '" + text + "' is not a regular expression ferrum reads");
    }
  }
  return t;
}

bool matches_name(const Target& t, const std::string& module) {
  // compressed-tensors uses Python's re.match: anchored at the start only.
  if (t.is_regex) return std::regex_search(module, t.re, std::regex_constants::match_continuous);
  return t.text == module;
}

std::vector<std::string> string_list(const json& q, const char* key, const std::string& where) {
  std::vector<std::string> out;
  const json* v = config_field(q, key);
  if (!v) return out;
  if (!v->is_array()) throw ValueError(where + " '" + key + "' must be a list, not " + v->dump());
  for (const json& e : *v) {
    if (!e.is_string()) throw ValueError(where + " '" + key + "' entries must be strings, not " + e.dump());
    out.push_back(e.get<std::string>());
  }
  return out;
}

void require_null(const json& q, const char* key, const std::string& where, const char* what) {
  if (const json* v = config_field(q, key); v && !(v->is_object() && v->empty()))
    throw ValueError(where + " '" + key + "' is set (" + what + "), which ferrum does not read");
}

WeightScheme parse_weights(const json& w, const std::string& where) {
  WeightScheme s;
  if (!w.is_object()) throw ValueError(where + " must be a JSON object, not " + w.dump());
  const std::string type = config_string(w, "type", "int", where);
  if (type != "int") throw ValueError(where + " 'type' is '" + type + "': ferrum reads integer weights only");
  s.bits = int(config_int(w, "num_bits", 8, where));
  if (s.bits != 4 && s.bits != 8)
    throw ValueError(where + " 'num_bits' is " + std::to_string(s.bits) + ": ferrum reads 4- and 8-bit weights only");
  s.symmetric = config_bool(w, "symmetric", true, where);
  // compressed-tensors infers a missing strategy the same way.
  const std::string strategy =
      config_string(w, "strategy", config_field(w, "group_size") ? "group" : "tensor", where);
  if (strategy == "group") {
    s.group_size = config_int(w, "group_size", 0, where);
    if (s.group_size <= 0 || s.group_size % kBlock != 0)
      throw ValueError(where + " 'group_size' is " + std::to_string(s.group_size) +
                       ": ferrum reads a multiple of " + std::to_string(kBlock));
  } else if (strategy != "channel") {
    throw ValueError(where + " 'strategy' is '" + strategy + "': ferrum reads 'group' and 'channel'");
  }
  if (const json* d = config_field(w, "dynamic"); d && *d != json(false))
    throw ValueError(where + " 'dynamic' is " + d->dump() + ": ferrum reads static weight scales only");
  require_null(w, "block_structure", where, "block quantization");
  // actorder changes only how the scales were found, except "group", whose older files carry a
  // weight_g_idx: that is checked against group order per module.
  if (const json* a = config_field(w, "actorder"); a && !a->is_boolean()) {
    const std::string v = config_string(w, "actorder", "", where);
    if (v != "weight" && v != "static" && v != "group" && v != "dynamic")
      throw ValueError(where + " 'actorder' is '" + v + "', which ferrum does not know");
  }
  return s;
}

CtConfig parse_config(const json& q, const std::string& where) {
  CtConfig c;
  c.where = where;
  if (!config_field(q, "format")) throw ValueError(where + " has no 'format'");
  const std::string format = config_string(q, "format", "", where);
  if (format != "pack-quantized" && format != "mixed-precision")
    throw ValueError(where + " 'format' is '" + format + "': ferrum reads compressed-tensors' 'pack-quantized' only");
  const std::string status = config_string(q, "quantization_status", "compressed", where);
  if (status != "compressed")
    throw ValueError(where + " 'quantization_status' is '" + status + "': ferrum reads 'compressed' checkpoints only");
  require_null(q, "kv_cache_scheme", where, "kv-cache quantization");
  require_null(q, "sparsity_config", where, "sparsity");
  require_null(q, "transform_config", where, "weight transforms");
  const json* groups = config_field(q, "config_groups");
  if (!groups || !groups->is_object() || groups->empty())
    throw ValueError(where + " 'config_groups' must be a non-empty JSON object");
  std::map<std::string, std::string> group_of_target;
  for (const auto& [name, g] : groups->items()) {
    const std::string gw = where + " config_groups '" + name + "'";
    if (!g.is_object()) throw ValueError(gw + " must be a JSON object, not " + g.dump());
    const std::string gformat = config_string(g, "format", format, gw);
    if (gformat != "pack-quantized")
      throw ValueError(gw + " 'format' is '" + gformat + "': ferrum reads 'pack-quantized' only");
    require_null(g, "input_activations", gw, "activation quantization");
    require_null(g, "output_activations", gw, "activation quantization");
    const json* w = config_field(g, "weights");
    if (!w) throw ValueError(gw + " has no 'weights'");
    WeightScheme s = parse_weights(*w, gw + " weights");
    s.group = name;
    c.schemes[name] = s;
    const std::vector<std::string> targets = string_list(g, "targets", gw);
    if (targets.empty()) throw ValueError(gw + " 'targets' is empty");
    for (const std::string& t : targets) {
      // Only Linear modules are packed here; a module's class is not in the file, so a target
      // naming another class (say Embedding) could not be told from "Linear".
      const bool class_like = t.rfind("re:", 0) != 0 && t.find('.') == std::string::npos && !t.empty() &&
                              std::isupper(static_cast<unsigned char>(t[0]));
      if (class_like && !is_linear_class(t))
        throw ValueError(gw + " 'targets' entry '" + t + "' names a module class other than Linear, which ferrum "
                         "does not match");
      // The library lets the later group win; a file that relies on that is refused.
      if (auto [it, fresh] = group_of_target.emplace(t, name); !fresh)
        throw ValueError(where + " target '" + t + "' is in both config_groups '" + it->second + "' and '" + name + "'");
    }
  }
  // compressed-tensors' match order: names and regexes sorted (names first), then classes.
  std::vector<std::string> sorted;
  for (const auto& [t, g] : group_of_target) sorted.push_back(t);
  std::sort(sorted.begin(), sorted.end(), [](const std::string& a, const std::string& b) {
    const bool ra = a.find("re:") != std::string::npos, rb = b.find("re:") != std::string::npos;
    return ra != rb ? rb : a < b;
  });
  for (const std::string& t : sorted)
    c.targets.emplace_back(make_target(t, where + " config_groups '" + group_of_target[t] + "' 'targets'"),
                           &c.schemes[group_of_target[t]]);
  for (const std::string& t : string_list(q, "ignore", where)) c.ignore.push_back(make_target(t, where + " 'ignore'"));
  return c;
}

const WeightScheme* scheme_of(const CtConfig& c, const std::string& module, const WeightSource& ws) {
  for (const Target& t : c.ignore)
    if (matches_name(t, module) || is_linear_class(t.text))
      throw ValueError(ws.path + ": module '" + module + "' is packed but " + c.where + " 'ignore' lists it ('" +
                       t.text + "')");
  for (const auto& [t, s] : c.targets)
    if (matches_name(t, module)) return s;
  for (const auto& [t, s] : c.targets)
    if (is_linear_class(t.text)) return s;
  throw ValueError(ws.path + ": module '" + module + "' is packed but no " + c.where +
                   " config_groups target matches it");
}

uint16_t scale_f16(const WeightSource& ws, const TensorInfo& sc, int64_t i) {
  float f;
  uint16_t h;
  if (sc.dtype == DType::F32) {
    std::memcpy(&f, sc.data + 4 * i, 4);
  } else {
    std::memcpy(&h, sc.data + 2 * i, 2);
    if (sc.dtype == DType::F16) return h;
    f = bf16_to_f32(h);
  }
  h = f32_to_f16(f);
  if (f16_to_f32(h) != f)
    throw ValueError(ws.path + ": compressed-tensors tensor '" + sc.name + "' entry " + std::to_string(i) + " (" +
                     std::to_string(f) + ") is a scale that f16 does not hold exactly");
  return h;
}

void translate_module(WeightSource& ws, const std::string& module, const WeightScheme& s, const CtConfig& c) {
  const std::string what = ws.path + ": compressed-tensors tensor '" + module;
  const std::string packed_name = module + ".weight_packed";
  const TensorInfo& packed = ws.tensors.at(packed_name);
  if (packed.dtype != DType::I32 || packed.shape.size() != 2)
    throw ValueError(what + ".weight_packed' must be a 2-D I32 tensor, not " + dtype_name(packed.dtype) + " " +
                     shape_str(packed.shape));
  const TensorInfo* shape_t = ws.find(module + ".weight_shape");
  if (!shape_t) throw ValueError(what + ".weight_shape' is missing");
  if (shape_t->shape != Shape{2} || (shape_t->dtype != DType::I64 && shape_t->dtype != DType::I32))
    throw ValueError(what + ".weight_shape' must be two integers, not " + dtype_name(shape_t->dtype) + " " +
                     shape_str(shape_t->shape));
  int64_t NK[2];
  for (int i = 0; i < 2; ++i) {
    if (shape_t->dtype == DType::I64) {
      std::memcpy(&NK[i], shape_t->data + 8 * i, 8);
    } else {
      NK[i] = int32_t(packed_word(*shape_t, i));
    }
  }
  const int64_t N = NK[0], K = NK[1];
  if (N <= 0 || K <= 0 || K % kBlock != 0)
    throw ValueError(what + ".weight_shape' is [" + std::to_string(N) + ", " + std::to_string(K) +
                     "]: ferrum reads a positive number of inputs that is a multiple of " + std::to_string(kBlock));
  const int pf = 32 / s.bits;
  const uint32_t maxq = (1u << s.bits) - 1;
  const std::string scheme = "config group '" + s.group + "', " + std::to_string(s.bits) + "-bit";
  packed_tensor(ws, packed_name, DType::I32, {N, K / pf}, scheme + " codes of weight_shape " + shape_str({N, K}), kMethod);

  GroupCodes codes;
  codes.bits = s.bits;
  codes.N = N;
  codes.K = K;
  codes.group_size = s.group_size ? s.group_size : K;
  const int64_t G = codes.groups();
  const std::string groups = scheme + ", " + std::to_string(G) + " groups of " + std::to_string(codes.group_size) +
                             " of " + std::to_string(K) + " inputs, " + std::to_string(N) + " outputs";
  const std::string scale_name = module + ".weight_scale";
  const TensorInfo* sc_any = ws.find(scale_name);
  const DType sc_dtype = sc_any && (sc_any->dtype == DType::BF16 || sc_any->dtype == DType::F32) ? sc_any->dtype
                                                                                                 : DType::F16;
  const TensorInfo& sc = packed_tensor(ws, scale_name, sc_dtype, {N, G}, groups, kMethod);
  if (ws.find(module + ".weight"))
    throw ValueError(ws.path + ": module '" + module + "' has both a float 'weight' and a compressed-tensors 'weight_packed'");

  const std::string gi_name = module + ".weight_g_idx";
  if (const TensorInfo* gi = ws.find(gi_name)) {
    packed_tensor(ws, gi_name, DType::I32, {K}, "one group index per input", kMethod);
    for (int64_t k = 0; k < K; ++k) {
      const int32_t g = int32_t(packed_word(*gi, k));
      if (g < 0 || g >= G)
        throw ValueError(what + ".weight_g_idx' entry " + std::to_string(k) + " is " + std::to_string(g) +
                         ", outside the " + std::to_string(G) + " groups");
      if (g != k / codes.group_size)
        throw ValueError(what + ".weight_g_idx' orders inputs out of group order (actorder 'group'), which ferrum "
                         "does not read yet");
    }
  }

  codes.scales.resize(size_t(N * G));
  for (int64_t i = 0; i < N * G; ++i) codes.scales[size_t(i)] = scale_f16(ws, sc, i);
  const std::string zp_name = module + ".weight_zero_point";
  codes.zeros.assign(size_t(N * G), uint8_t(1u << (s.bits - 1)));
  if (s.symmetric) {
    if (ws.find(zp_name))
      throw ValueError(what + ".weight_zero_point' is present but " + c.where + " config group '" + s.group +
                       "' is symmetric");
  } else {
    if (N % pf != 0)
      throw ValueError(ws.path + ": compressed-tensors module '" + module + "' has " + std::to_string(N) +
                       " outputs, which weight_zero_point cannot pack by " + std::to_string(pf));
    const TensorInfo& zp = packed_tensor(ws, zp_name, DType::I32, {N / pf, G}, groups, kMethod);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t g = 0; g < G; ++g)
        codes.zeros[size_t(n * G + g)] = uint8_t((packed_word(zp, (n / pf) * G + g) >> (s.bits * (n % pf))) & maxq);
  }
  codes.q.resize(size_t(N * K));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t w = 0; w < K / pf; ++w) {
      const uint32_t word = packed_word(packed, n * (K / pf) + w);
      for (int i = 0; i < pf; ++i) codes.q[size_t(n * K + w * pf + i)] = uint8_t((word >> (s.bits * i)) & maxq);
    }
  store_as_blocks(ws, module, codes, kMethod, kSuffixes);
}

}  // namespace

void translate_compressed_tensors_weights(const json& q, const std::string& where, WeightSource& ws) {
  const CtConfig c = parse_config(q, where);
  std::vector<std::string> modules;
  const std::string suffix = ".weight_packed";
  for (const auto& [name, t] : ws.tensors)
    if (name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0)
      modules.push_back(name.substr(0, name.size() - suffix.size()));
  for (const std::string& m : modules) translate_module(ws, m, *scheme_of(c, m, ws), c);
  // A scale or shape without codes is a module the config quantized but the file lost.
  for (const auto& [name, t] : ws.tensors)
    for (const std::string& s : kSuffixes)
      if (name.size() > s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0)
        throw ValueError(ws.path + ": compressed-tensors tensor '" + name + "' has no '" +
                         name.substr(0, name.size() - s.size()) + ".weight_packed' beside it");
}

}  // namespace ferrum
