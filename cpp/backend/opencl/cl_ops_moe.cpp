// Mixture-of-experts ops (semantics in backend/backend.h). Routing is data: every kernel reads
// ids / weights from device buffers when the stream runs, so a recorded stream replays with new
// routing.
//   moe_route    one work-item per token (kernels/elementwise.cl).
//   moe_experts  per (token, slot) pair p: gu[p] = (gate[e] x, up[e] x), act[p] = swiglu(gu[p]),
//                y[p] = down[e] act[p], then out[t] = sum_j weights[t, j] y[t * k + j] by
//                moe_combine in slot order (deterministic, no atomics). The matmuls read only
//                the selected experts' rows: for decodes and short prompts by moe_rows (the
//                linear_t1 row dot, a pair at a time); for a prompt by moe_tiles over the pairs
//                grouped by expert on the device (moe_group), so each expert's rows are read
//                once per tile of its tokens, not once per token. moe_rows quantizes the
//                activations to 8 bits as linear does for decodes (not for scoring steps).
// The gpu family runs the same steps with its own matmuls (kernels/gpu_moe.cl: the GEMV's lane
// groups per (pair, rows), its tiled GEMM over each expert's grouped pairs).
#include <algorithm>
#include <utility>
#include <vector>

#include "backend/op_checks.h"
#include "backend/opencl/cl_backend.h"
#include "core/error.h"

namespace ferrum::ocl {

namespace {
// Pairs per expert (on average) from which a prompt's experts run grouped tiles rather than a
// row dot per pair.
constexpr int64_t kMinPairsPerExpert = 8;
}  // namespace

void ClBackend::moe_route(Stream& s, const Tensor& logits, int64_t top_k, bool normalize,
                          const Tensor& ids, const Tensor& weights) {
  checks::moe_route(logits, top_k, ids, weights);
  const int64_t T = logits.rows(), E = logits.cols();
  if (T == 0) return;
  Launch l = launch(elementwise_program(), "moe_route", T, 4);
  KernelArgs(l).tensor(logits, "moe_route").i32(T).i32(E).i32(top_k).i32(normalize ? 1 : 0)
      .tensor(ids, "moe_route").tensor(weights, "moe_route");
  record(s, std::move(l));
}

// y[p, col + n] = w[ids[p]][n, :] . x[p / x_div, :] for the pairs p < P, rows n < w.dim(1).
// xq: x quantized by quantize_q8 (undefined: f32 activations).
void ClBackend::moe_rows(Stream& s, const Tensor& x, const Tensor& xq, int64_t x_div, const Tensor& w,
                         const Tensor& ids, const Tensor& y, int64_t col) {
  const int64_t P = ids.numel(), E = w.dim(0), N = w.dim(1), K = w.dim(2);
  const bool gpu = family_ == KernelFamily::Gpu, q8 = xq.defined();
  cl_program program = gpu ? gpu_linear_program(w) : linear_program(w.dtype);
  const char* kernel = gpu ? (q8 ? "moe_gemv_q8" : "moe_gemv") : (q8 ? "moe_rows_q8" : "moe_rows");
  const int64_t gpu_rows_per_group = int64_t(tuning_.gemv_groups) * tuning_.gemv_rows;
  const BufferView o = single_buffer(y, "moe_experts");
  bool first = true;
  for (const RowSegment& seg : row_segments(w, "moe_experts")) {
    if (seg.rows == 0 && !first) continue;
    Launch l;
    if (gpu) {  // a work-group per (pair, rows)
      l = launch_groups(program, kernel, P * ((N + gpu_rows_per_group - 1) / gpu_rows_per_group), tuning_.gemv_wg());
    } else {  // a work-item per (pair, row), a pair's rows padded to whole work-groups
      l = launch(program, kernel, P * N, 64);
      l.global = size_t(P) * ((size_t(N) + l.local - 1) / l.local * l.local);
    }
    KernelArgs a(l);
    a.tensor(q8 ? xq : x, "moe_experts").i32(x_div).i32(K)
        .tensor(ids, "moe_experts").i32(P).i32(E).i32(N)
        .buffer(seg.mem, int64_t(seg.byte_offset), w.storage).i64(int64_t(w.row_bytes()))
        .i64(seg.first_row).i64(seg.rows).i32(first ? 1 : 0)
        .buffer(o.mem, int64_t(o.byte_offset / 4) + col, y.storage).i32(y.cols());
    if (!q8 && !gpu) a.local_floats(K / 32);  // the sums of x per 32-element chunk (see linear_t1)
    first = false;
    record(s, std::move(l), /*keeps_quantized=*/true);
  }
}

// groups for moe_tiles with tiles of up to tile_tokens pairs (layout in elementwise.cl).
Tensor ClBackend::moe_group(Stream& s, const Tensor& ids, int64_t E, int64_t tile_tokens) {
  constexpr int64_t kTileRun = 16;  // TILE_RUN in moe.cl
  const int64_t P = ids.numel();
  const int64_t max_tiles = ((P + tile_tokens - 1) / tile_tokens + std::min(E, P) + kTileRun - 1) / kTileRun * kTileRun;
  Tensor groups = alloc(DType::I32, {P + 3 * max_tiles});
  const int64_t work_items = std::min<int64_t>(64, int64_t(device_info().max_work_group));
  Launch l = launch(elementwise_program(), "moe_group", work_items, work_items);
  KernelArgs(l).tensor(ids, "moe_experts").i32(P).i32(E).i32(tile_tokens).i32(max_tiles)
      .tensor(groups, "moe_experts").local_ints(2 * E);
  record(s, std::move(l));
  return groups;
}

void ClBackend::moe_tiles(Stream& s, const Tensor& x, int64_t x_div, const Tensor& w,
                          const Tensor& groups, int64_t P, const MatmulTile& tile, const Tensor& y,
                          int64_t col) {
  const int64_t N = w.dim(1), K = w.dim(2);
  const int64_t max_tiles = (groups.numel() - P) / 3, row_tiles = (N + tile.rows - 1) / tile.rows;
  const bool gpu = family_ == KernelFamily::Gpu;
  cl_program program = gpu ? gpu_linear_program(w) : linear_program(w.dtype);
  const BufferView o = single_buffer(y, "moe_experts");
  for (const RowSegment& seg : row_segments(w, "moe_experts")) {
    if (seg.rows == 0) continue;
    Launch l = gpu ? launch_groups(program, tile.moe_kernel, max_tiles * row_tiles, tuning_.gemm_items())
                   : launch(program, tile.moe_kernel, max_tiles * row_tiles, 16);
    KernelArgs(l)
        .tensor(x, "moe_experts").i32(x_div).i32(K)
        .tensor(groups, "moe_experts").i32(P).i32(max_tiles).i32(N)
        .buffer(seg.mem, int64_t(seg.byte_offset), w.storage).i64(int64_t(w.row_bytes()))
        .i64(seg.first_row).i64(seg.rows)
        .buffer(o.mem, int64_t(o.byte_offset / 4) + col, y.storage).i32(y.cols());
    record(s, std::move(l));
  }
}

void ClBackend::moe_add_group_offsets(Stream& s, const Tensor& in, int64_t x_div, const ExpertOffsets& o,
                                      const Tensor& ids, const Tensor& y, int64_t col) {
  if (!o.defined()) return;
  const int64_t rows = in.rows(), G = o.offsets.dim(1), N = o.offsets.dim(2), P = y.rows();
  if (rows == 0 || G == 0 || N == 0) return;
  const Tensor sums = group_sums(s, in, o.block_groups, G);
  Launch a = launch(elementwise_program(), "moe_add_group_offsets", P * N, 64);
  KernelArgs(a).tensor(sums, "moe_experts").i32(x_div).tensor(ids, "moe_experts").i32(o.offsets.dim(0))
      .tensor(o.offsets, "moe_experts").tensor(y, "moe_experts").i32(y.cols()).i32(col).i32(P).i32(N).i32(G);
  record(s, std::move(a));
}

Tensor ClBackend::moe_gather_columns(Stream& s, const Tensor& in, int64_t x_div, const Tensor& order,
                                     const Tensor& ids, int64_t pairs) {
  const int64_t K = in.cols();
  Tensor out = alloc(DType::F32, {pairs, K});
  if (pairs == 0 || K == 0) return out;
  Launch l = launch(elementwise_program(), "moe_gather_columns", pairs * K, 64);
  KernelArgs(l).tensor(in, "moe_experts").i32(x_div).tensor(ids, "moe_experts").i32(order.dim(0))
      .tensor(order, "moe_experts").tensor(out, "moe_experts").i32(pairs).i32(K);
  record(s, std::move(l));
  return out;
}

void ClBackend::moe_experts(Stream& s, const Tensor& x, const Tensor& gate, const Tensor& up,
                            const Tensor& down, const Tensor& ids, const Tensor& weights,
                            const Tensor& out, const MoeExtras& extras) {
  checks::moe_experts(x, gate, up, down, ids, weights, out, extras);
  for (const Tensor* w : {&gate, &up, &down}) linear_program(w->dtype);  // ValueError for unsupported types
  const int64_t T = x.rows(), H = x.cols(), E = gate.dim(0), I = gate.dim(1), k = ids.cols();
  const int64_t P = T * k;
  if (T == 0 || H == 0) return;
  Tensor y = placeholder();  // k == 0: moe_combine reads nothing and writes zeros
  // Act-order experts read their inputs gathered pair by pair, in each expert's order.
  int64_t x_div = k;
  Tensor xin = x;
  if (extras.gate_up_order.defined() && P > 0) {
    xin = moe_gather_columns(s, x, k, extras.gate_up_order, ids, P);
    x_div = 1;
  }
  const auto down_input = [&](const Tensor& act) {
    return extras.down_order.defined() ? moe_gather_columns(s, act, 1, extras.down_order, ids, P) : act;
  };
  // A prompt (not a batch of decodes, whose tokens must each get what they get alone) with
  // enough pairs per expert for a tile to share its weight reads: grouped by expert.
  const bool grouped = s.decode_rows == 0 && P >= kMinPairsPerExpert * E && I > 0;
  if (grouped) {
    y = alloc(DType::F32, {P, H});
    Tensor gu = alloc(DType::F32, {P, 2 * I}), act = alloc(DType::F32, {P, I});
    std::vector<std::pair<int64_t, Tensor>> groupings;  // per tile height, made when first needed
    const bool gpu = family_ == KernelFamily::Gpu;
    auto tiles = [&](const Tensor& in, int64_t x_div, const Tensor& w, const Tensor& out, int64_t col) {
      const MatmulTile tile = gpu ? MatmulTile{tuning_.gemm_tm, tuning_.gemm_tn, "", "moe_gemm"}
                                  : matmul_tile(w.dtype, P / E);
      auto g = std::find_if(groupings.begin(), groupings.end(), [&](const auto& p) { return p.first == tile.tokens; });
      if (g == groupings.end()) g = groupings.insert(g, {tile.tokens, moe_group(s, ids, E, tile.tokens)});
      moe_tiles(s, in, x_div, w, g->second, P, tile, out, col);
    };
    tiles(xin, x_div, gate, gu, 0);
    tiles(xin, x_div, up, gu, I);
    moe_add_group_offsets(s, xin, x_div, extras.gate, ids, gu, 0);
    moe_add_group_offsets(s, xin, x_div, extras.up, ids, gu, I);
    swiglu(s, gu, act);
    const Tensor a = down_input(act);
    tiles(a, 1, down, y, 0);
    moe_add_group_offsets(s, a, 1, extras.down, ids, y, 0);
  } else if (P > 0) {
    y = alloc(DType::F32, {P, H});
    if (I > 0) {
      // As linear: 8-bit activations (x quantized once for gate and up) unless the step is scoring.
      Tensor xq, actq;
      auto activations = [&](const Tensor& in, const Tensor& w, Tensor& quantized) {
        if (s.float_activations || !dot_q8(w.dtype)) return Tensor();
        if (!quantized.defined())
          quantized = family_ == KernelFamily::Gpu ? gpu_quantized(s, gpu_linear_program(w), in)
                                                   : quantize_q8(s, linear_program(w.dtype), in);
        return quantized;
      };
      Tensor gu = alloc(DType::F32, {P, 2 * I}), act = alloc(DType::F32, {P, I});
      moe_rows(s, xin, activations(xin, gate, xq), x_div, gate, ids, gu, 0);
      moe_rows(s, xin, activations(xin, up, xq), x_div, up, ids, gu, I);
      moe_add_group_offsets(s, xin, x_div, extras.gate, ids, gu, 0);
      moe_add_group_offsets(s, xin, x_div, extras.up, ids, gu, I);
      swiglu(s, gu, act);
      const Tensor a = down_input(act);
      moe_rows(s, a, activations(a, down, actq), 1, down, ids, y, 0);
      moe_add_group_offsets(s, a, 1, extras.down, ids, y, 0);
    } else {
      moe_rows(s, x, Tensor(), 1, down, ids, y, 0);  // K = 0: writes zeros, reads no activations
    }
  }
  Launch l = launch(elementwise_program(), "moe_combine", T * H, 256);
  KernelArgs(l).tensor(y, "moe_experts").tensor(ids, "moe_experts").tensor(weights, "moe_experts")
      .i32(T).i32(k).i32(E).i32(H).tensor(out, "moe_experts");
  record(s, std::move(l));
}

}  // namespace ferrum::ocl
