// Mixture-of-experts ops on the CPU (semantics in backend.h).
//
// moe_route: softmax + top-k per token, tokens split across threads.
//
// moe_experts groups the (token, slot) pairs by expert when the stream runs (routing is data),
// so each selected expert's weights are read once per call however many tokens chose it, and
// experts nobody chose are never touched: decode costs the active parameters only. A call
// (MoeCall) records these steps:
//   plan      bucket the pairs by expert; quantize x for the gate / up dot kernels;
//   gather    x rows copied into expert order (experts run as sgemm), quantized x rows into
//             pair order (experts run on the batched kernels);
//   gate_up   act[p] = silu(gate[e] x) * (up[e] x); each thread owns a range of the I rows of
//             every active expert, so work is balanced however unevenly tokens are routed;
//   quantize  act rows to the down kernel's activation type;
//   down      each thread owns a range of the H output columns and accumulates every active
//             expert into out in ascending expert order (no races, no [pairs, H] buffer).
// An expert chosen by few tokens runs the dot kernels on its stored (possibly quantized) rows,
// a chunk of rows at a time so the chunk stays in cache across its tokens (with the batched
// kernel, which unpacks each weight block once for up to 8 of its tokens, where the types have
// one); an expert chosen by many tokens dequantizes a tile of rows and runs one sgemm over all
// its tokens. In a batch of decodes (Stream::decode_rows) every expert takes the dot path, as
// linear does, so a sequence's tokens compute the same whatever else is in the batch; in a
// scoring step (Stream::float_activations) every expert runs as an f32 GEMM (quant::gemm_f32_exact),
// on f32 activations.
// Small calls (decode: at most kMaxDotPairs pairs) have every thread plan and quantize for
// itself (a few rows) inside gate_up and down: two commands, one barrier, instead of four.
// Asymmetric 8-bit experts (MoeExtras) add their zero-point terms to each product before it is
// used, from the group sums of its input rows (group_offsets.h: add_group_offsets' arithmetic),
// taken with x's quantization and act's. Act-order experts read their inputs in their own
// orders: x's rows are then prepared pair by pair (gathered in the pair's expert's order, then
// quantized and summed) once the plan is made, and act's rows gathered before they are.
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/cpu_kernels.h"
#include "backend/cpu/group_offsets.h"
#include "backend/op_checks.h"
#include "quant/quant.h"

namespace ferrum {

namespace {

// An expert with more pairs than this runs as tile dequantize + sgemm (as linear does), except
// in a batch of up to kMaxDecodeRows decodes. With a batched dot kernel for all three weights
// (which unpacks each weight block once for all the expert's tokens) the dot path beats sgemm
// up to kMaxBatchPairs: a prompt's experts, chosen by tokens * top_k / experts tokens each,
// stay on it (docs/moe.md). Such types keep that limit on CPUs without the batched kernel.
constexpr int64_t kMaxDotPairs = 8;
constexpr int64_t kMaxBatchPairs = 64;
constexpr int64_t kMaxDecodeRows = 64;
constexpr int64_t kDotChunkRows = 32;   // rows kept hot in cache while every pair is dotted
constexpr int64_t kGemmTileRows = 64;
// Tokens per batched-kernel call: their prepared activations (192 bytes per 64 elements each)
// stay in L1 while every weight row of the chunk is dotted with them.
constexpr int64_t kBatchTokens = 8;

// Routing of one call, rebuilt at every submit.
struct MoePlan {
  std::vector<int32_t> start;       // [E + 1]: pairs of expert e are [start[e], start[e + 1])
  std::vector<int32_t> active;      // experts with at least one pair, ascending
  std::vector<int32_t> pair_token;  // sorted pair -> token
  std::vector<float> pair_weight;   // sorted pair -> routing weight
  std::vector<int32_t> fill;        // scratch for bucketing

  int64_t first(int32_t e) const { return start[size_t(e)]; }
  int64_t count(int32_t e) const { return start[size_t(e) + 1] - start[size_t(e)]; }
};

// A plan and the quantized activations the dot kernels read: one shared copy for large calls,
// one per thread for small ones.
struct MoePrep {
  MoePlan plan;
  std::vector<char> x_gate, x_up;  // x per token for the gate / up dot kernels (non-f32 acts)
  std::vector<char> act_q;         // act per pair for the down dot kernel (non-f32 acts)
  std::vector<char> x_pairs;       // x_gate rows in pair order, for the batched kernels
  // With offsets: x's group sums per token (per pair with act-order) for gate and up [., G],
  // act's per pair [P, G].
  std::vector<float> gate_sums, up_sums, down_sums;
  // Act-order: x rows per pair in their expert's order [P, H] (x_gate, x_up and the sums then
  // hold one row per pair), act rows so [P, I].
  std::vector<float> x_ordered, act_ordered;
};

// rows [r0, r0 + n) of one expert matrix as f32: in place for f32 weights, else into tile.
const float* rows_f32(const Tensor& w, const char* expert, int64_t r0, int64_t n, float* tile) {
  const int64_t K = w.cols();
  const size_t rb = w.row_bytes();
  if (w.dtype == DType::F32) return reinterpret_cast<const float*>(expert + r0 * rb);
  for (int64_t r = 0; r < n; ++r) quant::dequantize_row(w.dtype, expert + (r0 + r) * rb, tile + r * K, K);
  return tile;
}

// Row r of expert e in a stack of expert matrices (expert_bytes each, rows of row_bytes).
const char* expert_row(const Tensor& w, size_t expert_bytes, size_t row_bytes, int32_t e, int64_t r) {
  return host_ptr<char>(w) + size_t(e) * expert_bytes + size_t(r) * row_bytes;
}

// C[n, rows] = A[n, K] @ B[rows, K]^T; for a scoring step (exact_rows) with results that do not
// depend on n, so a score does not depend on how its sequence is chunked or batched.
void gemm_nt(const float* a, const float* b, float* c, int64_t n, int64_t rows, int64_t K, bool exact_rows) {
  if (exact_rows) {
    quant::gemm_f32_exact(K, b, rows, a, n, c, rows);
    return;
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(n), int(rows), int(K), 1.0f, a, int(K),
              b, int(K), 0.0f, c, int(rows));
}

void build_plan(MoePlan& p, const int32_t* ids, const float* weights, int64_t pairs, int64_t k,
                int64_t E) {
  p.start.assign(size_t(E + 1), 0);
  for (int64_t i = 0; i < pairs; ++i)
    if (ids[i] >= 0 && ids[i] < E) p.start[size_t(ids[i]) + 1]++;
  p.active.clear();
  for (int64_t e = 0; e < E; ++e) {
    if (p.start[size_t(e) + 1] > 0) p.active.push_back(int32_t(e));
    p.start[size_t(e) + 1] += p.start[size_t(e)];
  }
  p.fill.assign(p.start.begin(), p.start.end() - 1);
  p.pair_token.resize(size_t(pairs));
  p.pair_weight.resize(size_t(pairs));
  for (int64_t i = 0; i < pairs; ++i) {  // token order within an expert, like transformers
    if (ids[i] < 0 || ids[i] >= E) continue;
    int32_t at = p.fill[size_t(ids[i])]++;
    p.pair_token[size_t(at)] = int32_t(i / k);
    p.pair_weight[size_t(at)] = weights[i];
  }
}

// One moe_experts call: its tensors, kernels and paths (fixed when it is recorded) and its
// scratch (rewritten at every submit). Each recorded command runs one step of it.
class MoeCall {
 public:
  MoeCall(const Stream& s, const Tensor& x, const Tensor& gate, const Tensor& up, const Tensor& down,
          const Tensor& ids, const Tensor& weights, const Tensor& out, const MoeExtras& extras, int threads);

  // The steps a call records besides gate_up and down (a small call does their work inside those).
  bool has_plan_step() const { return !small_; }
  bool has_gather_step() const { return !small_ && (any_gemm_ || any_batched_ || ordered_x_); }
  bool has_quantize_step() const { return (quant_act_ || extras_.down.defined() || ordered_act_) && !small_; }

  void plan(int ith, int nth);
  void gather(int ith, int nth);
  void gate_up(int ith, int nth);
  void quantize_act(int ith, int nth);
  void down(int ith, int nth);

 private:
  void choose_paths(const Stream& s);
  void size_scratch(int threads);
  // Whether an expert chosen by `pairs` pairs runs as sgemm, or on the batched dot kernels (an
  // expert with >= 2 pairs on the dot path, where all three weights have one; one pair is
  // faster on the row kernel).
  bool gemm(int64_t pairs) const { return float_acts_ || (!decodes_ && pairs > max_dot_pairs_); }
  bool batched(int64_t pairs) const { return batch_gate_ && pairs >= 2 && !gemm(pairs); }
  MoePrep& prep(int ith) { return small_ ? own_[size_t(ith)] : shared_; }
  // Row r of expert e's gate / up / down matrix.
  const char* gate_row(int32_t e, int64_t r) const { return expert_row(gate_, gate_bytes_, grb_, e, r); }
  const char* up_row(int32_t e, int64_t r) const { return expert_row(up_, up_bytes_, urb_, e, r); }
  const char* down_row(int32_t e, int64_t r) const { return expert_row(down_, down_bytes_, drb_, e, r); }
  // g, u [n, rows] (gate and up rows c0 .. of expert e for the n pairs from p0) += their offsets.
  void add_gate_up_offsets(const MoePrep& pr, int32_t e, int64_t p0, int64_t n, int64_t c0, int64_t rows, float* g,
                           float* u) const {
    const MoePlan& p = pr.plan;
    add_offsets(extras_.gate, e, c0, rows, n, [&](int64_t i) { return token_sums(pr.gate_sums, extras_.gate, p, p0 + i); }, g);
    add_offsets(extras_.up, e, c0, rows, n, [&](int64_t i) { return token_sums(pr.up_sums, extras_.up, p, p0 + i); }, u);
  }
  // act[p0 + i, c0 .. c0 + rows) = silu(g[i]) * u[i] for the n pairs from p0 (g, u: [n, rows]).
  void swiglu_block(const float* g, const float* u, int64_t p0, int64_t n, int64_t c0, int64_t rows) {
    for (int64_t i = 0; i < n; ++i)
      cpu::silu_mul(g + i * rows, u + i * rows, act_.data() + (p0 + i) * I_ + c0, rows);
  }
  float* thread_block(int ith) { return per_thread_.data() + size_t(ith) * per_thread_floats_; }

  // Plans (if `plan`) and quantizes x tokens [t0, t1) into pr (act-order: nothing to quantize
  // before the plan).
  void prepare(MoePrep& pr, bool plan, int64_t t0, int64_t t1);
  // x's prepared row r (quantized for gate / up, group sums) from xr.
  void prepare_row(MoePrep& pr, const float* xr, int64_t r);
  // Act-order: sorted pairs [p0, p1) of expert e gathered in its order and prepared.
  void prepare_ordered_pairs(MoePrep& pr, int32_t e, int64_t p0, int64_t p1);
  // The prepared row of x that sorted pair i reads (its token's, or its own with act-order), and
  // that row as f32.
  int64_t x_row(const MoePlan& p, int64_t i) const { return ordered_x_ ? i : p.pair_token[size_t(i)]; }
  const float* x_f32(const MoePrep& pr, int64_t i) const {
    return ordered_x_ ? pr.x_ordered.data() + i * H_ : host_ptr<float>(x_) + pr.plan.pair_token[size_t(i)] * H_;
  }
  // The quantized x rows of an expert's pairs at one stride, for the batched kernels.
  const char* pair_rows(const MoePrep& pr) const { return ordered_x_ ? pr.x_gate.data() : pr.x_pairs.data(); }
  // Sorted pair i's act row as down reads it (in its expert's order with act-order).
  const float* act_row(const MoePrep& pr, int64_t i) const {
    return ordered_act_ ? pr.act_ordered.data() + i * I_ : act_.data() + i * I_;
  }
  // Copies the quantized x rows of pairs [p0, p1) into pair order (x_pairs), where the batched
  // kernels read an expert's tokens at one stride.
  void gather_pairs(MoePrep& pr, int64_t p0, int64_t p1);
  // Quantizes act rows of expert e's sorted pairs [p0, p1) into pr (with act-order, gathered in
  // its order first; with down offsets, also their group sums).
  void quantize_act_rows(MoePrep& pr, int32_t e, int64_t p0, int64_t p1);
  // out[i * rows + j] += projection o's offsets for expert e, outputs c0 + j (j < rows), over
  // the group sums of pair i's input, sums(i), for the n pairs (nothing without offsets).
  template <class Sums>
  void add_offsets(const ExpertOffsets& o, int32_t e, int64_t c0, int64_t rows, int64_t n, const Sums& sums,
                   float* out) const {
    if (!o.defined()) return;
    const int64_t G = o.offsets.dim(1), N = o.offsets.dim(2);
    const float* w = host_ptr<float>(o.offsets) + (int64_t(e) * G) * N + c0;
    for (int64_t i = 0; i < n; ++i) cpu::add_row_offsets(sums(i), G, w, N, out + i * rows, rows);
  }
  // The group sums (gate's or up's) of the x row sorted pair i reads.
  const float* token_sums(const std::vector<float>& sums, const ExpertOffsets& o, const MoePlan& p, int64_t i) const {
    return sums.data() + x_row(p, i) * o.offsets.dim(1);
  }
  // act rows of expert e's pairs, gate / up rows [r0, r1); g, u: this thread's result blocks.
  void gate_up_sgemm(const MoePrep& pr, int32_t e, int64_t r0, int64_t r1, float* tile, float* g, float* u);
  void gate_up_batched(const MoePrep& pr, int32_t e, int64_t r0, int64_t r1, float* g, float* u);
  void gate_up_dot(const MoePrep& pr, int32_t e, int64_t r0, int64_t r1, float* g, float* u);
  // out columns [r0, r1) += expert e's down rows [r0, r1) over its pairs' act rows, a chunk of
  // rows at a time into y [pairs, rows]: sgemm, the batched kernel or the row kernel, then the
  // routing weights.
  void down_expert(const MoePrep& pr, int32_t e, int64_t r0, int64_t r1, float* tile, float* y);
  void down_batched(const MoePrep& pr, int32_t e, int64_t c0, int64_t rows, float* y);
  void down_dot(const MoePrep& pr, int32_t e, int64_t c0, int64_t rows, float* y);
  // out[token of pair p0 + i, c0 .. c0 + rows) += weight of the pair * y[i], for i < n.
  void add_weighted(const MoePlan& p, int64_t p0, int64_t n, int64_t c0, int64_t rows, const float* y);

  Tensor x_, gate_, up_, down_, ids_, weights_, out_;
  MoeExtras extras_;
  bool ordered_x_, ordered_act_;  // act-order experts' gate / up and down inputs
  int64_t T_, H_, E_, I_, k_, P_;
  const quant::DotKernel *kg_, *ku_, *kd_;  // gate, up, down
  size_t xg_bytes_, xu_bytes_, aq_bytes_;   // activation rows for the gate / up / down kernels
  size_t grb_, urb_, drb_;                   // row bytes of gate, up, down
  size_t gate_bytes_, up_bytes_, down_bytes_;  // one expert's matrix
  bool float_acts_;                          // a scoring step: every expert runs as sgemm
  bool quant_gate_, quant_up_, quant_act_;   // activations quantized for the dot kernels
  bool small_ = false;                       // few pairs: every thread plans and quantizes for itself
  bool decodes_ = false;                     // a batch of decodes: no expert runs as sgemm
  int64_t max_dot_pairs_ = kMaxDotPairs;
  quant::DotBatchFn batch_gate_ = nullptr, batch_up_ = nullptr, batch_down_ = nullptr;  // all or none
  bool any_gemm_ = false, any_batched_ = false;
  int64_t tile_floats_ = 0, out_floats_ = 0;  // per thread: a dequantized tile, two result blocks

  MoePrep shared_;
  std::vector<MoePrep> own_;       // per thread, small calls
  std::vector<float> xs_;          // x rows in expert order [pairs, H] (sgemm experts)
  std::vector<float> act_;         // silu(gate) * up [pairs, I], expert order
  std::vector<float> per_thread_;  // tile + two result blocks per thread
  size_t per_thread_floats_ = 0;
};

MoeCall::MoeCall(const Stream& s, const Tensor& x, const Tensor& gate, const Tensor& up, const Tensor& down,
                 const Tensor& ids, const Tensor& weights, const Tensor& out, const MoeExtras& extras,
                 int threads)
    : x_(x), gate_(gate), up_(up), down_(down), ids_(ids), weights_(weights), out_(out), extras_(extras),
      ordered_x_(extras.gate_up_order.defined()), ordered_act_(extras.down_order.defined()),
      T_(x.rows()), H_(x.cols()), E_(gate.dim(0)), I_(gate.dim(1)), k_(ids.cols()), P_(T_ * k_),
      kg_(&quant::dot_kernel(gate.dtype)),  // ValueError for unsupported types
      ku_(&quant::dot_kernel(up.dtype)),
      kd_(&quant::dot_kernel(down.dtype)),
      xg_bytes_(dtype_bytes(kg_->act_type, H_)), xu_bytes_(dtype_bytes(ku_->act_type, H_)),
      aq_bytes_(dtype_bytes(kd_->act_type, I_)),
      grb_(gate.row_bytes()), urb_(up.row_bytes()), drb_(down.row_bytes()),
      gate_bytes_(size_t(I_) * grb_), up_bytes_(size_t(I_) * urb_), down_bytes_(size_t(H_) * drb_),
      float_acts_(s.float_activations),
      quant_gate_(!float_acts_ && kg_->act_type != DType::F32),
      // up's activations are x_gate's when the types agree
      quant_up_(!float_acts_ && ku_->act_type != DType::F32 && ku_->act_type != kg_->act_type),
      quant_act_(!float_acts_ && kd_->act_type != DType::F32) {
  choose_paths(s);
  size_scratch(threads);
}

void MoeCall::choose_paths(const Stream& s) {
  decodes_ = T_ <= std::min(s.decode_rows, kMaxDecodeRows);
  small_ = !float_acts_ && P_ <= kMaxDotPairs;
  // The batched kernels take their activation rows at one stride: gate and up must share x's
  // quantized rows (x_pairs). Where all three types have one (quant::has_dot_batch), experts
  // stay on the dot path up to kMaxBatchPairs on every CPU, on the row kernel where this one
  // lacks the batched kernel: a token's results never depend on how many tokens chose its
  // expert, whatever the ISA.
  if (kg_->act_type == ku_->act_type && quant_gate_ && quant::has_dot_batch(gate_.dtype) &&
      quant::has_dot_batch(up_.dtype) && quant::has_dot_batch(down_.dtype)) {
    max_dot_pairs_ = kMaxBatchPairs;
    batch_gate_ = quant::dot_batch_kernel(gate_.dtype);
    batch_up_ = quant::dot_batch_kernel(up_.dtype);
    batch_down_ = quant::dot_batch_kernel(down_.dtype);
    if (!batch_gate_ || !batch_up_ || !batch_down_) batch_gate_ = batch_up_ = batch_down_ = nullptr;
  }
  any_gemm_ = gemm(P_);  // whether some expert may have enough pairs for sgemm
  any_batched_ = batch_gate_ && P_ >= 2;
}

void MoeCall::size_scratch(int threads) {
  own_.resize(small_ ? size_t(threads) : 0);
  auto size_prep = [&](MoePrep& pr) {
    const int64_t rows = ordered_x_ ? P_ : T_;  // prepared x rows
    if (quant_gate_) pr.x_gate.resize(size_t(rows) * xg_bytes_);
    if (quant_up_) pr.x_up.resize(size_t(rows) * xu_bytes_);
    if (quant_act_) pr.act_q.resize(size_t(P_) * aq_bytes_);
    if (any_batched_ && !ordered_x_) pr.x_pairs.resize(size_t(P_) * xg_bytes_);
    if (extras_.gate.defined()) pr.gate_sums.resize(size_t(rows * extras_.gate.offsets.dim(1)));
    if (extras_.up.defined()) pr.up_sums.resize(size_t(rows * extras_.up.offsets.dim(1)));
    if (ordered_x_) pr.x_ordered.resize(size_t(P_ * H_));
    if (ordered_act_) pr.act_ordered.resize(size_t(P_ * I_));
    if (extras_.down.defined()) pr.down_sums.resize(size_t(P_ * extras_.down.offsets.dim(1)));
  };
  if (small_) for (MoePrep& pr : own_) size_prep(pr);
  else size_prep(shared_);
  if (any_gemm_) xs_.resize(size_t(P_ * H_));
  act_.resize(size_t(P_ * I_));
  tile_floats_ = any_gemm_ ? kGemmTileRows * std::max(H_, I_) : 0;
  const int64_t block_rows = any_gemm_ ? std::max(kDotChunkRows, kGemmTileRows) : kDotChunkRows;
  // An expert chosen by one token of a small call is dotted in one call per matrix over the
  // thread's whole row range (nothing to keep hot for a second token): long streams, one
  // activation preparation per matrix.
  const int64_t whole_range = small_ ? std::max(H_, I_) : 0;
  out_floats_ = std::max(P_ * block_rows, whole_range);  // each of g and u (y: both)
  per_thread_floats_ = size_t(tile_floats_ + 2 * out_floats_);
  per_thread_.resize(per_thread_floats_ * size_t(threads));
}

void MoeCall::prepare(MoePrep& pr, bool plan, int64_t t0, int64_t t1) {
  if (plan) build_plan(pr.plan, host_ptr<int32_t>(ids_), host_ptr<float>(weights_), P_, k_, E_);
  if (ordered_x_) return;
  for (int64_t t = t0; t < t1; ++t) prepare_row(pr, host_ptr<float>(x_) + t * H_, t);
}

void MoeCall::prepare_row(MoePrep& pr, const float* xr, int64_t r) {
  if (quant_gate_) quant::quantize_row(kg_->act_type, xr, pr.x_gate.data() + size_t(r) * xg_bytes_, H_);
  if (quant_up_) quant::quantize_row(ku_->act_type, xr, pr.x_up.data() + size_t(r) * xu_bytes_, H_);
  for (auto [o, sums] : {std::pair{&extras_.gate, &pr.gate_sums}, std::pair{&extras_.up, &pr.up_sums}}) {
    if (!o->defined()) continue;
    const int64_t G = o->offsets.dim(1);
    cpu::group_sums(xr, H_ / 32, host_ptr<int32_t>(o->block_groups), G, sums->data() + r * G);
  }
}

// out[j] = x[order[j]] for j < n (an order outside [0, n) gives zero).
void gather_ordered(const float* x, const int32_t* order, int64_t n, float* out) {
  for (int64_t j = 0; j < n; ++j) out[j] = order[j] >= 0 && order[j] < n ? x[order[j]] : 0.0f;
}

void MoeCall::prepare_ordered_pairs(MoePrep& pr, int32_t e, int64_t p0, int64_t p1) {
  const int32_t* order = host_ptr<int32_t>(extras_.gate_up_order) + int64_t(e) * H_;
  for (int64_t i = p0; i < p1; ++i) {
    float* row = pr.x_ordered.data() + i * H_;
    gather_ordered(host_ptr<float>(x_) + pr.plan.pair_token[size_t(i)] * H_, order, H_, row);
    prepare_row(pr, row, i);
  }
}

void MoeCall::gather_pairs(MoePrep& pr, int64_t p0, int64_t p1) {
  for (int64_t i = p0; i < p1; ++i)
    std::memcpy(pr.x_pairs.data() + size_t(i) * xg_bytes_,
                pr.x_gate.data() + size_t(pr.plan.pair_token[size_t(i)]) * xg_bytes_, xg_bytes_);
}

void MoeCall::quantize_act_rows(MoePrep& pr, int32_t e, int64_t p0, int64_t p1) {
  const ExpertOffsets& o = extras_.down;
  for (int64_t i = p0; i < p1; ++i) {
    if (ordered_act_)
      gather_ordered(act_.data() + i * I_, host_ptr<int32_t>(extras_.down_order) + int64_t(e) * I_, I_,
                     pr.act_ordered.data() + i * I_);
    const float* a = act_row(pr, i);
    if (quant_act_) quant::quantize_row(kd_->act_type, a, pr.act_q.data() + size_t(i) * aq_bytes_, I_);
    if (o.defined()) {
      const int64_t G = o.offsets.dim(1);
      cpu::group_sums(a, I_ / 32, host_ptr<int32_t>(o.block_groups), G, pr.down_sums.data() + i * G);
    }
  }
}

// The shared plan, and x quantized by ranges of tokens.
void MoeCall::plan(int ith, int nth) {
  int64_t b, e;
  split_range(T_, ith, nth, &b, &e);
  prepare(shared_, ith == 0, b, e);
}

// Each expert's share of pairs: x rows into expert order for sgemm experts, quantized x rows
// into pair order for batched ones.
void MoeCall::gather(int ith, int nth) {
  const MoePlan& p = shared_.plan;
  for (int32_t e : p.active) {
    const bool sgemm = gemm(p.count(e));
    if (!sgemm && !batched(p.count(e)) && !ordered_x_) continue;
    int64_t b, end;
    split_range(p.count(e), ith, nth, &b, &end);
    if (ordered_x_) prepare_ordered_pairs(shared_, e, p.first(e) + b, p.first(e) + end);
    if (!sgemm) {
      if (!ordered_x_) gather_pairs(shared_, p.first(e) + b, p.first(e) + end);
      continue;
    }
    for (int64_t i = p.first(e) + b; i < p.first(e) + end; ++i)
      std::memcpy(xs_.data() + i * H_, x_f32(shared_, i), size_t(H_) * 4);
  }
}

void MoeCall::gate_up(int ith, int nth) {
  MoePrep& pr = prep(ith);
  if (small_) {
    prepare(pr, true, 0, T_);
    for (int32_t e : pr.plan.active) {
      const int64_t p0 = pr.plan.first(e), p1 = p0 + pr.plan.count(e);
      if (ordered_x_) prepare_ordered_pairs(pr, e, p0, p1);
      else if (batched(pr.plan.count(e))) gather_pairs(pr, p0, p1);
    }
  }
  int64_t r0, r1;
  split_range(I_, ith, nth, &r0, &r1);
  if (r0 >= r1) return;
  float* tile = thread_block(ith);
  float* g = tile + tile_floats_;
  float* u = g + out_floats_;
  for (int32_t e : pr.plan.active) {
    const int64_t n = pr.plan.count(e);
    if (gemm(n)) gate_up_sgemm(pr, e, r0, r1, tile, g, u);
    else if (batched(n)) gate_up_batched(pr, e, r0, r1, g, u);
    else gate_up_dot(pr, e, r0, r1, g, u);
  }
}

void MoeCall::gate_up_sgemm(const MoePrep& pr, int32_t e, int64_t r0, int64_t r1, float* tile, float* g, float* u) {
  const int64_t p0 = pr.plan.first(e), n = pr.plan.count(e);
  for (int64_t c0 = r0; c0 < r1; c0 += kGemmTileRows) {
    const int64_t rows = std::min(kGemmTileRows, r1 - c0);
    gemm_nt(xs_.data() + p0 * H_, rows_f32(gate_, gate_row(e, 0), c0, rows, tile), g, n, rows, H_, float_acts_);
    gemm_nt(xs_.data() + p0 * H_, rows_f32(up_, up_row(e, 0), c0, rows, tile), u, n, rows, H_, float_acts_);
    add_gate_up_offsets(pr, e, p0, n, c0, rows, g, u);
    swiglu_block(g, u, p0, n, c0, rows);
  }
}

void MoeCall::gate_up_batched(const MoePrep& pr, int32_t e, int64_t r0, int64_t r1, float* g, float* u) {
  const int64_t p0 = pr.plan.first(e), n = pr.plan.count(e);
  const char* xq = pair_rows(pr) + size_t(p0) * xg_bytes_;
  for (int64_t c0 = r0; c0 < r1; c0 += kDotChunkRows) {  // g, u: [n, rows]
    const int64_t rows = std::min(kDotChunkRows, r1 - c0);
    for (int64_t j = 0; j < n; j += kBatchTokens) {
      const int64_t m = std::min(kBatchTokens, n - j);
      batch_gate_(H_, gate_row(e, c0), grb_, rows, xq + size_t(j) * xg_bytes_, xg_bytes_, m, g + j * rows, rows);
      batch_up_(H_, up_row(e, c0), urb_, rows, xq + size_t(j) * xg_bytes_, xg_bytes_, m, u + j * rows, rows);
    }
    add_gate_up_offsets(pr, e, p0, n, c0, rows, g, u);
    swiglu_block(g, u, p0, n, c0, rows);
  }
}

void MoeCall::gate_up_dot(const MoePrep& pr, int32_t e, int64_t r0, int64_t r1, float* g, float* u) {
  const int64_t p0 = pr.plan.first(e), n = pr.plan.count(e);
  const int64_t step = small_ && n == 1 ? r1 - r0 : kDotChunkRows;
  for (int64_t c0 = r0; c0 < r1; c0 += step) {
    const int64_t rows = std::min(step, r1 - c0);
    for (int64_t i = p0; i < p0 + n; ++i) {
      const int64_t t = x_row(pr.plan, i);
      const float* xr = x_f32(pr, i);
      const void* ag = quant_gate_ ? static_cast<const void*>(pr.x_gate.data() + size_t(t) * xg_bytes_) : xr;
      const void* au = quant_up_ ? static_cast<const void*>(pr.x_up.data() + size_t(t) * xu_bytes_)
                     : ku_->act_type == DType::F32 ? static_cast<const void*>(xr) : ag;
      kg_->dot_rows(H_, gate_row(e, c0), grb_, rows, ag, g);
      ku_->dot_rows(H_, up_row(e, c0), urb_, rows, au, u);
      add_gate_up_offsets(pr, e, i, 1, c0, rows, g, u);
      cpu::silu_mul(g, u, act_.data() + i * I_ + c0, rows);
    }
  }
}

// act rows of the dot-path experts' pairs, quantized by ranges of each expert's pairs.
void MoeCall::quantize_act(int ith, int nth) {
  const MoePlan& p = shared_.plan;
  for (int32_t e : p.active) {
    if (gemm(p.count(e)) && !extras_.down.defined() && !ordered_act_) continue;  // sgemm experts read act as f32
    int64_t b, end;
    split_range(p.count(e), ith, nth, &b, &end);
    quantize_act_rows(shared_, e, p.first(e) + b, p.first(e) + end);
  }
}

void MoeCall::down(int ith, int nth) {
  MoePrep& pr = prep(ith);
  int64_t r0, r1;
  split_range(H_, ith, nth, &r0, &r1);
  if (r0 >= r1) return;
  if ((quant_act_ || extras_.down.defined() || ordered_act_) && small_)
    for (int32_t e : pr.plan.active) quantize_act_rows(pr, e, pr.plan.first(e), pr.plan.first(e) + pr.plan.count(e));
  float* o = host_ptr<float>(out_);
  for (int64_t t = 0; t < T_; ++t) std::memset(o + t * H_ + r0, 0, size_t(r1 - r0) * 4);
  float* tile = thread_block(ith);
  for (int32_t e : pr.plan.active) down_expert(pr, e, r0, r1, tile, tile + tile_floats_);
}

void MoeCall::down_expert(const MoePrep& pr, int32_t e, int64_t r0, int64_t r1, float* tile, float* y) {
  const int64_t p0 = pr.plan.first(e), n = pr.plan.count(e);
  const bool sgemm = gemm(n), batch = batched(n);
  const int64_t step = sgemm ? kGemmTileRows : small_ && n == 1 ? r1 - r0 : kDotChunkRows;
  for (int64_t c0 = r0; c0 < r1; c0 += step) {
    const int64_t rows = std::min(step, r1 - c0);  // y: [n, rows]
    if (sgemm)
      gemm_nt(act_row(pr, p0), rows_f32(down_, down_row(e, 0), c0, rows, tile), y, n, rows, I_, float_acts_);
    else if (batch) down_batched(pr, e, c0, rows, y);
    else down_dot(pr, e, c0, rows, y);
    const int64_t Gd = extras_.down.defined() ? extras_.down.offsets.dim(1) : 0;
    add_offsets(extras_.down, e, c0, rows, n, [&](int64_t i) { return pr.down_sums.data() + (p0 + i) * Gd; }, y);
    add_weighted(pr.plan, p0, n, c0, rows, y);
  }
}

void MoeCall::down_batched(const MoePrep& pr, int32_t e, int64_t c0, int64_t rows, float* y) {
  const int64_t p0 = pr.plan.first(e), n = pr.plan.count(e);
  for (int64_t j = 0; j < n; j += kBatchTokens)
    batch_down_(I_, down_row(e, c0), drb_, rows, pr.act_q.data() + size_t(p0 + j) * aq_bytes_, aq_bytes_,
                std::min(kBatchTokens, n - j), y + j * rows, rows);
}

void MoeCall::down_dot(const MoePrep& pr, int32_t e, int64_t c0, int64_t rows, float* y) {
  const int64_t p0 = pr.plan.first(e), n = pr.plan.count(e);
  for (int64_t i = 0; i < n; ++i) {
    const void* a = quant_act_ ? static_cast<const void*>(pr.act_q.data() + size_t(p0 + i) * aq_bytes_)
                               : static_cast<const void*>(act_row(pr, p0 + i));
    kd_->dot_rows(I_, down_row(e, c0), drb_, rows, a, y + i * rows);
  }
}

void MoeCall::add_weighted(const MoePlan& p, int64_t p0, int64_t n, int64_t c0, int64_t rows, const float* y) {
  float* o = host_ptr<float>(out_);
  for (int64_t i = 0; i < n; ++i)
    cpu::axpy_f32(p.pair_weight[size_t(p0 + i)], y + i * rows, o + p.pair_token[size_t(p0 + i)] * H_ + c0, rows);
}

}  // namespace

void CpuBackend::moe_route(Stream& s, const Tensor& logits, int64_t top_k, bool normalize,
                           const Tensor& ids, const Tensor& weights) {
  own({&logits, &ids, &weights});
  checks::moe_route(logits, top_k, ids, weights);
  const int64_t E = logits.cols();
  auto probs = std::make_shared<std::vector<float>>(size_t(pool_.size() * E));
  static_cast<CpuStream&>(s).record("moe_route", [=](int ith, int nth) {
    int64_t b, e;
    split_range(logits.rows(), ith, nth, &b, &e);
    float* p = probs->data() + size_t(ith) * E;
    for (int64_t t = b; t < e; ++t) {
      const float* l = host_ptr<float>(logits) + t * E;
      float mx = l[0], sum = 0.0f;
      for (int64_t i = 1; i < E; ++i) mx = std::max(mx, l[i]);
      for (int64_t i = 0; i < E; ++i) sum += p[i] = std::exp(l[i] - mx);
      for (int64_t i = 0; i < E; ++i) p[i] /= sum;
      int32_t* id = host_ptr<int32_t>(ids) + t * top_k;
      float* w = host_ptr<float>(weights) + t * top_k;
      float picked = 0.0f;
      for (int64_t j = 0; j < top_k; ++j) {
        int64_t best = -1;
        for (int64_t i = 0; i < E; ++i)  // chosen experts are marked -1 (probabilities are >= 0)
          if (p[i] >= 0.0f && (best < 0 || p[i] > p[best])) best = i;
        if (best < 0) {  // NaN logits: nothing left to pick; the slot contributes nothing
          id[j] = -1;
          w[j] = 0.0f;
          continue;
        }
        id[j] = int32_t(best);
        w[j] = p[best];
        picked += p[best];
        p[best] = -1.0f;
      }
      if (normalize)
        for (int64_t j = 0; j < top_k; ++j) w[j] /= picked;
    }
  });
}

void CpuBackend::moe_experts(Stream& s, const Tensor& x, const Tensor& gate, const Tensor& up,
                             const Tensor& down, const Tensor& ids, const Tensor& weights,
                             const Tensor& out, const MoeExtras& extras) {
  own({&x, &gate, &up, &down, &ids, &weights, &out});
  for (const ExpertOffsets* o : {&extras.gate, &extras.up, &extras.down})
    if (o->defined()) own({&o->offsets, &o->block_groups});
  checks::moe_experts(x, gate, up, down, ids, weights, out, extras);
  auto call = std::make_shared<MoeCall>(s, x, gate, up, down, ids, weights, out, extras, pool_.size());
  CpuStream& cs = static_cast<CpuStream&>(s);
  if (call->has_plan_step()) cs.record("moe_plan", [call](int ith, int nth) { call->plan(ith, nth); });
  if (call->has_gather_step()) cs.record("moe_gather", [call](int ith, int nth) { call->gather(ith, nth); });
  cs.record("moe_gate_up", [call](int ith, int nth) { call->gate_up(ith, nth); });
  if (call->has_quantize_step())
    cs.record("moe_quantize_act", [call](int ith, int nth) { call->quantize_act(ith, nth); });
  cs.record("moe_down", [call](int ith, int nth) { call->down(ith, nth); });
}

}  // namespace ferrum
