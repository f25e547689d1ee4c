#include "model/weights.h"

#include <cstring>

#include "core/error.h"
#include "model/weight_names.h"
#include "quant/quant.h"

namespace ferrum {

namespace {

class Loader {
 public:
  Loader(Backend& be, const WeightSource& src) : be_(be), src_(src), naming_(naming_of(src)) {}

  const TensorInfo* find(const NamePair& p, int64_t layer = -1) const { return src_.find(tensor_name(p, naming_, layer)); }
  // A tensor check_weights has vouched for.
  const TensorInfo& get(const NamePair& p, int64_t layer, int64_t expert = -1) const {
    return src_.tensors.at(tensor_name(p, naming_, layer, expert));
  }

  // Weights used as stored (the mmap'd file's bytes on the CPU backend).
  Tensor weight(const TensorInfo& t) const {
    return be_.from_host(t.data, t.dtype, t.shape, t.file);
  }
  // A weight only linear (and embedding) reads, in the backend's layout for it (a packed copy
  // replaces the file's pages).
  Tensor linear_weight(const TensorInfo& t) const {
    return be_.pack_weight(weight(t), [&t](const void* p, size_t n) { t.file->release_pages(p, n); });
  }
  // Small vectors (norms, biases) as f32.
  Tensor f32(const TensorInfo& t) const {
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    std::vector<float> v(static_cast<size_t>(n));
    quant::dequantize_row(t.dtype, t.data, v.data(), int64_t(v.size()));
    return be_.from_host(v.data(), DType::F32, t.shape);
  }
  // One projection of all E experts as [E, out, in]: GGUF's 3-D tensor as stored, or HF's
  // per-expert tensors stacked (their pages are released once copied).
  Tensor experts(const NamePair& p, int64_t layer, int64_t E, int64_t out, int64_t in) const {
    if (naming_ == Naming::GGUF) return supported_experts(weight(get(p, layer)));
    std::vector<const TensorInfo*> parts;
    for (int64_t e = 0; e < E; ++e) {
      parts.push_back(&get(p, layer, e));
      if (parts.back()->dtype != parts[0]->dtype)
        throw FormatError(src_.path + ": experts of '" + parts.back()->name + "' differ in dtype (" +
                          dtype_name(parts.back()->dtype) + " vs " + dtype_name(parts[0]->dtype) + ")");
    }
    Tensor t = be_.alloc(parts[0]->dtype, {E, out, in});
    for (int64_t e = 0; e < E; ++e) {
      be_.upload(t.slice(e, 1), parts[size_t(e)]->data, parts[size_t(e)]->nbytes);
      parts[size_t(e)]->file->release_pages(parts[size_t(e)]->data, parts[size_t(e)]->nbytes);
    }
    return supported_experts(t);
  }
  Tensor supported_experts(const Tensor& t) const {
    if (!be_.supports(Op::MoeExperts, t.dtype))
      throw ValueError("the " + be_.name() + " backend cannot run mixture-of-experts layers with " +
                       dtype_name(t.dtype) + " experts");
    return t;
  }
  // Projections concatenated along their output rows: one tensor when dtypes agree.
  Linear fused(const std::vector<const TensorInfo*>& parts, const std::vector<const TensorInfo*>& biases) const {
    Linear lin;
    bool same = true;
    for (auto* p : parts) same = same && p->dtype == parts[0]->dtype;
    if (same && parts.size() > 1) {
      int64_t rows = 0;
      for (auto* p : parts) rows += p->shape[0];
      Tensor t = be_.alloc(parts[0]->dtype, {rows, parts[0]->shape[1]});
      int64_t row = 0;
      for (auto* p : parts) {  // each part straight into its rows: no second host copy
        be_.upload(t.slice(row, p->shape[0]), p->data, p->nbytes);
        row += p->shape[0];
        p->file->release_pages(p->data, p->nbytes);  // the fused copy replaces these pages
      }
      lin.parts.push_back(be_.pack_weight(t, {}));
    } else {
      for (auto* p : parts) lin.parts.push_back(linear_weight(*p));
    }
    if (!biases.empty()) {
      std::vector<float> b;
      for (auto* p : biases) {
        std::vector<float> v(size_t(p->shape[0]));
        quant::dequantize_row(p->dtype, p->data, v.data(), int64_t(v.size()));
        b.insert(b.end(), v.begin(), v.end());
      }
      lin.bias = be_.from_host(b.data(), DType::F32, {int64_t(b.size())});
    }
    return lin;
  }

 private:
  Backend& be_;
  const WeightSource& src_;
  Naming naming_;
};

}  // namespace

int64_t Linear::out_features() const {
  int64_t n = 0;
  for (const Tensor& p : parts) n += p.dim(0);
  return n;
}

void Linear::record(Backend& be, Stream& s, const Tensor& x, const Tensor& out) const {
  if (parts.size() == 1) {
    be.linear(s, x, parts[0], bias, out, 0);
    return;
  }
  int64_t col = 0;
  for (const Tensor& p : parts) {
    Tensor b = bias.defined() ? bias.slice(col, p.dim(0)) : Tensor{};
    be.linear(s, x, p, b, out, col);
    col += p.dim(0);
  }
}

ModelWeights load_weights(Backend& be, const WeightSource& src, const ModelConfig& c,
                          const LoadProgress& progress) {
  Loader L(be, src);
  ModelWeights w;
  const TensorInfo* head = L.find(kLmHead);
  const bool tied = c.tie_embeddings || !head;
  const TensorInfo& embed = L.get(kEmbed, -1);
  w.embed = tied ? L.linear_weight(embed) : L.weight(embed);  // tied: also the lm_head
  w.final_norm = L.f32(L.get(kFinalNorm, -1));
  w.lm_head.parts.push_back(tied ? w.embed : L.linear_weight(*head));
  if (const TensorInfo* rf = src.find(kRopeFreqs)) {
    w.rope_freq_factors.resize(size_t(rf->shape[0]));
    quant::dequantize_row(rf->dtype, rf->data, w.rope_freq_factors.data(), rf->shape[0]);
  }

  if (c.experts > 0 && !be.supports(Op::MoeRoute))
    throw ValueError("this model has mixture-of-experts layers, which the " + be.name() +
                     " backend does not run (yet): use device 'cpu'");
  const bool qk_norm = L.find(kQNorm, 0) != nullptr;
  const bool qkv_bias = L.find(kQBias, 0) != nullptr;
  for (int64_t i = 0; i < c.layers; ++i) {
    LayerWeights lw;
    lw.attn_norm = L.f32(L.get(kAttnNorm, i));
    lw.ffn_norm = L.f32(L.get(kFfnNorm, i));
    if (qk_norm) {
      lw.q_norm = L.f32(L.get(kQNorm, i));
      lw.k_norm = L.f32(L.get(kKNorm, i));
    }
    std::vector<const TensorInfo*> biases;
    if (qkv_bias) biases = {&L.get(kQBias, i), &L.get(kKBias, i), &L.get(kVBias, i)};
    lw.qkv = L.fused({&L.get(kQ, i), &L.get(kK, i), &L.get(kV, i)}, biases);
    lw.o = L.fused({&L.get(kO, i)}, {});
    if (c.is_moe_layer(i)) {
      const int64_t E = c.experts, X = c.expert_intermediate, D = c.hidden;
      lw.moe = true;
      lw.router = L.fused({&L.get(kRouter, i)}, {});
      lw.gate_exps = L.experts(kGateExps, i, E, X, D);
      lw.up_exps = L.experts(kUpExps, i, E, X, D);
      lw.down_exps = L.experts(kDownExps, i, E, D, X);
    } else {
      lw.gate_up = L.fused({&L.get(kGate, i), &L.get(kUp, i)}, {});
      lw.down = L.fused({&L.get(kDown, i)}, {});
    }
    w.layers.push_back(std::move(lw));
    if (progress) progress(i + 1, c.layers);
  }
  return w;
}

}  // namespace ferrum
