// Mixture-of-experts rows over expert weights in any stored type (weights.cl supplies the block
// loaders; built into the linear program). The router and the weighted sum are in
// elementwise.cl (moe_route, moe_combine).
//
// moe_rows: y[p, n] = W[ids[p]][n, :] . x[p / x_div, :] for every (token, slot) pair p = t * k + j
// and row n < N of the selected expert, one work-item per (pair, row), numbered row fastest so
// a work-group streams consecutive rows of one expert against one activation row. The expert id
// is read from the ids buffer when the launch runs (a recorded stream follows new routing), and
// only the selected experts' rows are read. The expert matrices [E, N, K] are seen as E * N
// weight rows; a tensor larger than one device allocation is several buffers, one launch each
// over the rows [row0, row0 + nrows) it holds. Pairs with an id outside [0, E) get y = 0 (written
// by the launch with zero_invalid set).
#pragma OPENCL FP_CONTRACT ON

kernel void moe_rows(const global float* x, long x_off, int x_div, int K, const global int* ids,
                     long ids_off, int P, int E, int N, const global uchar* w, long w_off,
                     long w_row_bytes, long row0, long nrows, int zero_invalid, global float* y,
                     long y_off, int ldy) {
  const int gid = (int)get_global_id(0);
  const int p = gid / N, n = gid % N;
  if (p >= P) return;
  const int e = ids[ids_off + p];
  global float* o = y + y_off + (long)p * ldy + n;
  if (e < 0 || e >= E) {
    if (zero_invalid) *o = 0.0f;
    return;
  }
  const long r = (long)e * N + n - row0;
  if (r < 0 || r >= nrows) return;
  const global float* xr = x + x_off + (long)(p / x_div) * K;
  *o = row_dot(w + w_off + r * w_row_bytes, xr, K);  // linear.cl
}
