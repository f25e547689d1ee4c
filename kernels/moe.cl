// Mixture-of-experts matmuls over expert weights in any stored type (weights.cl supplies the
// block loaders; built into the linear program). The router, the grouping of pairs by expert and
// the weighted sum are in elementwise.cl (moe_route, moe_group, moe_combine).
//
// moe_rows: y[p, n] = W[ids[p]][n, :] . x[p / x_div, :] for every (token, slot) pair p = t * k + j
// and row n < N of the selected expert, one work-item per (pair, row), numbered row fastest; the
// rows of a pair are padded to a multiple of the work-group size, so a work-group streams
// consecutive rows of one expert against one activation row (whose chunk sums it shares, see
// linear_t1). The expert id is read from the ids buffer when the launch runs (a recorded stream
// follows new routing), and only the selected experts' rows are read. The expert matrices
// [E, N, K] are seen as E * N weight rows; a tensor larger than one device allocation is several
// buffers, one launch each over the rows [row0, row0 + nrows) it holds. Pairs with an id outside
// [0, E) get y = 0 (written by the launch with zero_invalid set).
#pragma OPENCL FP_CONTRACT ON

// Work-item gid's pair *p and the weight row it dots (see moe_rows), or null where it has none:
// padding rows, rows in another buffer, and ids outside [0, E) (their y zeroed if zero_invalid).
static inline const global uchar* moe_item_row(int N, const global int* ids, int E, const global uchar* w,
                                        long w_row_bytes, long row0, long nrows, int zero_invalid,
                                        global float* y, int ldy, int* p, global float** o) {
  const int rows_padded = (N + (int)get_local_size(0) - 1) / (int)get_local_size(0) * (int)get_local_size(0);
  const int gid = (int)get_global_id(0), n = gid % rows_padded;
  *p = gid / rows_padded;  // p < P: the launch is exact
  const int e = ids[*p];
  if (n >= N) return 0;
  *o = y + (long)*p * ldy + n;
  if (e < 0 || e >= E) {
    if (zero_invalid) **o = 0.0f;
    return 0;
  }
  const long r = (long)e * N + n - row0;
  return r < 0 || r >= nrows ? 0 : w + r * w_row_bytes;
}

kernel void moe_rows(const global float* x, long x_off, int x_div, int K, const global int* ids,
                     long ids_off, int P, int E, int N, const global uchar* w, long w_off,
                     long w_row_bytes, long row0, long nrows, int zero_invalid, global float* y,
                     long y_off, int ldy, local float* xs) {
  int p;
  global float* o;
  const global uchar* row = moe_item_row(N, ids + ids_off, E, w + w_off, w_row_bytes, row0, nrows,
                                         zero_invalid, y + y_off, ldy, &p, &o);
  const global float* xr = x + x_off + (long)(p / x_div) * K;
  chunk_sums(xr, K, xs);  // linear.cl; every work-item of the group reaches the barrier
  if (row) *o = row_dot(row, xr, xs, K);  // linear.cl
}

#ifdef W_DOT_Q8
// moe_rows over activations quantized by quantize_q8_rows (linear.cl), as linear_q8: the
// few-token steps (decodes) over the types with integer dot kernels.
kernel void moe_rows_q8(const global char* xq, long xq_off, int x_div, int K, const global int* ids,
                        long ids_off, int P, int E, int N, const global uchar* w, long w_off,
                        long w_row_bytes, long row0, long nrows, int zero_invalid, global float* y,
                        long y_off, int ldy) {
  int p;
  global float* o;
  const global uchar* row = moe_item_row(N, ids + ids_off, E, w + w_off, w_row_bytes, row0, nrows,
                                         zero_invalid, y + y_off, ldy, &p, &o);
  if (row) *o = row_dot_q8(row, xq_row(xq + xq_off, p / x_div, K), K);
}
#endif

// moe_tiles_t4 / moe_tiles_t8 (a prompt): the same y for pairs grouped by expert (moe_group),
// so an expert's weight rows are read once per tile of TM of its pairs rather than once per pair:
// linear_t4 / linear_t8's register tiles (tile_sums) over the gathered activation rows.
// groups: order[P] (pairs sorted by expert), then max_tiles tiles (expert, first, count) with
// count <= TM, expert -1 for the unused ones; max_tiles is a multiple of TILE_RUN. One work-item
// per (tile, TN rows): a run of TILE_RUN consecutive tiles (mostly one expert's) goes through all
// N rows before the next run starts, tile fastest, so a run's activation rows stay in cache while
// its expert's weight rows stream past once. Launches per device buffer as moe_rows; pairs with
// an id outside [0, E) are in no tile (moe_combine skips them).
#define TILE_RUN 16

static inline void moe_tile(const int TM, const int TN, const global float* x, int x_div, int K,
                     const global int* groups, int P, int max_tiles, int N, const global uchar* w,
                     long w_row_bytes, long row0, long nrows, global float* y, int ldy) {
  const int gid = (int)get_global_id(0), row_tiles = (N + TN - 1) / TN;
  const int run = gid / (TILE_RUN * row_tiles), in_run = gid % (TILE_RUN * row_tiles);
  const int tile = run * TILE_RUN + in_run % TILE_RUN, n0 = (in_run / TILE_RUN) * TN;
  if (tile >= max_tiles) return;
  const global int* t = groups + P + 3 * tile;
  const int e = t[0], first = t[1], count = t[2];
  if (e < 0) return;
  const long r0 = (long)e * N + n0 - row0;  // the tile's first weight row in this buffer
  if (r0 + TN <= 0 || r0 >= nrows) return;

  const global uchar* wr[MAX_TN];
#pragma unroll
  for (int i = 0; i < TN; ++i) wr[i] = w + clamp(r0 + i, 0L, nrows - 1) * w_row_bytes;
  int pairs[MAX_TM];
  const global float* xr[MAX_TM];
#pragma unroll
  for (int m = 0; m < TM; ++m) {
    pairs[m] = groups[first + min(m, count - 1)];
    xr[m] = x + (long)(pairs[m] / x_div) * K;
  }
  float s[MAX_TM][MAX_TN];
  tile_sums(TM, TN, xr, wr, K, s);  // linear.cl

#pragma unroll
  for (int m = 0; m < TM; ++m)
#pragma unroll
    for (int i = 0; i < TN; ++i)
      if (m < count && n0 + i < N && r0 + i >= 0 && r0 + i < nrows) y[(long)pairs[m] * ldy + n0 + i] = s[m][i];
}

#define MOE_TILE_ARGS                                                                         \
  const global float *x, long x_off, int x_div, int K, const global int *groups, long g_off,  \
      int P, int max_tiles, int N, const global uchar *w, long w_off, long w_row_bytes,       \
      long row0, long nrows, global float *y, long y_off, int ldy

kernel void moe_tiles_t4(MOE_TILE_ARGS) {
  moe_tile(4, 4, x + x_off, x_div, K, groups + g_off, P, max_tiles, N, w + w_off, w_row_bytes, row0, nrows, y + y_off, ldy);
}

kernel void moe_tiles_t8(MOE_TILE_ARGS) {
  moe_tile(8, 2, x + x_off, x_div, K, groups + g_off, P, max_tiles, N, w + w_off, w_row_bytes, row0, nrows, y + y_off, ldy);
}
