// Engine: the continuous-batching scheduler over a ModelRunner, for generations and scores.
// Python samples between step() and commit(); the GIL is released while the forward runs.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "core/error.h"
#include "engine/engine.h"

namespace py = pybind11;

namespace ferrum::bindings {

namespace {
// Hands a vector to numpy without copying: the array owns it through a capsule.
template <typename T>
py::array_t<T> to_numpy(std::vector<T>&& v, std::vector<py::ssize_t> shape) {
  auto* owned = new std::vector<T>(std::move(v));
  py::capsule free_it(owned, [](void* p) { delete static_cast<std::vector<T>*>(p); });
  return py::array_t<T>(shape, owned->data(), free_it);
}
}  // namespace

void bind_engine(py::module_& m) {
  py::class_<Engine>(m, "Engine", "Continuous batching over a ModelRunner (which must outlive it).")
      .def(py::init([](ModelRunner& runner, int64_t max_num_seqs, int64_t max_num_batched_tokens) {
             EngineOptions o;
             o.max_num_seqs = max_num_seqs;
             o.max_num_batched_tokens = max_num_batched_tokens;
             return std::make_unique<Engine>(runner, o);
           }),
           py::arg("runner"), py::arg("max_num_seqs") = 32, py::arg("max_num_batched_tokens") = 512,
           py::keep_alive<1, 2>())
      .def("add_sequence",
           [](Engine& e, const std::vector<int64_t>& prompt, int64_t rows_from, std::shared_ptr<LoraAdapter> lora,
              float lora_scale) { return e.add_sequence(prompt, rows_from, std::move(lora), lora_scale); },
           py::arg("prompt"), py::arg("rows_from") = -1, py::arg("lora") = nullptr, py::arg("lora_scale") = 1.0f,
           "Queues a generation; returns its id. ValueError when it could never run. rows_from >= 0 also "
           "returns the logits of the prompt's positions rows_from .. (prompt logprobs). lora: a LoraAdapter (ModelRunner.make_lora) it runs with, "
           "its updates scaled by lora_scale (finite) on top of the file's scaling.")
      .def("add_score", [](Engine& e, const std::vector<int64_t>& tokens, int64_t rows_from, bool embed,
                           std::shared_ptr<LoraAdapter> lora, float lora_scale) {
             return e.add_score(tokens, rows_from, embed ? SeqKind::Embed : SeqKind::Score, std::move(lora),
                                lora_scale);
           }, py::arg("tokens"), py::arg("rows_from"), py::arg("embed") = false, py::arg("lora") = nullptr,
           py::arg("lora_scale") = 1.0f,
           "Queues a score of the tokens: logits rows at positions rows_from .. len - 1 (each predicting "
           "the next token), or with embed=True their final hidden states, come out of the steps that "
           "compute them, with f32 activations; it finishes by itself. Returns its id.")
      .def("add_prompt_embeds",
           [](Engine& e, py::array_t<float, py::array::c_style> rows, const std::string& kind, int64_t rows_from,
              std::shared_ptr<LoraAdapter> lora, float lora_scale) {
             if (rows.ndim() != 2 || rows.shape(1) != e.hidden_size())
               throw ValueError("prompt embeddings must be a float32 [tokens, " + std::to_string(e.hidden_size()) +
                                "] array");
             std::vector<float> v(rows.data(), rows.data() + rows.size());
             if (kind != "generate" && kind != "score" && kind != "embed")
               throw ValueError("kind must be 'generate', 'score' or 'embed'");
             const SeqKind k = kind == "generate" ? SeqKind::Generate : kind == "score" ? SeqKind::Score : SeqKind::Embed;
             return e.add_prompt_embeds(std::move(v), k, rows_from, std::move(lora), lora_scale);
           }, py::arg("rows"), py::arg("kind") = "generate", py::arg("rows_from") = -1, py::arg("lora") = nullptr,
           py::arg("lora_scale") = 1.0f,
           "Queues a prompt given as embeddings (float32 [tokens, hidden]) instead of token ids: a generation "
           "(kind 'generate', continuing from its sampled ids), a score or an embedding (rows from rows_from). "
           "Its cached blocks are shared only with the same rows. Returns its id.")
      .def("abort", &Engine::abort, py::arg("seq"))
      .def("step", [](Engine& e) {
             EngineStep s;
             {
               py::gil_scoped_release nogil;
               s = e.step();
             }
             const auto rows = py::ssize_t(s.row_seqs.size());
             const auto vocab = py::ssize_t(e.vocab_size()), hidden = py::ssize_t(e.hidden_size());
             const auto logit_rows = py::ssize_t(s.logits.size()) / vocab;
             const auto samples = py::ssize_t(s.sample_rows.size());
             py::dict d;
             d["seqs"] = to_numpy(std::move(s.row_seqs), {rows});
             d["positions"] = to_numpy(std::move(s.row_positions), {rows});
             d["sample_rows"] = to_numpy(std::move(s.sample_rows), {samples});
             d["logits"] = to_numpy(std::move(s.logits), {logit_rows, vocab});
             d["hidden"] = to_numpy(std::move(s.hidden), {rows - logit_rows, hidden});
             d["scored"] = s.scored;
             d["ended"] = s.ended;
             d["num_tokens"] = s.num_tokens;
             d["num_preempted"] = s.num_preempted;
             return d;
           },
           "Schedules and runs one forward. Returns {'seqs': int64[rows], 'positions': int64[rows], "
           "'sample_rows': int64[] (the rows generations sample from), 'logits': float32[logits rows, vocab], "
           "'hidden': float32[rows - logits rows, hidden] (embeddings' rows, after the logits rows), "
           "'scored': [seq] (scores and embeddings finished by this step), "
           "'ended': [seq] (generations ended by the engine: the KV pool is full), 'num_tokens', 'num_preempted'}.")
      .def("commit", &Engine::commit, py::arg("seqs"), py::arg("tokens"), py::arg("finished"),
           py::arg("accepted") = std::vector<int64_t>{}, py::arg("drafts") = std::vector<std::vector<int64_t>>{},
           "Hands back the tokens sampled for the last step's sample rows; finished sequences are ended. "
           "Speculative decoding: accepted[i] of the proposals seqs[i] had verified come before its token, "
           "drafts[i] are proposed to follow. Returns the sequences that reached max_model_len (also ended).")
      .def("rewind", &Engine::rewind, py::arg("seq"), py::arg("keep"), py::arg("tokens"),
           "Replaces a generation's tokens from position keep on with tokens (a draft model's sequence "
           "following what its target accepted).")
      .def("has_unfinished", &Engine::has_unfinished)
      .def("stats", [](const Engine& e) {
        EngineStats s = e.stats();
        py::dict d;
        d["running"] = s.running;
        d["waiting"] = s.waiting;
        d["preemptions"] = s.preemptions;
        d["engine_steps"] = s.steps;
        d["generated_tokens"] = s.generated_tokens;
        d["computed_tokens"] = s.computed_tokens;
        d["busy_seconds"] = s.busy_seconds;
        d["max_forwards_in_flight"] = s.max_in_flight;
        return d;
      });
}

}  // namespace ferrum::bindings
