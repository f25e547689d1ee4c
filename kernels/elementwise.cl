// Row and element kernels: norms, SwiGLU, row gather, MoE routing. Offsets are in elements.

static inline float rms_inv(const global float* x, int d, float eps) {
  float16 acc = (float16)(0.0f);
  int i = 0;
  for (; i + 16 <= d; i += 16) {
    const float16 v = vload16(0, x + i);
    acc = fma(v, v, acc);
  }
  float ss = sum16(acc);
  for (; i < d; ++i) ss = fma(x[i], x[i], ss);
  return 1.0f / sqrt(ss / (float)d + eps);
}

// One work-group per row: the rows are short (hidden size), a row's loop is cheap.
kernel void rms_norm(const global float* x, long x_off, const global float* w, long w_off,
                     float eps, global float* out, long out_off, int rows, int d) {
  const int r = (int)get_global_id(0);
  if (r >= rows) return;
  x += x_off + (long)r * d;
  w += w_off;
  out += out_off + (long)r * d;
  const float inv = rms_inv(x, d, eps);
  for (int i = 0; i < d; ++i) out[i] = x[i] * inv * w[i];
}

// residual += x; out = rms_norm(residual) * w.
kernel void add_rms_norm(global float* res, long res_off, const global float* x, long x_off,
                         const global float* w, long w_off, float eps, global float* out,
                         long out_off, int rows, int d) {
  const int r = (int)get_global_id(0);
  if (r >= rows) return;
  res += res_off + (long)r * d;
  x += x_off + (long)r * d;
  w += w_off;
  out += out_off + (long)r * d;
  for (int i = 0; i < d; ++i) res[i] += x[i];
  const float inv = rms_inv(res, d, eps);
  for (int i = 0; i < d; ++i) out[i] = res[i] * inv * w[i];
}

// out[r, i] = silu(gu[r, i]) * gu[r, n + i]; one work-item per 16 elements of a row (vector
// exp, and no per-element index division).
kernel void swiglu(const global float* gu, long gu_off, global float* out, long out_off,
                   int rows, int n) {
  const int chunks = (n + 15) / 16;
  const int gid = (int)get_global_id(0);
  if (gid >= rows * chunks) return;
  const int r = gid / chunks, i = (gid % chunks) * 16;
  const global float* g = gu + gu_off + (long)r * 2 * n;
  global float* o = out + out_off + (long)r * n;
  if (i + 16 <= n) {
    const float16 gv = vload16(0, g + i);
    vstore16(gv / (1.0f + exp(-gv)) * vload16(0, g + n + i), 0, o + i);
    return;
  }
  for (int j = i; j < n; ++j) o[j] = g[j] / (1.0f + exp(-g[j])) * g[n + j];
}

// out[r, :] = x[idx[r], :]; rows outside x become zeros.
kernel void gather_rows(const global float* x, long x_off, int x_rows, const global int* idx,
                        long idx_off, global float* out, long out_off, int rows, int d) {
  const long i = get_global_id(0);
  if (i >= (long)rows * d) return;
  const int r = (int)(i / d), j = (int)(i % d);
  const int src = idx[idx_off + r];
  out[out_off + i] = (src >= 0 && src < x_rows) ? x[x_off + (long)src * d + j] : 0.0f;
}

// out[r, j] = x[r, idx[j]] (idx within the row, checked at load).
kernel void gather_columns(const global float* x, long x_off, int x_cols, const global int* idx,
                           long idx_off, global float* out, long out_off, int rows, int n) {
  const long i = get_global_id(0);
  if (i >= (long)rows * n) return;
  const int r = (int)(i / n), j = (int)(i % n);
  out[out_off + i] = x[x_off + (long)r * x_cols + idx[idx_off + j]];
}

// sums[r, g] = the 32-column blocks b of x's row r with block_groups[b] == g added up, the
// blocks in order (each block's columns in order).
kernel void group_sums(const global float* x, long x_off, const global int* block_groups, long bg_off,
                       global float* sums, long sums_off, int rows, int blocks, int groups) {
  const long i = get_global_id(0);
  if (i >= (long)rows * groups) return;
  const int r = (int)(i / groups), g = (int)(i % groups);
  const global float* xr = x + x_off + (long)r * blocks * 32;
  float acc = 0.0f;
  for (int b = 0; b < blocks; ++b) {
    if (block_groups[bg_off + b] != g) continue;
    float block = 0.0f;
    for (int j = 0; j < 32; ++j) block += xr[b * 32 + j];
    acc += block;
  }
  sums[sums_off + i] = acc;
}

// offsets[:, o] . sums[:] over the groups in order, offsets [groups, n] (an asymmetric 8-bit
// projection's zeros).
float group_offsets_dot(const global float* offsets, int n, int o, const global float* sums, int groups) {
  float acc = 0.0f;
  for (int g = 0; g < groups; ++g) acc += offsets[(long)g * n + o] * sums[g];
  return acc;
}

// out[r, n] += offsets[:, n] . sums[r, :].
kernel void add_group_offsets(const global float* sums, long sums_off, const global float* offsets, long off_off,
                              global float* out, long out_off, int out_cols, int rows, int n, int groups) {
  const long i = get_global_id(0);
  if (i >= (long)rows * n) return;
  const int r = (int)(i / n), o = (int)(i % n);
  out[out_off + (long)r * out_cols + o] +=
      group_offsets_dot(offsets + off_off, n, o, sums + sums_off + (long)r * groups, groups);
}

// moe_experts' act-order experts: out[p, j] = x[p / div, order[e, j]] for pair p of expert
// e = ids[p] (zeros for ids outside [0, E) and orders outside [0, cols)).
kernel void moe_gather_columns(const global float* x, long x_off, int div, const global int* ids, long ids_off,
                               int experts, const global int* order, long order_off, global float* out,
                               long out_off, int pairs, int cols) {
  const long i = get_global_id(0);
  if (i >= (long)pairs * cols) return;
  const int p = (int)(i / cols), j = (int)(i % cols), e = ids[ids_off + p];
  float v = 0.0f;
  if (e >= 0 && e < experts) {
    const int c = order[order_off + (long)e * cols + j];
    if (c >= 0 && c < cols) v = x[x_off + (long)(p / div) * cols + c];
  }
  out[out_off + i] = v;
}

// moe_experts' asymmetric 8-bit experts: out[p, col + o] += offsets[e, :, o] . sums[p / div, :]
// for pair p of expert e = ids[p] (ids outside [0, E) add nothing).
kernel void moe_add_group_offsets(const global float* sums, long sums_off, int div, const global int* ids, long ids_off,
                                  int experts, const global float* offsets, long off_off, global float* out,
                                  long out_off, int out_cols, int col, int pairs, int n, int groups) {
  const long i = get_global_id(0);
  if (i >= (long)pairs * n) return;
  const int p = (int)(i / n), o = (int)(i % n), e = ids[ids_off + p];
  if (e < 0 || e >= experts) return;
  out[out_off + (long)p * out_cols + col + o] +=
      group_offsets_dot(offsets + off_off + (long)e * groups * n, n, o, sums + sums_off + (long)(p / div) * groups, groups);
}

// Router (semantics in cpp/backend/backend.h): one work-item per token. p = softmax(logits) in
// f32 with the CPU backend's operation order; the top_k experts by p, largest first, equal p:
// lower id first. Instead of marking picked experts, pick j is the best expert strictly after
// pick j - 1 in the order (p descending, id ascending), recomputing p (no per-token scratch).
// NaN probabilities are never picked; a slot left without an expert gets id -1, weight 0.
kernel void moe_route(const global float* logits, long l_off, int T, int E, int k, int normalize,
                      global int* ids, long ids_off, global float* wts, long w_off) {
  const int t = (int)get_global_id(0);
  if (t >= T) return;
  const global float* l = logits + l_off + (long)t * E;
  ids += ids_off + (long)t * k;
  wts += w_off + (long)t * k;
  float mx = l[0];
  for (int i = 1; i < E; ++i) mx = mx < l[i] ? l[i] : mx;  // std::max's NaN behaviour
  float sum = 0.0f;
  for (int i = 0; i < E; ++i) sum += exp(l[i] - mx);
  float prev_p = INFINITY, picked = 0.0f;
  int prev_i = -1;
  for (int j = 0; j < k; ++j) {
    int best = -1;
    float bp = 0.0f;
    for (int i = 0; i < E; ++i) {
      const float p = exp(l[i] - mx) / sum;
      if (!(p >= 0.0f)) continue;
      if (!(p < prev_p || (p == prev_p && i > prev_i))) continue;  // picked already
      if (best < 0 || p > bp) {
        best = i;
        bp = p;
      }
    }
    if (best < 0) {
      ids[j] = -1;
      wts[j] = 0.0f;
      continue;
    }
    ids[j] = best;
    wts[j] = bp;
    picked += bp;
    prev_p = bp;
    prev_i = best;
  }
  if (normalize)
    for (int j = 0; j < k; ++j) wts[j] /= picked;
}

// Groups the (token, slot) pairs p = t * k + j of a prompt by expert for moe.cl's tiles:
// groups[0, P) = the pairs with an id in [0, E), by expert, then by p; groups[P + 3i, +3) = tile
// i: (expert, index of its first pair in the order, count <= TM), an expert's pairs split into
// tiles of TM; the tiles after the last get expert -1. max_tiles >= ceil(P / TM) + min(E, P).
// One work-group; scratch: 2E ints. O(P * E) comparisons: small next to the matmuls it serves.
kernel void moe_group(const global int* ids, long ids_off, int P, int E, int TM, int max_tiles,
                      global int* groups, long g_off, local int* scratch) {
  const int lid = (int)get_local_id(0), L = (int)get_local_size(0);
  ids += ids_off;
  groups += g_off;
  local int* count = scratch;
  local int* first = scratch + E;
  for (int e = lid; e < E; e += L) {
    int c = 0;
    for (int p = 0; p < P; ++p) c += ids[p] == e;
    count[e] = c;
  }
  barrier(CLK_LOCAL_MEM_FENCE);
  if (lid == 0) {
    int pos = 0, tile = 0;
    for (int e = 0; e < E; ++e) {
      first[e] = pos;
      for (int f = 0; f < count[e]; f += TM, ++tile) {
        global int* t = groups + P + 3 * tile;
        t[0] = e;
        t[1] = pos + f;
        t[2] = min(TM, count[e] - f);
      }
      pos += count[e];
    }
    for (; tile < max_tiles; ++tile) groups[P + 3 * tile] = -1;
  }
  barrier(CLK_LOCAL_MEM_FENCE);
  for (int e = lid; e < E; e += L) {
    int pos = first[e];
    for (int p = 0; p < P; ++p)
      if (ids[p] == e) groups[pos++] = p;
  }
}

// out[t, h] = sum_j wts[t, j] * y[t * k + j, h] over the slots with an id in [0, E), in slot
// order (deterministic, no atomics). One work-item per output element.
kernel void moe_combine(const global float* y, long y_off, const global int* ids, long ids_off,
                        const global float* wts, long w_off, int T, int k, int E, int H,
                        global float* out, long out_off) {
  const int gid = (int)get_global_id(0);
  if (gid >= T * H) return;
  const int t = gid / H, h = gid % H;
  float s = 0.0f;
  for (int j = 0; j < k; ++j) {
    const int e = ids[ids_off + (long)t * k + j];
    if (e >= 0 && e < E) s += wts[w_off + (long)t * k + j] * y[y_off + ((long)t * k + j) * H + h];
  }
  out[out_off + gid] = s;
}
