// linear and embedding for the gpu family (after gpu_common.cl, quantize.cl, gpu_weights.cl).
//
// out[t, n] = x[t, :] . W[n, :] (+ bias[n]).
// - gemv_q8_t1 / gemv_q8_tn: decodes over the quantized types with 8-bit activations (xq from
//   quantize_q8_rows, or from the norm / SwiGLU kernel that produced x: gpu_rows.cl). A lane group
//   (LANES consecutive work-items) takes GEMV_ROWS weight rows; lane l reads chunks l, l + LANES,
//   ... of each, so a group's loads of one row are contiguous; the chunk's activations are loaded
//   once for its GEMV_ROWS rows. Integer dots per 16 quants (dp4a on NVIDIA), scaled per 16 by
//   d_w * d_x; then a tree over the lanes (lane_sums). _tn runs a batch of decodes GEMV_TOKENS
//   tokens per pass, each chunk decoded once per pass; every token's sum is formed as in _t1
//   (the same operations in the same order), so a decode gives the same bits alone or batched.
// - gemv_f32_t1 / gemv_f32_tn: the same over f32 activations (float weights, Q2_K / Q3_K,
//   scoring steps, prompts of up to GEMV_TOKENS tokens).
// - gemm: longer prompts. A work-group computes a GEMM_TM x GEMM_TN tile of out: per K step of
//   GEMM_TK it stages x and the dequantized weights in local memory, then every work-item
//   accumulates a GEMM_WM x GEMM_WN register block (tokens and rows strided across the
//   work-group, so neighbouring work-items read neighbouring local words). Each output is a
//   sequential FMA chain over k: it does not depend on the tile or the other tokens.
#pragma OPENCL FP_CONTRACT OFF

#define LINEAR_ARGS_OF(X)                                                                    \
  const global X *x, long x_off, int T, int K, const global uchar *w, long w_off,             \
      long w_row_bytes, int N, const global float *bias, long bias_off, int has_bias,         \
      global float *out, long out_off, int ldo
#define LINEAR_ARGS LINEAR_ARGS_OF(float)

#ifdef W_FLOAT
#define W_BLOCKS(K) 0
#define UNUSED_BY_FLOATS(x) (void)(x)
#else
#define W_BLOCKS(K) ((K) / (CHUNK * W_CHUNKS))
#define UNUSED_BY_FLOATS(x)
#endif

// Writes lane 0's totals v[r * TM + m] (rows n0 + r, tokens t0 + m) of each lane group.
inline void gemv_store(const int TM, const float* v, int lane, int n0, int N, int t0, int T,
                       const global float* bias, int has_bias, global float* out, int ldo) {
  if (lane != 0) return;
#pragma unroll
  for (int r = 0; r < GEMV_ROWS; ++r)
#pragma unroll
    for (int m = 0; m < TM; ++m) {
      const int n = n0 + r, t = t0 + m;
      if (n < N && t < T) out[(long)t * ldo + n] = has_bias ? v[r * TM + m] + bias[n] : v[r * TM + m];
    }
}

// One lane's partial sums acc[r * TM + m] = sum over its chunks of W[n0 + r] . x[t0 + m] (rows
// outside [0, N) read row 0 or N - 1: their sums are not stored).
inline void gemv_f32_partial(const int TM, const global float* x, int T, int K, int t0,
                             const global uchar* w, long w_row_bytes, int N, int n0, int lane, float* acc) {
  const int chunks = K / CHUNK, nb = W_BLOCKS(K);
  UNUSED_BY_FLOATS(nb);
  for (int c = lane; c < chunks; c += LANES) {
    float16 xl[GEMV_TOKENS], xh[GEMV_TOKENS];
#ifdef W_HAS_MIN
    float sl[GEMV_TOKENS], sh[GEMV_TOKENS];
#endif
#pragma unroll
    for (int m = 0; m < TM; ++m) {
      const global float* xr = x + (long)min(t0 + m, T - 1) * K + CHUNK * c;
      xl[m] = vload16(0, xr);
      xh[m] = vload16(1, xr);
#ifdef W_HAS_MIN
      sl[m] = sum16(xl[m]);
      sh[m] = sum16(xh[m]);
#endif
    }
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r) {
      const global uchar* row = w + (long)clamp(n0 + r, 0, N - 1) * w_row_bytes;
#ifdef W_FLOAT
      float16 wl, wh;
      chunk_f(row, c, &wl, &wh);
#pragma unroll
      for (int m = 0; m < TM; ++m) acc[r * TM + m] += fdot16(wl, xl[m]) + fdot16(wh, xh[m]);
#else
      uint4 ql, qh;
      float2 d, mn;
      chunk_q(row, nb, c, &ql, &qh, &d, &mn);
      const float16 fl = quants_float(ql), fh = quants_float(qh);
#pragma unroll
      for (int m = 0; m < TM; ++m) {
        float a = fma(d.s0, fdot16(fl, xl[m]), acc[r * TM + m]);
        a = fma(d.s1, fdot16(fh, xh[m]), a);
#ifdef W_HAS_MIN
        a = fma(mn.s0, sl[m], a);
        a = fma(mn.s1, sh[m], a);
#endif
        acc[r * TM + m] = a;
      }
#endif
    }
  }
#ifdef W_FLOAT  // rows of any length: the last K % 32 elements one per lane
  for (int k = chunks * CHUNK + lane; k < K; k += LANES)
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r) {
      const float wv = load_elem(w + (long)clamp(n0 + r, 0, N - 1) * w_row_bytes, k);
#pragma unroll
      for (int m = 0; m < TM; ++m) acc[r * TM + m] = fma(wv, x[(long)min(t0 + m, T - 1) * K + k], acc[r * TM + m]);
    }
#endif
}

#ifndef W_FLOAT
// The same over xq rows (quantize.cl): chunk c of a token is 32 int8 quants and a scale dx. Per 16
// quants the integer sum of (q + W_Q_ZERO) * xq is exact: dp4a's sum of q * xq plus W_Q_ZERO times
// the sum of xq (computed once per chunk and token, shared by the rows).
#if W_Q_ZERO != 0 || defined(W_HAS_MIN)
#define W_XQ_SUMS 1
#endif
inline void gemv_q8_partial(const int TM, const global char* xq, int T, int K, int t0,
                            const global uchar* w, long w_row_bytes, int N, int n0, int lane, float* acc) {
  const int chunks = K / CHUNK, nb = W_BLOCKS(K);
  for (int c = lane; c < chunks; c += LANES) {
    uint4 xa[GEMV_TOKENS], xb[GEMV_TOKENS];
    float dx[GEMV_TOKENS];
#ifdef W_XQ_SUMS
    int za[GEMV_TOKENS], zb[GEMV_TOKENS];
#endif
#pragma unroll
    for (int m = 0; m < TM; ++m) {
      const global char* xr = xq_row(xq, min(t0 + m, T - 1), K);
      xa[m] = *(const global uint4*)(xr + CHUNK * c);  // xq rows are 16-byte aligned
      xb[m] = *(const global uint4*)(xr + CHUNK * c + 16);
      dx[m] = ((const global float*)(xr + K))[c];
#ifdef W_XQ_SUMS
      za[m] = isum16(xa[m]);
      zb[m] = isum16(xb[m]);
#endif
    }
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r) {
      uint4 ql, qh;
      float2 d, mn;
      chunk_q(w + (long)clamp(n0 + r, 0, N - 1) * w_row_bytes, nb, c, &ql, &qh, &d, &mn);
#pragma unroll
      for (int m = 0; m < TM; ++m) {
        int sa = idot16(ql, xa[m]), sb = idot16(qh, xb[m]);
#if W_Q_ZERO != 0
        sa += W_Q_ZERO * za[m];
        sb += W_Q_ZERO * zb[m];
#endif
        float a = fma(d.s0 * dx[m], (float)sa, acc[r * TM + m]);
        a = fma(d.s1 * dx[m], (float)sb, a);
#ifdef W_HAS_MIN
        a = fma(mn.s0, dx[m] * (float)za[m], a);
        a = fma(mn.s1, dx[m] * (float)zb[m], a);
#endif
        acc[r * TM + m] = a;
      }
    }
  }
}
#endif

// GEMV over all T tokens in passes of TM: the lane group's rows, reduced and stored per pass.
#define GEMV_BODY(TM, PARTIAL, X)                                                                 \
  local float scratch[GEMV_WG * GEMV_ROWS * TM];                                                  \
  const int lid = (int)get_local_id(0), lane = lid % LANES;                                       \
  const int n0 = ((int)get_group_id(0) * GEMV_GROUPS + lid / LANES) * GEMV_ROWS;                  \
  for (int t0 = 0; t0 < T; t0 += TM) {                                                            \
    float acc[GEMV_ROWS * TM];                                                                    \
    for (int i = 0; i < GEMV_ROWS * TM; ++i) acc[i] = 0.0f;                                       \
    PARTIAL(TM, X + x_off, T, K, t0, w + w_off, w_row_bytes, N, n0, lane, acc);                   \
    lane_sums(acc, GEMV_ROWS * TM, scratch);                                                      \
    gemv_store(TM, acc, lane, n0, N, t0, T, bias + bias_off, has_bias, out + out_off, ldo);      \
  }

kernel __attribute__((reqd_work_group_size(GEMV_WG, 1, 1))) void gemv_f32_t1(LINEAR_ARGS) {
  GEMV_BODY(1, gemv_f32_partial, x)
}
kernel __attribute__((reqd_work_group_size(GEMV_WG, 1, 1))) void gemv_f32_tn(LINEAR_ARGS) {
  GEMV_BODY(GEMV_TOKENS, gemv_f32_partial, x)
}
#ifndef W_FLOAT
kernel __attribute__((reqd_work_group_size(GEMV_WG, 1, 1))) void gemv_q8_t1(LINEAR_ARGS_OF(char)) {
  GEMV_BODY(1, gemv_q8_partial, x)
}
kernel __attribute__((reqd_work_group_size(GEMV_WG, 1, 1))) void gemv_q8_tn(LINEAR_ARGS_OF(char)) {
  GEMV_BODY(GEMV_TOKENS, gemv_q8_partial, x)
}
#endif

// ---- GEMM ----
#define GEMM_MD (GEMM_TM / GEMM_WM)  // work-items along tokens
#define GEMM_ND (GEMM_TN / GEMM_WN)  // work-items along weight rows
#define GEMM_ITEMS (GEMM_MD * GEMM_ND)

// Local memory of a GEMM work-group: the staged x and weight tiles, k-major (XS(k, m), WS(k, n));
// the +1 puts consecutive k rows in different banks.
#define GEMM_LOCAL                               \
  local float xs[GEMM_TK * (GEMM_TM + 1)];       \
  local float ws[GEMM_TK * (GEMM_TN + 1)];
#define XS(k, m) xs[(k) * (GEMM_TM + 1) + (m)]
#define WS(k, n) ws[(k) * (GEMM_TN + 1) + (n)]

// The tile of rows [n0, n0 + GEMM_TN) of w times the activation rows xrow[m] of x (-1: none),
// written to out rows orow[m] at columns n0 + ... (+ bias); only the rows [0, N) of w exist (n0
// may be negative: a tile straddling the first row of a buffer). xrow / orow: GEMM_TM entries.
inline void gemm_tile(const global float* x, int K, const local int* xrow, const local int* orow,
                      const global uchar* w, long w_row_bytes, int N, int n0, const global float* bias,
                      int has_bias, global float* out, int ldo, local float* xs, local float* ws) {
  const int lid = (int)get_local_id(0), im = lid % GEMM_MD, in = lid / GEMM_MD;
  const int nb = W_BLOCKS(K);
  UNUSED_BY_FLOATS(nb);
  float acc[GEMM_WM][GEMM_WN];
#pragma unroll
  for (int i = 0; i < GEMM_WM; ++i)
#pragma unroll
    for (int j = 0; j < GEMM_WN; ++j) acc[i][j] = 0.0f;

  for (int k0 = 0; k0 < K; k0 += GEMM_TK) {
    for (int e = lid; e < GEMM_TM * GEMM_TK; e += GEMM_ITEMS) {
      const int m = e / GEMM_TK, k = e % GEMM_TK, r = xrow[m];
      XS(k, m) = r >= 0 && k0 + k < K ? x[(long)r * K + k0 + k] : 0.0f;
    }
#ifdef W_FLOAT
    for (int e = lid; e < GEMM_TN * GEMM_TK; e += GEMM_ITEMS) {
      const int n = e / GEMM_TK, k = e % GEMM_TK;
      WS(k, n) = k0 + k < K ? load_elem(w + (long)clamp(n0 + n, 0, N - 1) * w_row_bytes, k0 + k) : 0.0f;
    }
#else
    for (int e = lid; e < GEMM_TN * (GEMM_TK / CHUNK); e += GEMM_ITEMS) {
      const int n = e / (GEMM_TK / CHUNK), c = e % (GEMM_TK / CHUNK), k = k0 + CHUNK * c;
      float v[CHUNK];
      if (k < K) {
        float16 lo, hi;
        chunk_dequant(w + (long)clamp(n0 + n, 0, N - 1) * w_row_bytes, nb, k / CHUNK, &lo, &hi);
        vstore16(lo, 0, v);
        vstore16(hi, 1, v);
      } else {
        for (int i = 0; i < CHUNK; ++i) v[i] = 0.0f;
      }
      for (int i = 0; i < CHUNK; ++i) WS(CHUNK * c + i, n) = v[i];
    }
#endif
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int k = 0; k < GEMM_TK; ++k) {
      float a[GEMM_WM], b[GEMM_WN];
#pragma unroll
      for (int i = 0; i < GEMM_WM; ++i) a[i] = XS(k, im + i * GEMM_MD);
#pragma unroll
      for (int j = 0; j < GEMM_WN; ++j) b[j] = WS(k, in + j * GEMM_ND);
#pragma unroll
      for (int i = 0; i < GEMM_WM; ++i)
#pragma unroll
        for (int j = 0; j < GEMM_WN; ++j) acc[i][j] = fma(a[i], b[j], acc[i][j]);
    }
    barrier(CLK_LOCAL_MEM_FENCE);
  }
#pragma unroll
  for (int i = 0; i < GEMM_WM; ++i)
#pragma unroll
    for (int j = 0; j < GEMM_WN; ++j) {
      const int o = orow[im + i * GEMM_MD], n = n0 + in + j * GEMM_ND;
      if (o >= 0 && n >= 0 && n < N) out[(long)o * ldo + n] = has_bias ? acc[i][j] + bias[n] : acc[i][j];
    }
}

// Work-groups numbered token tile fastest: neighbours share a weight tile in cache.
kernel __attribute__((reqd_work_group_size(GEMM_ITEMS, 1, 1))) void gemm(LINEAR_ARGS) {
  GEMM_LOCAL
  local int rows[GEMM_TM];
  const int tiles_t = (T + GEMM_TM - 1) / GEMM_TM, g = (int)get_group_id(0);
  const int t0 = (g % tiles_t) * GEMM_TM, n0 = (g / tiles_t) * GEMM_TN;
  for (int m = (int)get_local_id(0); m < GEMM_TM; m += GEMM_ITEMS) rows[m] = t0 + m < T ? t0 + m : -1;
  barrier(CLK_LOCAL_MEM_FENCE);
  gemm_tile(x + x_off, K, rows, rows, w + w_off, w_row_bytes, N, n0, bias + bias_off, has_bias, out + out_off, ldo, xs, ws);
}

// out[t, :] = table[ids[t], :] for the table rows [row0, row0 + nrows) this buffer holds; ids
// outside the vocabulary give zero rows (written by the launch with zero_invalid set). One
// work-item per (token, 32-element chunk), as the cpu family's (whose comments say more).
kernel void embedding_rows(const global int* ids, long ids_off, int T, const global uchar* table,
                           long table_off, long row_bytes, int row0, int nrows, int vocab, int H,
                           int zero_invalid, global float* out, long out_off) {
  const int chunks = (H + CHUNK - 1) / CHUNK;
  const int gid = (int)get_global_id(0);
  const int t = gid / chunks, c = gid % chunks;
  if (t >= T) return;
  const int id = ids[ids_off + t];
  global float* o = out + out_off + (long)t * H + CHUNK * c;
  const int n = min(CHUNK, H - CHUNK * c);
  if (id < 0 || id >= vocab) {
    if (zero_invalid)
      for (int k = 0; k < n; ++k) o[k] = 0.0f;
    return;
  }
  if (id < row0 || id >= row0 + nrows) return;
  const global uchar* row = table + table_off + (long)(id - row0) * row_bytes;
  if (n == CHUNK) {
    float16 lo, hi;
    chunk_dequant(row, W_BLOCKS(H), c, &lo, &hi);
    vstore16(lo, 0, o);
    vstore16(hi, 1, o);
    return;
  }
#ifdef W_FLOAT
  for (int k = 0; k < n; ++k) o[k] = load_elem(row, CHUNK * c + k);
#endif
}
