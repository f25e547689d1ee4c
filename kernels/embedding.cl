// embedding for both kernel families (after weights.cl or gpu_weights.cl, whose row_chunk gives
// chunk c of a row of H elements as floats, the reference dequantizer's values).
//
// out[t, :] = table[ids[t], :] for the table rows [row0, row0 + nrows) this buffer holds (a table
// larger than one device allocation is several buffers, one launch each). Ids outside the
// vocabulary give zero rows, written by the launch with zero_invalid set. One work-item per
// (token, 32-element chunk).
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
    row_chunk(row, H, c, &lo, &hi);
    vstore16(lo, 0, o);
    vstore16(hi, 1, o);
    return;
  }
#ifdef W_FLOAT
  for (int k = 0; k < n; ++k) o[k] = load_elem(row, CHUNK * c + k);
#endif
}
