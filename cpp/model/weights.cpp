#include "model/weights.h"

#include <cstring>
#include <set>

#include "core/error.h"
#include "model/weight_names.h"
#include "quant/formats.h"
#include "quant/quant.h"

namespace ferrum {

namespace {

// Rows [begin, begin + count) of a tensor's first dimension (elements of a vector), in the same
// file; its group offsets' rows with them.
TensorInfo rows_of(const TensorInfo& t, int64_t begin, int64_t count) {
  TensorInfo r = t;
  const size_t row = t.shape[0] > 0 ? t.nbytes / size_t(t.shape[0]) : 0;
  r.data = t.data + size_t(begin) * row;
  r.shape[0] = count;
  r.nbytes = size_t(count) * row;
  if (t.group_offsets && (begin != 0 || count != t.shape[0])) {
    auto go = std::make_shared<GroupOffsets>(*t.group_offsets);
    const auto first = t.group_offsets->offsets.begin() + begin * go->groups;
    go->offsets.assign(first, first + count * go->groups);
    r.group_offsets = std::move(go);
  }
  return r;
}

// The group offsets of projections concatenated along their output rows (rows of parts without
// offsets are zero), over one grouping of the inputs: the parts' own when they share it, else
// one group per 32-input block. Empty `groups` when no part has offsets.
GroupOffsets fused_offsets(const std::vector<const TensorInfo*>& parts) {
  GroupOffsets out;
  const GroupOffsets* first = nullptr;
  bool shared = true;
  for (auto* p : parts)
    if (const GroupOffsets* go = p->group_offsets.get()) {
      if (!first) first = go;
      shared = shared && go->groups == first->groups && go->block_groups == first->block_groups;
    }
  if (!first) return out;
  const int64_t blocks = parts[0]->shape[1] / quant::kQK;
  if (shared) {
    out.groups = first->groups;
    out.block_groups = first->block_groups;
  } else {
    out.groups = blocks;
    for (int64_t b = 0; b < blocks; ++b) out.block_groups.push_back(int32_t(b));
  }
  for (auto* p : parts) {
    const GroupOffsets* go = p->group_offsets.get();
    for (int64_t n = 0; n < p->shape[0]; ++n)
      for (int64_t g = 0; g < out.groups; ++g)
        out.offsets.push_back(!go ? 0.0f : shared ? go->offsets[size_t(n * go->groups + g)]
                                              : go->offsets[size_t(n * go->groups + go->block_groups[size_t(g)])]);
  }
  return out;
}

// Columns [c0, c0 + dst.cols()) of the rows of a matrix of `cols` columns of dst's type at src ->
// dst, row by row (no host copy of the share: its freed pages would stay resident).
void upload_columns(Backend& be, const Tensor& dst, const char* src, int64_t cols, int64_t c0) {
  const size_t row = dtype_bytes(dst.dtype, cols), skip = dtype_bytes(dst.dtype, c0);
  const Tensor rows = dst.reshape({dst.rows(), dst.cols()});
  for (int64_t r = 0; r < rows.dim(0); ++r) be.upload(rows.slice(r, 1), src + size_t(r) * row + skip, dst.row_bytes());
}

// A share of a block-quantized row must be whole blocks: the ranks' activations are then
// quantized block by block as the whole row's are.
void check_whole_blocks(const TensorInfo& t, int64_t c0, int64_t n) {
  const int64_t block = dtype_info(t.dtype).block_elems;
  if (c0 % block != 0 || n % block != 0)
    throw ValueError("'" + t.name + "' (" + dtype_name(t.dtype) + ", blocks of " + std::to_string(block) +
                     " columns) cannot be split into shares of " + std::to_string(n) +
                     " columns: tensor parallelism needs whole blocks on each rank (use fewer ranks, or a "
                     "type with smaller blocks)");
}

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
  // Columns [c0, c0 + n) of every row of a 2-D weight, for linear (a rank's share of a matmul
  // split by its input): a copy, of whole blocks.
  Linear columns(const TensorInfo& t, int64_t c0, int64_t n) const {
    if (n == t.shape[1]) return fused({&t}, {});
    in_order(t, "tensor parallelism (a rank's share of its inputs)");
    check_whole_blocks(t, c0, n);
    Tensor part = be_.alloc(t.dtype, {t.shape[0], n});
    upload_columns(be_, part, t.data, t.shape[1], c0);
    t.file->release_pages(t.data, t.nbytes);  // this rank reads no other column of it
    Linear lin;
    lin.parts.push_back(be_.pack_weight(part, {}));
    if (t.group_offsets) {  // this rank's blocks, in their groups; the others' sums are its peers'
      GroupOffsets share = *t.group_offsets;
      const auto first = share.block_groups.begin() + c0 / quant::kQK;
      share.block_groups.assign(first, first + n / quant::kQK);
      TensorInfo shared = t;
      shared.shape[1] = n;
      shared.group_offsets = std::make_shared<const GroupOffsets>(std::move(share));
      offsets_onto(lin, {&shared});
    }
    return lin;
  }
  // Rows [r0, r0 + n) of the embedding, then kZeroRows zero rows: an id outside the share is
  // looked up as row n, so the ranks' embeddings add up to the whole one's. Tied: packed for the
  // lm_head too, which reads its first n rows.
  static constexpr int64_t kZeroRows = 16;  // a whole R16 row group: n rows keep their layout
  Tensor embedding_rows(const TensorInfo& t, int64_t r0, int64_t n, bool tied) const {
    const TensorInfo share = rows_of(t, r0, n);
    Tensor table = be_.alloc(t.dtype, {n + kZeroRows, t.shape[1]});
    be_.upload(table.slice(0, n), share.data, share.nbytes);
    const std::vector<char> zeros(table.slice(n, kZeroRows).nbytes());  // a few KB
    be_.upload(table.slice(n, kZeroRows), zeros.data(), zeros.size());
    share.file->release_pages(share.data, share.nbytes);
    return tied ? be_.pack_weight(table, {}) : table;
  }
  // One projection of all E experts as [E, out, in]: GGUF's 3-D tensor as stored, or HF's
  // per-expert tensors stacked (their pages are released once copied); with a split, the rows
  // [r0, r0 + rows) (gate, up) or columns [c0, c0 + cols) (down) of each expert's matrix. Their
  // group offsets (asymmetric 8-bit) into `offsets`, their input orders (act-order) into `order`.
  Tensor experts(const NamePair& p, int64_t layer, int64_t E, int64_t out, int64_t in, int64_t r0, int64_t rows,
                 int64_t c0, int64_t cols, ExpertOffsets& offsets, std::vector<int32_t>& order) const {
    const bool whole = rows == out && cols == in;
    if (naming_ == Naming::GGUF && whole) return supported_experts(weight(get(p, layer)));
    std::vector<const TensorInfo*> parts;
    if (naming_ == Naming::GGUF) {
      parts.assign(size_t(E), &get(p, layer));
    } else {
      for (int64_t e = 0; e < E; ++e) {
        parts.push_back(&get(p, layer, e));
        if (parts.back()->dtype != parts[0]->dtype)
          throw FormatError(src_.path + ": experts of '" + parts.back()->name + "' differ in dtype (" +
                            dtype_name(parts.back()->dtype) + " vs " + dtype_name(parts[0]->dtype) + ")");
      }
    }
    order = expert_orders(parts);
    if (!order.empty() && cols != in) in_order(*parts[0], "tensor parallelism (a rank's share of its inputs)");
    offsets = expert_offsets(parts, r0, rows, c0, cols);
    const DType dtype = parts[0]->dtype;
    if (cols != in) check_whole_blocks(*parts[0], c0, cols);
    Tensor t = be_.alloc(dtype, {E, rows, cols});
    const size_t expert_bytes = dtype_bytes(dtype, out * in);
    for (int64_t e = 0; e < E; ++e) {
      const TensorInfo& src = *parts[size_t(e)];
      const char* matrix = src.data + (naming_ == Naming::GGUF ? size_t(e) * expert_bytes : 0);
      if (cols == in) be_.upload(t.slice(e, 1), matrix + dtype_bytes(dtype, r0 * in), dtype_bytes(dtype, rows * in));
      else upload_columns(be_, t.slice(e, 1), matrix, in, c0);
      if (naming_ == Naming::HF) src.file->release_pages(src.data, src.nbytes);
    }
    if (naming_ == Naming::GGUF) parts[0]->file->release_pages(parts[0]->data, parts[0]->nbytes);
    return supported_experts(t);
  }
  // The experts' input orders as moe_experts takes them, [E, in] (experts in order: 0, 1, ..);
  // empty when every expert's inputs are in order.
  static std::vector<int32_t> expert_orders(const std::vector<const TensorInfo*>& parts) {
    bool any = false;
    for (const TensorInfo* p : parts) any = any || p->input_order;
    if (!any) return {};
    const int64_t in = parts[0]->shape[1];
    std::vector<int32_t> order;
    for (const TensorInfo* p : parts)
      for (int64_t j = 0; j < in; ++j) order.push_back(p->input_order ? (*p->input_order)[size_t(j)] : int32_t(j));
    return order;
  }
  // The experts' group offsets as moe_experts takes them: rows [r0, r0 + rows) of each expert's
  // and the groups of input blocks [c0, c0 + cols); experts without offsets add zeros. None
  // when no expert has any.
  ExpertOffsets expert_offsets(const std::vector<const TensorInfo*>& parts, int64_t r0, int64_t rows, int64_t c0,
                               int64_t cols) const {
    const GroupOffsets* first = nullptr;
    for (const TensorInfo* p : parts) {
      const GroupOffsets* go = p->group_offsets.get();
      if (!go) continue;
      if (!first) first = go;
      if (go->groups != first->groups || go->block_groups != first->block_groups)
        throw ValueError(src_.path + ": the experts of '" + p->name + "' group their inputs differently; ferrum " +
                         "needs one grouping for all the experts of a projection");
    }
    if (!first) return {};
    const int64_t E = int64_t(parts.size()), G = first->groups;
    std::vector<float> offsets(size_t(E * G * rows), 0.0f);  // [E, G, rows]
    for (int64_t e = 0; e < E; ++e)
      if (const GroupOffsets* go = parts[size_t(e)]->group_offsets.get())
        for (int64_t n = 0; n < rows; ++n)
          for (int64_t g = 0; g < G; ++g) offsets[size_t((e * G + g) * rows + n)] = go->offsets[size_t((r0 + n) * G + g)];
    const auto b0 = first->block_groups.begin() + c0 / quant::kQK;
    const std::vector<int32_t> block_groups(b0, b0 + cols / quant::kQK);
    return {be_.from_host(offsets.data(), DType::F32, {E, G, rows}),
            be_.from_host(block_groups.data(), DType::I32, {int64_t(block_groups.size())})};
  }
  // gate's and up's input orders, which read one input: they must agree.
  Tensor expert_input_order(const std::vector<int32_t>& gate, const std::vector<int32_t>& up, int64_t E,
                            int64_t layer) const {
    if (gate != up)
      throw ValueError(src_.path + ": the experts of layer " + std::to_string(layer) + " order the inputs of " +
                       "gate_proj and up_proj (act-order) differently; ferrum needs one order per expert for both");
    if (gate.empty()) return {};
    return be_.from_host(gate.data(), DType::I32, {E, int64_t(gate.size()) / E});
  }
  Tensor supported_experts(const Tensor& t) const {
    if (!be_.supports(Op::MoeExperts, t.dtype))
      throw ValueError("the " + be_.name() + " backend cannot run mixture-of-experts layers with " +
                       dtype_name(t.dtype) + " experts");
    return t;
  }
  // The input order the parts' columns share (GPTQ act-order), uploaded; undefined when in order.
  // Parts of one projection read one input, so their orders must agree.
  Tensor input_order(const std::vector<const TensorInfo*>& parts) const {
    const auto& order = parts[0]->input_order;
    for (auto* p : parts)
      if (!(p->input_order == order || (p->input_order && order && *p->input_order == *order)))
        throw ValueError(src_.path + ": '" + p->name + "' orders its inputs (act-order) differently from '" +
                         parts[0]->name + "', which it is fused with; ferrum needs one order per projection");
    if (!order) return {};
    return be_.from_host(order->data(), DType::I32, {int64_t(order->size())});
  }
  // Refuses a weight whose inputs are reordered where the order cannot be applied.
  void in_order(const TensorInfo& t, const char* why) const {
    if (t.input_order)
      throw ValueError(src_.path + ": '" + t.name + "' orders its inputs (GPTQ act-order), which " + why +
                       " does not support yet");
  }
  // Refuses a weight with group offsets where only its stored values would be read.
  void without_offsets(const TensorInfo& t, const char* why) const {
    if (t.group_offsets)
      throw ValueError(src_.path + ": '" + t.name + "' is asymmetric 8-bit (zeros other than 128), which " + why +
                       " does not support yet");
  }
  void offsets_onto(Linear& lin, const std::vector<const TensorInfo*>& parts) const {
    const GroupOffsets go = fused_offsets(parts);
    if (go.groups == 0) return;
    const int64_t N = lin.out_features(), G = go.groups;
    std::vector<float> by_group(go.offsets.size());  // [G, N]: a group's offsets side by side
    for (int64_t n = 0; n < N; ++n)
      for (int64_t g = 0; g < G; ++g) by_group[size_t(g * N + n)] = go.offsets[size_t(n * G + g)];
    lin.group_offsets = be_.from_host(by_group.data(), DType::F32, {G, N});
    lin.block_groups = be_.from_host(go.block_groups.data(), DType::I32, {int64_t(go.block_groups.size())});
  }
  // Projections concatenated along their output rows: one tensor when dtypes agree.
  Linear fused(const std::vector<const TensorInfo*>& parts, const std::vector<const TensorInfo*>& biases) const {
    Linear lin;
    lin.input_order = input_order(parts);
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
    offsets_onto(lin, parts);
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

void Linear::record(Backend& be, Stream& s, const Tensor& x_in, const Tensor& out, const Tensor& scratch) const {
  Tensor x = x_in;
  if (input_order.defined()) {
    x = scratch.reshape({scratch.numel()}).slice(0, x_in.rows() * x_in.cols()).reshape({x_in.rows(), x_in.cols()});
    be.gather_columns(s, x_in, input_order, x);
  }
  if (parts.size() == 1) {
    be.linear(s, x, parts[0], bias, out, 0);
  } else {
    int64_t col = 0;
    for (const Tensor& p : parts) {
      Tensor b = bias.defined() ? bias.slice(col, p.dim(0)) : Tensor{};
      be.linear(s, x, p, b, out, col);
      col += p.dim(0);
    }
  }
  if (group_offsets.defined()) be.add_group_offsets(s, x, block_groups, group_offsets, out);
}

ModelWeights load_weights(Backend& be, const WeightSource& src, const ModelConfig& c, const TensorSplit& split,
                          const LoadProgress& progress) {
  return load_weights(be, src, c, split, PipelineStage{0, 1, 0, c.layers}, progress);
}

ModelWeights load_weights(Backend& be, const WeightSource& src, const ModelConfig& c, const TensorSplit& split,
                          const PipelineStage& stage, const LoadProgress& progress) {
  Loader L(be, src);
  ModelWeights w;
  const TensorInfo* head = L.find(kLmHead);
  const bool tied = c.tie_embeddings || !head;
  const TensorInfo& embed = L.get(kEmbed, -1);
  if (stage.first() || (tied && stage.last())) {
    if (split.whole()) w.embed = tied ? L.linear_weight(embed) : L.weight(embed);  // tied: also the lm_head
    else w.embed = L.embedding_rows(embed, split.vocab0, split.vocab, tied);
  }
  L.in_order(embed, "an embedding");
  L.without_offsets(embed, "an embedding");
  if (stage.last()) {
    if (tied) {
      w.lm_head.parts.push_back(split.whole() ? w.embed : w.embed.slice(0, split.vocab));
    } else {
      const TensorInfo share = rows_of(*head, split.vocab0, split.vocab);
      w.lm_head = L.fused({split.whole() ? head : &share}, {});
    }
    w.final_norm = L.f32(L.get(kFinalNorm, -1));
  }
  if (const TensorInfo* rf = src.find(kRopeFreqs)) {
    w.rope_freq_factors.resize(size_t(rf->shape[0]));
    quant::dequantize_row(rf->dtype, rf->data, w.rope_freq_factors.data(), rf->shape[0]);
  }

  if (c.experts > 0 && !be.supports(Op::MoeRoute))
    throw ValueError("this model has mixture-of-experts layers, which the " + be.name() +
                     " backend does not run (yet): use device 'cpu'");
  const bool qk_norm = L.find(kQNorm, 0) != nullptr;
  const bool qkv_bias = L.find(kQBias, 0) != nullptr;
  // This rank's rows of q, and of k and v (their heads' rows, biases alike).
  const IndexRange qs = split.q_rows(c), kvs = split.kv_rows(c), inters = split.inter_rows();
  const auto q_rows = [&](const TensorInfo& t) { return rows_of(t, qs.begin, qs.count); };
  const auto kv_rows = [&](const TensorInfo& t) { return rows_of(t, kvs.begin, kvs.count); };
  for (int64_t i = stage.layer0; i < stage.layer0 + stage.layers; ++i) {
    LayerWeights lw;
    lw.attn_norm = L.f32(L.get(kAttnNorm, i));
    lw.ffn_norm = L.f32(L.get(kFfnNorm, i));
    if (qk_norm) {
      lw.q_norm = L.f32(L.get(kQNorm, i));
      lw.k_norm = L.f32(L.get(kKNorm, i));
    }
    const TensorInfo q = q_rows(L.get(kQ, i)), k = kv_rows(L.get(kK, i)), v = kv_rows(L.get(kV, i));
    TensorInfo qb, kb, vb;
    std::vector<const TensorInfo*> biases;
    if (qkv_bias) {
      qb = q_rows(L.get(kQBias, i));
      kb = kv_rows(L.get(kKBias, i));
      vb = kv_rows(L.get(kVBias, i));
      biases = {&qb, &kb, &vb};
    }
    lw.qkv = L.fused({&q, &k, &v}, biases);
    lw.o = L.columns(L.get(kO, i), qs.begin, qs.count);
    if (c.is_moe_layer(i)) {
      const int64_t E = c.experts, X = c.expert_intermediate, D = c.hidden;
      const int64_t x0 = split.expert_inter0, xn = split.expert_intermediate;
      lw.moe = true;
      lw.router = L.fused({&L.get(kRouter, i)}, {});
      std::vector<int32_t> gate_order, up_order, down_order;
      lw.gate_exps = L.experts(kGateExps, i, E, X, D, x0, xn, 0, D, lw.moe_extras.gate, gate_order);
      lw.up_exps = L.experts(kUpExps, i, E, X, D, x0, xn, 0, D, lw.moe_extras.up, up_order);
      lw.down_exps = L.experts(kDownExps, i, E, D, X, 0, D, x0, xn, lw.moe_extras.down, down_order);
      lw.moe_extras.gate_up_order = L.expert_input_order(gate_order, up_order, E, i);
      if (!down_order.empty()) lw.moe_extras.down_order = be.from_host(down_order.data(), DType::I32, {E, X});
    } else {
      const TensorInfo gate = rows_of(L.get(kGate, i), inters.begin, inters.count);
      const TensorInfo up = rows_of(L.get(kUp, i), inters.begin, inters.count);
      lw.gate_up = L.fused({&gate, &up}, {});
      lw.down = L.columns(L.get(kDown, i), inters.begin, inters.count);
    }
    w.layers.push_back(std::move(lw));
    if (progress) progress(i - stage.layer0 + 1, stage.layers);
  }
  return w;
}

int64_t weight_bytes(const ModelWeights& w) {
  std::set<const Storage*> seen;
  int64_t bytes = 0;
  const auto add = [&](const Tensor& t) {
    if (t.defined() && seen.insert(t.storage.get()).second) bytes += int64_t(t.storage->bytes);
  };
  const auto add_linear = [&](const Linear& l) {
    for (const Tensor& p : l.parts) add(p);
    add(l.bias);
    add(l.group_offsets);
  };
  add(w.embed);
  add(w.final_norm);
  add_linear(w.lm_head);
  for (const LayerWeights& l : w.layers) {
    for (const Tensor* t : {&l.attn_norm, &l.ffn_norm, &l.q_norm, &l.k_norm, &l.gate_exps, &l.up_exps, &l.down_exps})
      add(*t);
    for (const Linear* lin : {&l.qkv, &l.o, &l.gate_up, &l.down, &l.router}) add_linear(*lin);
    for (const ExpertOffsets* o : {&l.moe_extras.gate, &l.moe_extras.up, &l.moe_extras.down}) add(o->offsets);
  }
  return bytes;
}

}  // namespace ferrum
