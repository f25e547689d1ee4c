// Mixture-of-experts rows over expert weights in any stored type (weights.cl supplies the block
// loaders; built into the linear program). The router and the weighted sum are in
// elementwise.cl (moe_route, moe_combine).
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

kernel void moe_rows(const global float* x, long x_off, int x_div, int K, const global int* ids,
                     long ids_off, int P, int E, int N, const global uchar* w, long w_off,
                     long w_row_bytes, long row0, long nrows, int zero_invalid, global float* y,
                     long y_off, int ldy, local float* xs) {
  const int rows_padded = (N + (int)get_local_size(0) - 1) / (int)get_local_size(0) * (int)get_local_size(0);
  const int gid = (int)get_global_id(0);
  const int p = gid / rows_padded, n = gid % rows_padded;  // p < P: the launch is exact
  const global float* xr = x + x_off + (long)(p / x_div) * K;
  chunk_sums(xr, K, xs);  // linear.cl
  const int e = ids[ids_off + p];
  if (n >= N) return;
  global float* o = y + y_off + (long)p * ldy + n;
  if (e < 0 || e >= E) {
    if (zero_invalid) *o = 0.0f;
    return;
  }
  const long r = (long)e * N + n - row0;
  if (r < 0 || r >= nrows) return;
  *o = row_dot(w + w_off + r * w_row_bytes, xr, xs, K);  // linear.cl
}
