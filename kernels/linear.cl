// linear and embedding over weights in any stored type (weights.cl supplies the block loaders).
//
// linear: out[t, n] = x[t, :] . W[n, :] (+ bias[n]).
// - linear_q8 (decodes over the quantized types but Q2_K / Q3_K: one token, or a batch of
//   decodes): x quantized to 8 bits per 32 elements first (quantize_q8_rows, as the CPU backend's
//   Q8_0 activations), then integer dot products per (weight row, token) (block_dot_q8).
// - linear_t1 (one token otherwise: plain floats, Q2_K / Q3_K, scoring steps): one weight row per
//   work-item, read front to back, multiplying the quants into f32 x without dequantizing them
//   first (block_dot in weights.cl).
// - linear_t4 / linear_t8 (more tokens): each work-item owns a register tile of 4 tokens x 4
//   weight rows (or 8 x 2) and walks K 32 elements at a time: a chunk of each weight row is
//   dequantized once into two float16 (block scales once per block) and multiplied into 16
//   float16 accumulators, so dequantization is shared by the tile's tokens and every activation
//   load by its rows (tile_sums, which moe.cl's grouped expert tiles use too). Work-items are
//   numbered token-tile fastest, so the work-items of one work-group share weight rows in cache.
#pragma OPENCL FP_CONTRACT ON

#define MAX_TM 8
#define MAX_TN 4

// s[m][i] = xr[m][0, K) . row wr[i] for a register tile of TM activation rows x TN weight rows
// (stored blocks). Each sum is formed alike whatever the tile's shape and its other rows.
static inline void tile_sums(const int TM, const int TN, const global float* xr[MAX_TM],
                      const global uchar* wr[MAX_TN], int K, float s[MAX_TM][MAX_TN]) {
  float16 acc[MAX_TM][MAX_TN];
#pragma unroll
  for (int m = 0; m < TM; ++m)
#pragma unroll
    for (int i = 0; i < TN; ++i) acc[m][i] = (float16)(0.0f);

  const int blocks = K / (CHUNK * W_CHUNKS);
  for (int b = 0; b < blocks; ++b) {
    wscales sc[MAX_TN];
#pragma unroll
    for (int i = 0; i < TN; ++i) sc[i] = block_scales(wr[i] + (long)b * W_BLOCK_BYTES);
#pragma unroll
    for (int j = 0; j < W_CHUNKS; ++j) {
      const int k = (b * W_CHUNKS + j) * CHUNK;
      float16 xl[MAX_TM], xh[MAX_TM];
#pragma unroll
      for (int m = 0; m < TM; ++m) {
        xl[m] = vload16(0, xr[m] + k);
        xh[m] = vload16(1, xr[m] + k);
      }
#pragma unroll
      for (int i = 0; i < TN; ++i) {
        float16 wl, wh;
        block_chunk(wr[i] + (long)b * W_BLOCK_BYTES, sc[i], j, &wl, &wh);
#pragma unroll
        for (int m = 0; m < TM; ++m) acc[m][i] = fma(xh[m], wh, fma(xl[m], wl, acc[m][i]));
      }
    }
  }

#pragma unroll
  for (int m = 0; m < TM; ++m)
#pragma unroll
    for (int i = 0; i < TN; ++i) {
      s[m][i] = sum16(acc[m][i]);
#ifdef W_FLOAT  // plain floats allow any K: the last K % 32 elements one by one
      for (int k = blocks * CHUNK; k < K; ++k) s[m][i] = fma(xr[m][k], load_elem(wr[i], k), s[m][i]);
#endif
    }
}

static inline void linear_tile(const int TM, const int TN, const global float* x, int T, int K,
                        const global uchar* w, long w_row_bytes, int N,
                        const global float* bias, int has_bias, global float* out, int ldo) {
  const int tiles_t = (T + TM - 1) / TM;
  const int gid = (int)get_global_id(0);
  const int t0 = (gid % tiles_t) * TM, n0 = (gid / tiles_t) * TN;
  if (n0 >= N) return;

  const global uchar* wr[MAX_TN];
#pragma unroll
  for (int i = 0; i < TN; ++i) wr[i] = w + (long)min(n0 + i, N - 1) * w_row_bytes;
  const global float* xr[MAX_TM];
#pragma unroll
  for (int m = 0; m < TM; ++m) xr[m] = x + (long)min(t0 + m, T - 1) * K;
  float s[MAX_TM][MAX_TN];
  tile_sums(TM, TN, xr, wr, K, s);

#pragma unroll
  for (int m = 0; m < TM; ++m) {
    const int t = t0 + m;
#pragma unroll
    for (int i = 0; i < TN; ++i) {
      const int n = n0 + i;
      if (t >= T || n >= N) continue;
      out[(long)t * ldo + n] = has_bias ? s[m][i] + bias[n] : s[m][i];
    }
  }
}

// Offsets are in elements of each pointer's type (bytes for w); out already points at the
// first column this weight fills (out_col) and ldo is the row stride of the whole output.
// The linear kernels' arguments, x [T, K] of element type X (float, or char for xq rows).
#define LINEAR_ARGS_OF(X)                                                                    \
  const global X *x, long x_off, int T, int K, const global uchar *w, long w_off,             \
      long w_row_bytes, int N, const global float *bias, long bias_off, int has_bias,         \
      global float *out, long out_off, int ldo
#define LINEAR_ARGS LINEAR_ARGS_OF(float)

kernel void linear_t8(LINEAR_ARGS) {
  linear_tile(8, 2, x + x_off, T, K, w + w_off, w_row_bytes, N, bias + bias_off, has_bias, out + out_off, ldo);
}

// One token: one weight row per work-item, read front to back (a single sequential stream per
// row keeps the hardware prefetchers busy; interleaving several short rows starves them).
//
// The types without block_dot (plain floats, Q2_K, Q3_K) dot the dequantized chunks.
#ifndef W_BLOCK_DOT
ALWAYS_INLINE void block_dot(const global uchar* b, const global float* x, const local float* xs, float16* acc, float8* acc_m) {
  const wscales sc = block_scales(b);
#pragma unroll
  for (int j = 0; j < W_CHUNKS; ++j) {
    float16 wl, wh;
    block_chunk(b, sc, j, &wl, &wh);
    acc[j & 1] = fma(vload16(1, x + CHUNK * j), wh, fma(vload16(0, x + CHUNK * j), wl, acc[j & 1]));
  }
}
#endif

// xs[c] = the sum of x[32c, 32c + 32) for c < K / 32, computed by the whole work-group (its
// work-items share x). Only the W_XSUMS types read it; the others skip the barrier.
static inline void chunk_sums(const global float* x, int K, local float* xs) {
#ifdef W_XSUMS
  for (int c = (int)get_local_id(0); c < K / CHUNK; c += (int)get_local_size(0))
    xs[c] = sum16(vload16(0, x + CHUNK * c) + vload16(1, x + CHUNK * c));
  barrier(CLK_LOCAL_MEM_FENCE);
#endif
}

// One weight row (stored blocks) dotted with x[0, K), read front to back, xs from chunk_sums.
// Blocks in pairs, each with its own two accumulators, so the loop is not bound by FMA latency
// (four chains beat two). moe.cl uses it too.
float row_dot(const global uchar* row, const global float* x, const local float* xs, int K) {
  float16 acc[4] = {(float16)(0.0f), (float16)(0.0f), (float16)(0.0f), (float16)(0.0f)};
  float8 acc_m = (float8)(0.0f);
  const int elems = CHUNK * W_CHUNKS, blocks = K / elems;
  int b = 0;
  for (; b + 1 < blocks; b += 2) {
    block_dot(row + (long)b * W_BLOCK_BYTES, x + b * elems, xs + b * W_CHUNKS, acc, &acc_m);
    block_dot(row + (long)(b + 1) * W_BLOCK_BYTES, x + (b + 1) * elems, xs + (b + 1) * W_CHUNKS, acc + 2, &acc_m);
  }
  if (b < blocks) block_dot(row + (long)b * W_BLOCK_BYTES, x + b * elems, xs + b * W_CHUNKS, acc, &acc_m);
  float s = sum16((acc[0] + acc[1]) + (acc[2] + acc[3]) + (float16)(acc_m, (float8)(0.0f)));
#ifdef W_FLOAT
  for (int k = blocks * CHUNK; k < K; ++k) s = fma(x[k], load_elem(row, k), s);
#endif
  return s;
}

// xs: K / 32 floats of local memory (at least one).
kernel void linear_t1(LINEAR_ARGS, local float* xs) {
  x += x_off;
  chunk_sums(x, K, xs);
  const int n = (int)get_global_id(0);
  if (n >= N) return;
  float s = row_dot(w + w_off + (long)n * w_row_bytes, x, xs, K);
  if (has_bias) s += bias[bias_off + n];
  out[out_off + n] = s;
}

// ---- 8-bit activations: decodes over the quantized types (W_DOT_Q8; x from quantize.cl) ----
#ifdef W_DOT_Q8
#define MAX_TQ 4

// s[m] = one weight row (stored blocks) . xq row x[m], for TM rows of xq, front to back. Blocks
// in pairs, each with its own two accumulators per token (four FMA chains). Each token's sum is
// formed alike whatever TM (a decode computes the same alone and in a batch); the tokens' calls
// share the block's loads and unpacking (the compiler merges the identical work). moe.cl uses
// it too.
ALWAYS_INLINE void rows_dot_q8(const int TM, const global uchar* row, const global char* x[MAX_TQ], int K, float s[MAX_TQ]) {
  const int chunks = K / CHUNK, elems = CHUNK * W_CHUNKS, blocks = K / elems;
  float8 acc[MAX_TQ][4];
  float8 acc_m[MAX_TQ];     // the k-quants' mins, lane-wise
  float acc_s[MAX_TQ][2];   // the 32-element types' min / offset terms, one per block chain
  const global float* xd[MAX_TQ];
  const global float* xsum[MAX_TQ];
#pragma unroll
  for (int m = 0; m < TM; ++m) {
    acc[m][0] = acc[m][1] = acc[m][2] = acc[m][3] = acc_m[m] = (float8)(0.0f);
    acc_s[m][0] = acc_s[m][1] = 0.0f;
    xd[m] = (const global float*)(x[m] + K);
    xsum[m] = xd[m] + chunks;
  }
  int b = 0;
  for (; b + 1 < blocks; b += 2) {
#pragma unroll
    for (int m = 0; m < TM; ++m) {
      block_dot_q8(row + (long)b * W_BLOCK_BYTES, x[m] + b * elems, xd[m] + b * W_CHUNKS, xsum[m] + b * W_CHUNKS,
                   acc[m], &acc_m[m], acc_s[m]);
      block_dot_q8(row + (long)(b + 1) * W_BLOCK_BYTES, x[m] + (b + 1) * elems, xd[m] + (b + 1) * W_CHUNKS,
                   xsum[m] + (b + 1) * W_CHUNKS, acc[m] + 2, &acc_m[m], acc_s[m] + 1);
    }
  }
  if (b < blocks)
#pragma unroll
    for (int m = 0; m < TM; ++m)
      block_dot_q8(row + (long)b * W_BLOCK_BYTES, x[m] + b * elems, xd[m] + b * W_CHUNKS, xsum[m] + b * W_CHUNKS,
                   acc[m], &acc_m[m], acc_s[m]);
#pragma unroll
  for (int m = 0; m < TM; ++m)
    s[m] = sum8((acc[m][0] + acc[m][1]) + (acc[m][2] + acc[m][3]) + acc_m[m]) + (acc_s[m][0] + acc_s[m][1]);
}

float row_dot_q8(const global uchar* row, const global char* x, int K) {
  const global char* xs[MAX_TQ] = {x};
  float s[MAX_TQ];
  rows_dot_q8(1, row, xs, K, s);
  return s[0];
}

// out[t, n] = xq[t] . W[n, :] (+ bias[n]) for xq from quantize_q8_rows; one weight row and TM
// tokens per work-item, tokens fastest, so a work-group's items share weight rows in cache.
static inline void linear_q8_rows(const int TM, const global char* xq, int T, int K, const global uchar* w,
                           long w_row_bytes, int N, const global float* bias, int has_bias,
                           global float* out, int ldo) {
  const int groups = (T + TM - 1) / TM, gid = (int)get_global_id(0);
  const int t0 = (gid % groups) * TM, n = gid / groups;
  if (n >= N) return;
  const global char* x[MAX_TQ];
#pragma unroll
  for (int m = 0; m < TM; ++m) x[m] = xq_row(xq, min(t0 + m, T - 1), K);
  float s[MAX_TQ];
  rows_dot_q8(TM, w + (long)n * w_row_bytes, x, K, s);
#pragma unroll
  for (int m = 0; m < TM; ++m)
    if (t0 + m < T) out[(long)(t0 + m) * ldo + n] = has_bias ? s[m] + bias[n] : s[m];
}

// One token: a row per work-item. A batch of decodes: four tokens per work-item. (x: xq rows.)
kernel void linear_q8(LINEAR_ARGS_OF(char)) {
  linear_q8_rows(1, x + x_off, T, K, w + w_off, w_row_bytes, N, bias + bias_off, has_bias, out + out_off, ldo);
}
kernel void linear_q8_t4(LINEAR_ARGS_OF(char)) {
  linear_q8_rows(4, x + x_off, T, K, w + w_off, w_row_bytes, N, bias + bias_off, has_bias, out + out_off, ldo);
}
#endif

kernel void linear_t4(LINEAR_ARGS) {
  linear_tile(4, 4, x + x_off, T, K, w + w_off, w_row_bytes, N, bias + bias_off, has_bias, out + out_off, ldo);
}
