// Mixture-of-experts ops on the CPU (semantics in backend.h).
//
// moe_route: softmax + top-k per token, tokens split across threads.
//
// moe_experts groups the (token, slot) pairs by expert when the stream runs (routing is data),
// so each selected expert's weights are read once per call however many tokens chose it, and
// experts nobody chose are never touched: decode costs the active parameters only.
//   plan      bucket the pairs by expert; quantize x for the gate / up dot kernels;
//   gather    x rows copied into expert order (only for experts run as sgemm);
//   gate_up   act[p] = silu(gate[e] x) * (up[e] x); each thread owns a range of the I rows of
//             every active expert, so work is balanced however unevenly tokens are routed;
//   quantize  act rows to the down kernel's activation type;
//   down      each thread owns a range of the H output columns and accumulates every active
//             expert into out in ascending expert order (no races, no [pairs, H] buffer).
// An expert chosen by few tokens runs the dot kernels on its stored (possibly quantized) rows,
// a chunk of rows at a time so the chunk stays in cache across its tokens (with the batched
// kernel, which unpacks each weight block once for up to 8 of its tokens, where the types have
// one); an expert chosen by many tokens dequantizes a tile of rows and runs one sgemm over all
// its tokens. In a batch
// of decodes (Stream::decode_rows) every expert takes the dot path, as linear does, so a
// sequence's tokens compute the same whatever else is in the batch.
// Small calls (decode: at most kMaxDotPairs pairs) have every thread plan and quantize for
// itself (a few rows) inside gate_up and down: two commands, one barrier, instead of four.
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/cpu_kernels.h"
#include "backend/op_checks.h"
#include "quant/quant.h"

namespace ferrum {

namespace {

// An expert with more pairs than this runs as tile dequantize + sgemm (as linear does), except
// in a batch of up to kMaxDecodeRows decodes. With a batched dot kernel for all three weights
// (which unpacks each weight block once for all the expert's tokens) the dot path beats sgemm
// up to kMaxBatchPairs: a prompt's experts, chosen by tokens * top_k / experts tokens each,
// stay on it (measured on Zen 4, Q8_0: see docs/moe.md).
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
};

struct MoeScratch {
  bool small = false;       // few pairs: every thread plans and quantizes for itself
  bool decodes = false;     // a batch of decodes: no expert runs as sgemm
  bool float_acts = false;  // a scoring step: every expert runs as sgemm (f32 activations)
  int64_t max_dot_pairs = kMaxDotPairs;
  // gate, up and down batched kernels (all or none); an expert with >= 2 pairs on the dot
  // path uses them (one pair is faster on the row kernel)
  quant::DotBatchFn batch_gate = nullptr, batch_up = nullptr, batch_down = nullptr;
  bool gemm(int64_t pairs) const { return float_acts || (!decodes && pairs > max_dot_pairs); }
  bool batched(int64_t pairs) const { return batch_gate && pairs >= 2 && !gemm(pairs); }
  MoePrep shared;
  std::vector<MoePrep> own;      // per thread, small calls
  std::vector<float> xs;         // x rows in expert order [pairs, H] (sgemm experts)
  std::vector<float> act;        // silu(gate) * up [pairs, I], expert order
  std::vector<float> per_thread; // tile + two [pairs, rows] result blocks per thread
  size_t per_thread_floats = 0;
  MoePrep& prep(int ith) { return small ? own[size_t(ith)] : shared; }
  float* thread_block(int ith) { return per_thread.data() + size_t(ith) * per_thread_floats; }
};

// rows [r0, r0 + n) of one expert matrix as f32: in place for f32 weights, else into tile.
const float* rows_f32(const Tensor& w, const char* expert, int64_t r0, int64_t n, float* tile) {
  const int64_t K = w.cols();
  const size_t rb = w.row_bytes();
  if (w.dtype == DType::F32) return reinterpret_cast<const float*>(expert + r0 * rb);
  for (int64_t r = 0; r < n; ++r) quant::dequantize_row(w.dtype, expert + (r0 + r) * rb, tile + r * K, K);
  return tile;
}

// C[n, rows] = A[n, K] @ B[rows, K]^T
void gemm_nt(const float* a, const float* b, float* c, int64_t n, int64_t rows, int64_t K) {
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
                             const Tensor& out) {
  own({&x, &gate, &up, &down, &ids, &weights, &out});
  checks::moe_experts(x, gate, up, down, ids, weights, out);
  CpuStream& cs = static_cast<CpuStream&>(s);
  const int64_t T = x.rows(), H = x.cols(), E = gate.dim(0), I = gate.dim(1), k = ids.cols();
  const int64_t P = T * k;
  const quant::DotKernel* kg = &quant::dot_kernel(gate.dtype);  // ValueError for unsupported types
  const quant::DotKernel* ku = &quant::dot_kernel(up.dtype);
  const quant::DotKernel* kd = &quant::dot_kernel(down.dtype);
  const size_t xg_bytes = dtype_bytes(kg->act_type, H), xu_bytes = dtype_bytes(ku->act_type, H);
  const size_t aq_bytes = dtype_bytes(kd->act_type, I);
  const size_t gate_bytes = size_t(I) * gate.row_bytes(), up_bytes = size_t(I) * up.row_bytes();
  const size_t down_bytes = size_t(H) * down.row_bytes();
  const bool float_acts = s.float_activations;
  const bool quant_gate = !float_acts && kg->act_type != DType::F32;
  const bool quant_up = !float_acts && ku->act_type != DType::F32 && ku->act_type != kg->act_type;  // else shares x_gate
  const bool quant_act = !float_acts && kd->act_type != DType::F32;

  auto sc = std::make_shared<MoeScratch>();
  sc->decodes = T <= std::min(s.decode_rows, kMaxDecodeRows);
  sc->float_acts = float_acts;
  sc->small = !float_acts && P <= kMaxDotPairs;
  // The batched kernels take their activation rows at one stride: gate and up must share x's
  // quantized rows (x_pairs).
  if (kg->act_type == ku->act_type && quant_gate) {
    sc->batch_gate = quant::dot_batch_kernel(gate.dtype);
    sc->batch_up = quant::dot_batch_kernel(up.dtype);
    sc->batch_down = quant::dot_batch_kernel(down.dtype);
    if (!sc->batch_gate || !sc->batch_up || !sc->batch_down) sc->batch_gate = sc->batch_up = sc->batch_down = nullptr;
  }
  if (sc->batch_gate) sc->max_dot_pairs = kMaxBatchPairs;
  const bool any_gemm = sc->gemm(P);  // whether some expert may have enough pairs for sgemm
  const bool any_batched = sc->batch_gate && P >= 2;
  sc->own.resize(sc->small ? size_t(pool_.size()) : 0);
  auto size_prep = [&](MoePrep& pr) {
    if (quant_gate) pr.x_gate.resize(size_t(T) * xg_bytes);
    if (quant_up) pr.x_up.resize(size_t(T) * xu_bytes);
    if (quant_act) pr.act_q.resize(size_t(P) * aq_bytes);
    if (any_batched) pr.x_pairs.resize(size_t(P) * xg_bytes);
  };
  if (sc->small) for (MoePrep& pr : sc->own) size_prep(pr);
  else size_prep(sc->shared);
  if (any_gemm) sc->xs.resize(size_t(P * H));
  sc->act.resize(size_t(P * I));
  const int64_t tile_floats = any_gemm ? kGemmTileRows * std::max(H, I) : 0;
  const int64_t block_rows = any_gemm ? std::max(kDotChunkRows, kGemmTileRows) : kDotChunkRows;
  // An expert chosen by one token of a small call is dotted in one call per matrix over the
  // thread's whole row range (nothing to keep hot for a second token): long streams, one
  // activation preparation per matrix.
  const int64_t whole_range = sc->small ? std::max(H, I) : 0;
  const int64_t out_floats = std::max(P * block_rows, whole_range);  // each of g and u (y: both)
  sc->per_thread_floats = size_t(tile_floats + 2 * out_floats);
  sc->per_thread.resize(sc->per_thread_floats * size_t(pool_.size()));

  // Plans and quantizes x tokens [t0, t1) into pr.
  auto prepare = [=](MoePrep& pr, bool plan, int64_t t0, int64_t t1) {
    if (plan) build_plan(pr.plan, host_ptr<int32_t>(ids), host_ptr<float>(weights), P, k, E);
    for (int64_t t = t0; t < t1; ++t) {
      const float* xr = host_ptr<float>(x) + t * H;
      if (quant_gate) quant::quantize_row(kg->act_type, xr, pr.x_gate.data() + size_t(t) * xg_bytes, H);
      if (quant_up) quant::quantize_row(ku->act_type, xr, pr.x_up.data() + size_t(t) * xu_bytes, H);
    }
  };
  // Copies the quantized x rows of pairs [p0, p1) into pair order (x_pairs), where the batched
  // kernels read an expert's tokens at one stride.
  auto gather_pairs = [=](MoePrep& pr, int64_t p0, int64_t p1) {
    for (int64_t i = p0; i < p1; ++i)
      std::memcpy(pr.x_pairs.data() + size_t(i) * xg_bytes,
                  pr.x_gate.data() + size_t(pr.plan.pair_token[size_t(i)]) * xg_bytes, xg_bytes);
  };
  // Quantizes act rows of the dot-path pairs in [p0, p1) into pr.
  auto quantize_act = [=](MoePrep& pr, int64_t p0, int64_t p1) {
    for (int64_t i = p0; i < p1; ++i)
      quant::quantize_row(kd->act_type, sc->act.data() + i * I, pr.act_q.data() + size_t(i) * aq_bytes, I);
  };

  if (!sc->small) {
    cs.record("moe_plan", [=](int ith, int nth) {
      int64_t b, e;
      split_range(T, ith, nth, &b, &e);
      prepare(sc->shared, ith == 0, b, e);
    });
  }
  if (!sc->small && (any_gemm || any_batched)) {
    cs.record("moe_gather", [=](int ith, int nth) {
      const MoePlan& p = sc->shared.plan;
      for (int32_t e : p.active) {
        const bool gemm = sc->gemm(p.count(e));
        if (!gemm && !sc->batched(p.count(e))) continue;
        int64_t b, end;
        split_range(p.count(e), ith, nth, &b, &end);
        if (!gemm) {
          gather_pairs(sc->shared, p.first(e) + b, p.first(e) + end);
          continue;
        }
        for (int64_t i = p.first(e) + b; i < p.first(e) + end; ++i)
          std::memcpy(sc->xs.data() + i * H, host_ptr<float>(x) + p.pair_token[size_t(i)] * H, size_t(H) * 4);
      }
    });
  }

  cs.record("moe_gate_up", [=](int ith, int nth) {
    MoePrep& pr = sc->prep(ith);
    if (sc->small) {
      prepare(pr, true, 0, T);
      for (int32_t e : pr.plan.active)
        if (sc->batched(pr.plan.count(e))) gather_pairs(pr, pr.plan.first(e), pr.plan.first(e) + pr.plan.count(e));
    }
    const MoePlan& p = pr.plan;
    int64_t r0, r1;
    split_range(I, ith, nth, &r0, &r1);
    if (r0 >= r1) return;
    float* tile = sc->thread_block(ith);
    float* g = tile + tile_floats;
    float* u = g + out_floats;
    const size_t grb = gate.row_bytes(), urb = up.row_bytes();
    for (int32_t e : p.active) {
      const int64_t p0 = p.first(e), n = p.count(e);
      const char* ge = host_ptr<char>(gate) + size_t(e) * gate_bytes;
      const char* ue = host_ptr<char>(up) + size_t(e) * up_bytes;
      if (sc->gemm(n)) {
        for (int64_t c0 = r0; c0 < r1; c0 += kGemmTileRows) {
          const int64_t rows = std::min(kGemmTileRows, r1 - c0);
          gemm_nt(sc->xs.data() + p0 * H, rows_f32(gate, ge, c0, rows, tile), g, n, rows, H);
          gemm_nt(sc->xs.data() + p0 * H, rows_f32(up, ue, c0, rows, tile), u, n, rows, H);
          for (int64_t i = 0; i < n; ++i)
            cpu::silu_mul(g + i * rows, u + i * rows, sc->act.data() + (p0 + i) * I + c0, rows);
        }
        continue;
      }
      if (sc->batched(n)) {  // g, u: [n, rows]
        const char* xq = pr.x_pairs.data() + size_t(p0) * xg_bytes;
        for (int64_t c0 = r0; c0 < r1; c0 += kDotChunkRows) {
          const int64_t rows = std::min(kDotChunkRows, r1 - c0);
          for (int64_t j = 0; j < n; j += kBatchTokens) {
            const int64_t m = std::min(kBatchTokens, n - j);
            sc->batch_gate(H, ge + c0 * grb, grb, rows, xq + size_t(j) * xg_bytes, xg_bytes, m, g + j * rows, rows);
            sc->batch_up(H, ue + c0 * urb, urb, rows, xq + size_t(j) * xg_bytes, xg_bytes, m, u + j * rows, rows);
          }
          for (int64_t i = 0; i < n; ++i)
            cpu::silu_mul(g + i * rows, u + i * rows, sc->act.data() + (p0 + i) * I + c0, rows);
        }
        continue;
      }
      const int64_t step = sc->small && n == 1 ? r1 - r0 : kDotChunkRows;
      for (int64_t c0 = r0; c0 < r1; c0 += step) {
        const int64_t rows = std::min(step, r1 - c0);
        for (int64_t i = p0; i < p0 + n; ++i) {
          const int64_t t = p.pair_token[size_t(i)];
          const float* xr = host_ptr<float>(x) + t * H;
          const void* ag = quant_gate ? static_cast<const void*>(pr.x_gate.data() + size_t(t) * xg_bytes) : xr;
          const void* au = quant_up ? static_cast<const void*>(pr.x_up.data() + size_t(t) * xu_bytes)
                         : ku->act_type == DType::F32 ? static_cast<const void*>(xr) : ag;
          kg->dot_rows(H, ge + c0 * grb, grb, rows, ag, g);
          ku->dot_rows(H, ue + c0 * urb, urb, rows, au, u);
          cpu::silu_mul(g, u, sc->act.data() + i * I + c0, rows);
        }
      }
    }
  });

  if (quant_act && !sc->small) {
    cs.record("moe_quantize_act", [=](int ith, int nth) {
      const MoePlan& p = sc->shared.plan;
      for (int32_t e : p.active) {
        if (sc->gemm(p.count(e))) continue;  // sgemm experts read act as f32
        int64_t b, end;
        split_range(p.count(e), ith, nth, &b, &end);
        quantize_act(sc->shared, p.first(e) + b, p.first(e) + end);
      }
    });
  }

  cs.record("moe_down", [=](int ith, int nth) {
    MoePrep& pr = sc->prep(ith);
    const MoePlan& p = pr.plan;
    int64_t r0, r1;
    split_range(H, ith, nth, &r0, &r1);
    if (r0 >= r1) return;
    if (quant_act && sc->small) quantize_act(pr, 0, p.start.back());
    float* o = host_ptr<float>(out);
    for (int64_t t = 0; t < T; ++t) std::memset(o + t * H + r0, 0, size_t(r1 - r0) * 4);
    float* tile = sc->thread_block(ith);
    float* y = tile + tile_floats;
    const size_t drb = down.row_bytes();
    for (int32_t e : p.active) {
      const int64_t p0 = p.first(e), n = p.count(e);
      const char* de = host_ptr<char>(down) + size_t(e) * down_bytes;
      const bool gemm = sc->gemm(n), batched = sc->batched(n);
      const int64_t step = gemm ? kGemmTileRows : sc->small && n == 1 ? r1 - r0 : kDotChunkRows;
      for (int64_t c0 = r0; c0 < r1; c0 += step) {
        const int64_t rows = std::min(step, r1 - c0);
        if (gemm) gemm_nt(sc->act.data() + p0 * I, rows_f32(down, de, c0, rows, tile), y, n, rows, I);
        for (int64_t j = 0; batched && j < n; j += kBatchTokens)
          sc->batch_down(I, de + c0 * drb, drb, rows, pr.act_q.data() + size_t(p0 + j) * aq_bytes, aq_bytes,
                         std::min(kBatchTokens, n - j), y + j * rows, rows);
        for (int64_t i = 0; i < n; ++i) {
          float* yi = y + i * rows;
          if (!gemm && !batched) {
            const void* a = quant_act ? static_cast<const void*>(pr.act_q.data() + size_t(p0 + i) * aq_bytes)
                                      : static_cast<const void*>(sc->act.data() + (p0 + i) * I);
            kd->dot_rows(I, de + c0 * drb, drb, rows, a, yi);
          }
          cpu::axpy_f32(p.pair_weight[size_t(p0 + i)], yi, o + p.pair_token[size_t(p0 + i)] * H + c0, rows);
        }
      }
    }
  });
}

}  // namespace ferrum
