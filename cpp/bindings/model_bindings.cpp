// ModelRunner: a loaded model with its paged KV pool. The Engine drives it; step() is the direct
// way in for tests and tools.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>

#include "core/error.h"
#include "engine/model_runner.h"

namespace py = pybind11;

namespace ferrum::bindings {

namespace {
py::dict config_dict(const ModelConfig& c) {
  py::dict d;
  d["arch"] = c.arch;
  d["hidden_size"] = c.hidden;
  d["intermediate_size"] = c.intermediate;
  d["num_layers"] = c.layers;
  d["num_heads"] = c.heads;
  d["num_kv_heads"] = c.kv_heads;
  d["head_dim"] = c.head_dim;
  d["vocab_size"] = c.vocab;
  d["max_position_embeddings"] = c.max_positions;
  d["rms_norm_eps"] = c.rms_eps;
  d["rope_theta"] = c.rope_theta;
  d["rope_layout"] = c.rope_layout == RopeLayout::HalfSplit ? "half_split" : "interleaved";
  d["sliding_window"] = c.sliding_window;
  d["tie_word_embeddings"] = c.tie_embeddings;
  d["num_experts"] = c.experts;
  d["num_experts_per_tok"] = c.experts_per_token;
  d["moe_intermediate_size"] = c.expert_intermediate;
  d["norm_topk_prob"] = c.norm_topk_prob;
  std::vector<int64_t> moe_layers;
  for (int64_t l = 0; l < c.layers; ++l)
    if (c.is_moe_layer(l)) moe_layers.push_back(l);
  d["moe_layers"] = moe_layers;
  return d;
}

// `progress` outlives the constructor call it is used in.
RunnerOptions runner_options(const std::string& device, int num_threads, const std::string& kv_dtype,
                             int64_t max_model_len, int64_t kv_cache_tokens, int64_t kv_cache_bytes,
                             double kv_cache_fraction, bool prefix_cache, const py::object& progress,
                             std::shared_ptr<Communicator> group, int64_t max_loras = 0,
                             int64_t max_lora_rank = 16, int pipeline_stages = 1,
                             std::vector<int64_t> layer_partition = {}) {
  RunnerOptions o;
  o.max_loras = max_loras;
  o.max_lora_rank = max_lora_rank;
  o.device = device;
  o.num_threads = num_threads;
  o.kv_dtype = kv_dtype == "int8" ? DType::I8 : dtype_from_name(kv_dtype);
  o.max_model_len = max_model_len;
  o.kv_cache_tokens = kv_cache_tokens;
  if (kv_cache_bytes != 0) o.kv_cache_bytes = kv_cache_bytes;
  o.kv_cache_fraction = kv_cache_fraction;
  o.prefix_cache = prefix_cache;
  o.group = std::move(group);
  o.pipeline_stages = pipeline_stages;
  o.layer_partition = std::move(layer_partition);
  if (!progress.is_none())
    o.load_progress = [&progress](int64_t done, int64_t total) {
      py::gil_scoped_acquire gil;
      progress(done, total);
    };
  return o;
}

StepItem::Logits logits_mode(const std::string& s) {
  if (s == "last") return StepItem::Logits::Last;
  if (s == "all") return StepItem::Logits::All;
  if (s == "none") return StepItem::Logits::None;
  throw ValueError("logits must be 'last', 'all' or 'none', got '" + s + "'");
}
}  // namespace

void bind_model(py::module_& m) {
  py::class_<LoraAdapter, std::shared_ptr<LoraAdapter>>(m, "LoraAdapter",
                                                         "A LoRA adapter loaded for one ModelRunner.")
      .def_property_readonly("bytes", [](const LoraAdapter& a) { return a.bytes; })
      .def_property_readonly("cache_key", [](const LoraAdapter& a) { return a.cache_key; });
  py::class_<ModelRunner>(m, "ModelRunner")
      .def(py::init([](ModelFile& file, const std::string& device, int num_threads, const std::string& kv_dtype,
                       int64_t max_model_len, int64_t kv_cache_tokens, int64_t kv_cache_bytes, double kv_cache_fraction,
                       bool prefix_cache, const py::object& progress, std::shared_ptr<Communicator> group,
                       int64_t max_loras, int64_t max_lora_rank, int pipeline_stages,
                       std::vector<int64_t> layer_partition) {
             if (file.format.empty()) throw ValueError(file.path + ": this ModelFile was loaded already");
             RunnerOptions o = runner_options(device, num_threads, kv_dtype, max_model_len, kv_cache_tokens,
                                              kv_cache_bytes, kv_cache_fraction, prefix_cache, progress,
                                              std::move(group), max_loras, max_lora_rank, pipeline_stages,
                                              std::move(layer_partition));
             ModelFile taken = std::move(file);
             file.path = taken.path;  // what is left: a name for the error above
             file.format.clear();
             py::gil_scoped_release nogil;
             return std::make_unique<ModelRunner>(std::move(taken), o);
           }),
           py::arg("model_file"), py::arg("device") = "cpu", py::arg("num_threads") = 0,
           py::arg("kv_dtype") = "f16", py::arg("max_model_len") = 0, py::arg("kv_cache_tokens") = 0,
           py::arg("kv_cache_bytes") = 0, py::arg("kv_cache_fraction") = 0.0, py::arg("prefix_cache") = true,
           py::arg("progress") = py::none(), py::arg("group") = nullptr, py::arg("max_loras") = 0,
           py::arg("max_lora_rank") = 16, py::arg("pipeline_stages") = 1,
           py::arg("layer_partition") = std::vector<int64_t>{},
           "Loads the weights of an opened ModelFile (which is then used up). group: a tensor-parallel "
           "group (ferrum.dist) whose rank 0 this process is: each rank loads its share. max_loras > 0: "
           "steps may run up to that many LoRA adapters (of rank <= max_lora_rank) beside the base. "
           "pipeline_stages: the group's ranks form this many pipeline stages (layer_partition: layers "
           "per stage; empty: the cheapest split), each holding its layers.")
      .def(py::init([](const std::string& path, const std::string& device, int num_threads,
                       const std::string& kv_dtype, int64_t max_model_len, int64_t kv_cache_tokens,
                       int64_t kv_cache_bytes, double kv_cache_fraction, bool prefix_cache,
                       const py::object& progress) {
             RunnerOptions o = runner_options(device, num_threads, kv_dtype, max_model_len, kv_cache_tokens,
                                              kv_cache_bytes, kv_cache_fraction, prefix_cache, progress, nullptr);
             py::gil_scoped_release nogil;
             return std::make_unique<ModelRunner>(path, o);
           }),
           py::arg("path"), py::arg("device") = "cpu", py::arg("num_threads") = 0,
           py::arg("kv_dtype") = "f16", py::arg("max_model_len") = 0, py::arg("kv_cache_tokens") = 0,
           py::arg("kv_cache_bytes") = 0, py::arg("kv_cache_fraction") = 0.0, py::arg("prefix_cache") = true,
           py::arg("progress") = py::none())
      .def_property_readonly("config", [](const ModelRunner& r) { return config_dict(r.config()); })
      .def_property_readonly("format", &ModelRunner::format)
      .def_property_readonly("max_model_len", &ModelRunner::max_model_len)
      .def_property_readonly("block_size", &ModelRunner::block_size)
      .def_property_readonly("device", [](ModelRunner& r) { return r.backend().name(); })
      .def_property_readonly("max_loras", &ModelRunner::max_loras)
      .def_property_readonly("max_lora_rank", &ModelRunner::max_lora_rank)
      .def("make_lora",
           [](ModelRunner& r, const py::list& updates, uint64_t cache_key) {
             std::vector<LoraPart> parts;
             for (const py::handle& h : updates) {
               const py::tuple t = h.cast<py::tuple>();
               if (t.size() != 5) throw ValueError("a LoRA update is (site, a, b, out_col, scale)");
               LoraPart p;
               p.site = t[0].cast<int64_t>();
               // A stored matrix: (dtype name, (rows, cols), its raw bytes as a uint8 array).
               auto stored = [&](const py::handle& m, DType* dtype, std::vector<uint8_t>* bytes) {
                 const py::tuple mt = m.cast<py::tuple>();
                 if (mt.size() != 3) throw ValueError("a LoRA matrix is (dtype, (rows, cols), bytes)");
                 *dtype = dtype_from_name(mt[0].cast<std::string>());
                 const auto shape = mt[1].cast<std::pair<int64_t, int64_t>>();
                 const auto raw = mt[2].cast<py::array_t<uint8_t, py::array::c_style>>();
                 bytes->assign(raw.data(), raw.data() + raw.size());
                 return shape;
               };
               const auto a_shape = stored(t[1], &p.a_dtype, &p.a), b_shape = stored(t[2], &p.b_dtype, &p.b);
               if (a_shape.first != b_shape.second)
                 throw ValueError("LoRA update at site " + std::to_string(p.site) +
                                  ": A must be [rank, in] and B [out, rank]");
               p.rank = a_shape.first;
               p.n = b_shape.first;
               p.out_col = t[3].cast<int64_t>();
               p.scale = t[4].cast<float>();
               parts.push_back(std::move(p));
             }
             py::gil_scoped_release nogil;
             return std::const_pointer_cast<LoraAdapter>(r.make_lora(std::move(parts), cache_key));
           },
           py::arg("updates"), py::arg("cache_key"),
           "A LoRA adapter from its updates [(site, A [rank, in], B [out, rank], out_col, scale)], A and B "
           "each (dtype 'f32' | 'f16' | 'bf16' | 'q8_0', (rows, cols), raw bytes as a uint8 array), kept in "
           "that dtype: "
           "site = layer * 4 + (0 qkv, 1 o, 2 gate_up, 3 down), out_col the first column of the fused "
           "output it adds to. cache_key keys its prefix-cache blocks. ValueError for anything that does "
           "not fit the model.")
      .def("add_sequence", &ModelRunner::add_sequence)
      .def("release_sequence", &ModelRunner::release_sequence, py::arg("seq"))
      .def("sequence_length", &ModelRunner::sequence_length, py::arg("seq"))
      .def("set_replay", &ModelRunner::set_replay, py::arg("on"))
      .def("step", [](ModelRunner& r, const std::vector<std::tuple<int64_t, std::vector<int32_t>, std::string>>& items) {
        std::vector<StepItem> v;
        v.reserve(items.size());
        for (auto& [seq, toks, mode] : items) v.push_back(StepItem{seq, toks, logits_mode(mode)});
        int64_t rows = 0;
        std::vector<float> logits;
        {
          py::gil_scoped_release nogil;
          logits = r.step(v, &rows);
        }
        const int64_t vocab = r.config().vocab;
        py::array_t<float> out({rows, vocab});
        if (!logits.empty())  // memcpy from an empty vector's null data() is UB
          std::memcpy(out.mutable_data(), logits.data(), logits.size() * sizeof(float));
        return out;
      }, py::arg("items"),
         "items: [(seq, tokens, 'last'|'all'|'none')]. Appends the tokens and returns float32 logits "
         "[rows, vocab] for the rows asked for, in order ('all' rows computed as scoring: f32 activations). "
         "For tests and tools; the Engine drives the runner otherwise.")
      .def("stats", [](const ModelRunner& r) {
        RunnerStats s = r.stats();
        py::dict d;
        d["kv_blocks_total"] = s.kv_blocks_total;
        d["kv_blocks_used"] = s.kv_blocks_used;
        d["kv_blocks_free"] = s.kv_blocks_total - s.kv_blocks_used;
        d["kv_blocks_cached"] = s.kv_blocks_cached;
        d["block_size"] = s.block_size;
        d["sequences"] = s.sequences;
        d["prefix_queries"] = s.prefix_queries;
        d["prefix_hit_tokens"] = s.prefix_hit_tokens;
        d["prefix_query_tokens"] = s.prefix_query_tokens;
        d["steps"] = s.steps;
        d["replays"] = s.replays;
        d["weight_bytes"] = s.weight_bytes;
        d["tensor_parallel_size"] = s.ranks;
        d["pipeline_parallel_size"] = s.stages;
        d["all_reduces"] = s.all_reduce.count;
        d["all_reduce_seconds"] = s.all_reduce.seconds;
        d["hand_offs"] = s.hand_offs.count;
        d["hand_off_seconds"] = s.hand_offs.seconds;
        d["hand_off_bytes"] = s.hand_offs.bytes;
        return d;
      })
      .def("rank_memory", [](ModelRunner& r) {
        std::vector<RankMemory> all;
        {
          py::gil_scoped_release nogil;
          all = r.rank_memory();
        }
        py::list out;
        for (const RankMemory& m : all) {
          py::dict d;
          d["weight_bytes"] = m.weight_bytes;
          d["kv_bytes"] = m.kv_bytes;
          d["rss_bytes"] = m.rss_bytes;
          d["peak_rss_bytes"] = m.peak_rss_bytes;
          d["load_rss_bytes"] = m.load_rss_bytes;
          d["pid"] = m.pid;
          d["stage"] = m.stage;
          d["layer0"] = m.layer0;
          d["layers"] = m.layers;
          d["loras"] = m.loras;
          d["lora_bytes"] = m.lora_bytes;
          out.append(d);
        }
        return out;
      }, "Each tensor-parallel rank's memory (one entry without a group): weight and KV buffers' bytes, "
         "the process's resident and peak resident bytes and what loading the weights added, its pid, and "
         "its pipeline stage and layers (stage, layer0, layers), and the LoRA adapters it holds (loras: "
         "their shares on this rank; lora_bytes).");
}

}  // namespace ferrum::bindings
