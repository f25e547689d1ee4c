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
static inline void gemv_store(const int TM, const float* v, int lane, int n0, int N, int t0, int T,
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
// outside [0, N) read row 0 or N - 1: their sums are not stored), for activations of type X read
// a chunk at a time into XC by load_x, weight chunks decoded once per row into WC by load_w, and
// dot(wc, xc, acc) the chunk's contribution.
#define GEMV_PARTIAL(NAME, X, XC, load_x, WC, load_w, dot)                                      \
  static inline void NAME(const int TM, const global X* x, int T, int K, int t0, const global uchar* w, \
                   long w_row_bytes, int N, int n0, int lane, float* acc) {                      \
    const int chunks = K / CHUNK, nb = W_BLOCKS(K);                                              \
    UNUSED_BY_FLOATS(nb);                                                                        \
    for (int c = lane; c < chunks; c += LANES) {                                                 \
      XC xc[GEMV_TOKENS];                                                                        \
      for (int m = 0; m < TM; ++m) xc[m] = load_x(x, min(t0 + m, T - 1), K, c);                 \
      for (int r = 0; r < GEMV_ROWS; ++r) {                                                      \
        const WC wc = load_w(w + (long)clamp(n0 + r, 0, N - 1) * w_row_bytes, nb, c);            \
        for (int m = 0; m < TM; ++m) acc[r * TM + m] = dot(wc, xc[m], acc[r * TM + m]);          \
      }                                                                                          \
    }                                                                                            \
  }

// f32 activations: a chunk's 32 floats and, for the types with mins, their sums per 16.
typedef struct {
  float16 lo, hi;
  float sum_lo, sum_hi;
} x_f32;
static inline x_f32 load_x_f32(const global float* x, int t, int K, int c) {
  x_f32 r;
  r.lo = vload16(0, x + (long)t * K + CHUNK * c);
  r.hi = vload16(1, x + (long)t * K + CHUNK * c);
#ifdef W_HAS_MIN
  r.sum_lo = sum16(r.lo);
  r.sum_hi = sum16(r.hi);
#endif
  return r;
}

// A weight chunk for f32 activations: its values (floats), or its integers as floats with their
// scales and mins per 16 (the scales multiply the 16-product sums, not every weight).
typedef struct {
  float16 lo, hi;
  float2 d, m;
} w_f32;
static inline w_f32 load_w_f32(const global uchar* row, int nb, int c) {
  w_f32 r;
#ifdef W_FLOAT
  chunk_f(row, c, &r.lo, &r.hi);
#else
  uint4 ql, qh;
  chunk_q(row, nb, c, &ql, &qh, &r.d, &r.m);
  r.lo = quants_float(ql);
  r.hi = quants_float(qh);
#endif
  return r;
}
static inline float dot_f32(w_f32 w, x_f32 x, float acc) {
#ifdef W_FLOAT
  return acc + (fdot16(w.lo, x.lo) + fdot16(w.hi, x.hi));
#else
  acc = fma(w.d.s1, fdot16(w.hi, x.hi), fma(w.d.s0, fdot16(w.lo, x.lo), acc));
#ifdef W_HAS_MIN
  acc = fma(w.m.s1, x.sum_hi, fma(w.m.s0, x.sum_lo, acc));
#endif
  return acc;
#endif
}
GEMV_PARTIAL(gemv_f32_chunks, float, x_f32, load_x_f32, w_f32, load_w_f32, dot_f32)

static inline void gemv_f32_partial(const int TM, const global float* x, int T, int K, int t0,
                             const global uchar* w, long w_row_bytes, int N, int n0, int lane, float* acc) {
  gemv_f32_chunks(TM, x, T, K, t0, w, w_row_bytes, N, n0, lane, acc);
#ifdef W_FLOAT  // rows of any length: the last K % 32 elements one per lane
  for (int k = K / CHUNK * CHUNK + lane; k < K; k += LANES)
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r) {
      const float wv = load_elem(w + (long)clamp(n0 + r, 0, N - 1) * w_row_bytes, k);
#pragma unroll
      for (int m = 0; m < TM; ++m) acc[r * TM + m] = fma(wv, x[(long)min(t0 + m, T - 1) * K + k], acc[r * TM + m]);
    }
#endif
}

#ifndef W_FLOAT
// 8-bit activations (xq rows, quantize.cl): a chunk's 32 quants, its scale dx and, where the
// weights have a zero point or mins, the sums of its quants per 16. Per 16 quants the integer sum
// of (q + W_Q_ZERO) * xq is exact: dp4a's sum of q * xq plus W_Q_ZERO times the sum of xq.
typedef struct {
  uint4 lo, hi;
  float d;
  int sum_lo, sum_hi;
} x_q8;
static inline x_q8 load_x_q8(const global char* xq, int t, int K, int c) {
  const global char* row = xq_row(xq, t, K);
  x_q8 r;
  r.lo = *(const global uint4*)(row + CHUNK * c);  // xq rows are 16-byte aligned
  r.hi = *(const global uint4*)(row + CHUNK * c + 16);
  r.d = ((const global float*)(row + K))[c];
#if W_Q_ZERO != 0 || defined(W_HAS_MIN)
  r.sum_lo = isum16(r.lo);
  r.sum_hi = isum16(r.hi);
#endif
  return r;
}
typedef struct {
  uint4 lo, hi;
  float2 d, m;
} w_q8;
static inline w_q8 load_w_q8(const global uchar* row, int nb, int c) {
  w_q8 r;
  chunk_q(row, nb, c, &r.lo, &r.hi, &r.d, &r.m);
  return r;
}
static inline float dot_q8(w_q8 w, x_q8 x, float acc) {
  int lo = idot16(w.lo, x.lo), hi = idot16(w.hi, x.hi);
#if W_Q_ZERO != 0
  lo += W_Q_ZERO * x.sum_lo;
  hi += W_Q_ZERO * x.sum_hi;
#endif
  acc = fma(w.d.s1 * x.d, (float)hi, fma(w.d.s0 * x.d, (float)lo, acc));
#ifdef W_HAS_MIN
  acc = fma(w.m.s1, x.d * (float)x.sum_hi, fma(w.m.s0, x.d * (float)x.sum_lo, acc));
#endif
  return acc;
}
GEMV_PARTIAL(gemv_q8_partial, char, x_q8, load_x_q8, w_q8, load_w_q8, dot_q8)
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
static inline void gemm_tile(const global float* x, int K, const local int* xrow, const local int* orow,
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
