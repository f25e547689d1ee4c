// Mixture-of-experts matmuls for the gpu family (after gpu_linear.cl), semantics as moe.cl's:
// y[p, n] = W[ids[p]][n, :] . x[p / x_div, :] for the (token, slot) pairs p; the expert matrices
// [E, N, K] are E * N weight rows, of which a launch sees the rows [row0, row0 + nrows) of one
// device buffer. Pairs with an id outside [0, E) get y = 0 (written by the launch with
// zero_invalid set).
//   moe_gemv / moe_gemv_q8  decodes and short prompts: the GEMV's lane groups over one pair's
//                           rows of its expert (f32 x, or xq rows from quantize.cl).
//   moe_gemm                a prompt's pairs grouped by expert (moe_group, tiles of up to
//                           GEMM_TM pairs): the GEMM tile over each tile's gathered x rows.

// The rows of expert e in this buffer: [lo, hi) of its N.
static inline int2 expert_rows(int e, int N, long row0, long nrows) {
  const long first = (long)e * N;
  return (int2)((int)clamp(row0 - first, 0L, (long)N), (int)clamp(row0 + nrows - first, 0L, (long)N));
}

#define MOE_GEMV_ARGS(X)                                                                          \
  const global X *x, long x_off, int x_div, int K, const global int *ids, long ids_off, int P,    \
      int E, int N, const global uchar *w, long w_off, long w_row_bytes, long row0, long nrows,   \
      int zero_invalid, global float *y, long y_off, int ldy

// A work-group per (pair, GEMV_GROUPS * GEMV_ROWS rows), pairs slowest.
#define MOE_GEMV_BODY(PARTIAL, XROW)                                                              \
  local float scratch[GEMV_WG * GEMV_ROWS];                                                       \
  const int lid = (int)get_local_id(0), lane = lid % LANES;                                       \
  const int groups_per_pair = (N + GEMV_GROUPS * GEMV_ROWS - 1) / (GEMV_GROUPS * GEMV_ROWS);      \
  const int p = (int)get_group_id(0) / groups_per_pair;                                           \
  const int n0 = ((int)get_group_id(0) % groups_per_pair * GEMV_GROUPS + lid / LANES) * GEMV_ROWS;\
  const int e = ids[ids_off + p];                                                                 \
  const bool valid = e >= 0 && e < E;                                                             \
  const int2 rows = valid ? expert_rows(e, N, row0, nrows) : (int2)(0, 0);                        \
  const global uchar* we = w + w_off + (rows.x < rows.y ? ((long)e * N + rows.x - row0) * w_row_bytes : 0); \
  float acc[GEMV_ROWS];                                                                           \
  for (int r = 0; r < GEMV_ROWS; ++r) acc[r] = 0.0f;                                              \
  if (rows.x < rows.y) PARTIAL(1, XROW, 1, K, 0, we, w_row_bytes, rows.y - rows.x, n0 - rows.x, lane, acc); \
  lane_sums(acc, GEMV_ROWS, scratch); /* every work-item: no early return before its barriers */  \
  global float* yp = y + y_off + (long)p * ldy;                                                   \
  if (lane == 0)                                                                                  \
    for (int r = 0; r < GEMV_ROWS; ++r) {                                                         \
      const int n = n0 + r;                                                                       \
      if (!valid && zero_invalid && n < N) yp[n] = 0.0f;                                          \
      if (n >= rows.x && n < rows.y) yp[n] = acc[r];                                              \
    }

kernel __attribute__((reqd_work_group_size(GEMV_WG, 1, 1))) void moe_gemv(MOE_GEMV_ARGS(float)) {
  MOE_GEMV_BODY(gemv_f32_partial, x + x_off + (long)(p / x_div) * K)
}

#ifndef W_FLOAT
kernel __attribute__((reqd_work_group_size(GEMV_WG, 1, 1))) void moe_gemv_q8(MOE_GEMV_ARGS(char)) {
  MOE_GEMV_BODY(gemv_q8_partial, xq_row(x + x_off, p / x_div, K))
}
#endif

// groups: order[P] (pairs sorted by expert), then max_tiles tiles (expert, first, count), expert
// -1 for the unused ones (elementwise.cl: moe_group). A work-group per (tile, GEMM_TN rows),
// tiles fastest.
kernel __attribute__((reqd_work_group_size(GEMM_ITEMS, 1, 1)))
void moe_gemm(const global float* x, long x_off, int x_div, int K, const global int* groups, long g_off,
              int P, int max_tiles, int N, const global uchar* w, long w_off, long w_row_bytes, long row0,
              long nrows, global float* y, long y_off, int ldy) {
  GEMM_LOCAL
  local int xrow[GEMM_TM], orow[GEMM_TM];
  const int tile = (int)get_group_id(0) % max_tiles, n0 = (int)get_group_id(0) / max_tiles * GEMM_TN;
  const global int* tl = groups + g_off + P + 3 * tile;
  const int e = tl[0], first = tl[1], count = tl[2];
  const int2 rows = e >= 0 ? expert_rows(e, N, row0, nrows) : (int2)(0, 0);
  // An unused tile, or rows outside this buffer: no K steps and no stores, but every barrier.
  const bool active = rows.x < rows.y && n0 + GEMM_TN > rows.x && n0 < rows.y;
  for (int m = (int)get_local_id(0); m < GEMM_TM; m += GEMM_ITEMS) {
    const int pair = active && m < count ? groups[g_off + first + m] : -1;
    xrow[m] = pair >= 0 ? pair / x_div : -1;
    orow[m] = pair;
  }
  barrier(CLK_LOCAL_MEM_FENCE);
  gemm_tile(x + x_off, active ? K : 0, xrow, orow,
            w + w_off + (active ? ((long)e * N + rows.x - row0) * w_row_bytes : 0), w_row_bytes,
            active ? rows.y - rows.x : 1, n0 - rows.x, 0, 0, y + y_off + rows.x, ldy, xs, ws);
}
