// LoRA updates per row (both families; the gpu family's shrink is in gpu_lora.cl). The adapters a
// step's rows choose from lie in one buffer the backend keeps per slot set
// (cpp/backend/opencl/cl_ops_lora.cpp): an int table, then the weights, each matrix in its storage
// dtype. Table:
//   [0] slots S, [1] sites per adapter, then (first update, count) per (slot, site), then per
//   update LORA_UPDATE_INTS ints: A's byte offset [r, K] and B's [N, r] in the weights, r, N, the
//   first output column, the update's first column in a row of the shrink's scratch, the scale's
//   bits, A's dtype | B's dtype << 8 (LORA_F32 ...).
// Stored values are read as f32 (exactly: f16 / bf16 widen, q8_0 is d * q) and summed as f32 ones
// would be. Every value a row gets is a fixed-order sum of its own values, times its request
// scale: independent of the other rows.

#define LORA_UPDATE_INTS 8
#define LORA_F32 0
#define LORA_F16 1
#define LORA_BF16 2
#define LORA_Q8_0 3

// Bytes of a row of n elements (n a multiple of 32 for q8_0: 34-byte blocks, f16 d then 32 int8).
static inline long lora_row_bytes(int dtype, int n) {
  return dtype == LORA_F32 ? 4L * n : dtype == LORA_Q8_0 ? (long)(n / 32) * 34 : 2L * n;
}

// Element i of a row at m.
static inline float lora_value(global const uchar* m, int dtype, int i) {
  if (dtype == LORA_F32) return ((global const float*)m)[i];
  if (dtype == LORA_F16) return vload_half(i, (global const half*)m);
  if (dtype == LORA_BF16) return as_float((uint)((global const ushort*)m)[i] << 16);
  global const uchar* block = m + (i / 32) * 34;
  return vload_half(0, (global const half*)block) * (float)((global const char*)block)[2 + i % 32];
}

// Elements i .. i + 3 of a row at m.
static inline float4 lora_value4(global const uchar* m, int dtype, int i) {
  if (dtype == LORA_F32) return vload4(0, (global const float*)m + i);
  if (dtype == LORA_F16) return vload_half4(0, (global const half*)m + i);
  if (dtype == LORA_BF16) return as_float4(convert_uint4(vload4(0, (global const ushort*)m + i)) << 16);
  return (float4)(lora_value(m, dtype, i), lora_value(m, dtype, i + 1), lora_value(m, dtype, i + 2),
                  lora_value(m, dtype, i + 3));
}

// The updates of row_slot's adapter at `site`: sets *first (their index) and returns their count
// (0 for slot -1, an empty slot, an adapter without updates there).
static inline int lora_updates(global const int* table, int row_slot, int site, int* first) {
  const int S = table[0], sites = table[1];
  if (row_slot < 0 || row_slot >= S || site >= sites) return 0;
  global const int* h = table + 2 + 2 * (row_slot * sites + site);
  *first = h[0];
  return h[1];
}

static inline global const int* lora_update(global const int* table, int u) {
  return table + 2 + 2 * table[0] * table[1] + u * LORA_UPDATE_INTS;
}

// The update of the adapter whose scratch columns hold j (or null).
static inline global const int* lora_update_of_rank(global const int* table, int row_slot, int site, int j) {
  int first = 0;
  const int n = lora_updates(table, row_slot, site, &first);
  for (int u = 0; u < n; ++u) {
    global const int* up = lora_update(table, first + u);
    if (j >= up[5] && j < up[5] + up[2]) return up;
  }
  return 0;
}

// cpu family: t[row, j] = x[row, :] . A[j', :] for the update holding scratch column j; one
// work-item per (row, j), four float4 partial sums in a fixed order.
kernel void lora_shrink(global const float* x, long x_off, global const int* row_slots, long rs_off,
                        global const int* table, long table_off, global const uchar* w, long w_off,
                        global float* t, long t_off, int T, int K, int site, int site_rank) {
  const long gid = (long)get_global_id(0);
  if (gid >= (long)T * site_rank) return;
  const int row = (int)(gid / site_rank), j = (int)(gid % site_rank);
  table += table_off;
  global const int* up = lora_update_of_rank(table, row_slots[rs_off + row], site, j);
  if (!up) return;
  global const float* xr = x + x_off + (long)row * K;
  const int ad = up[7] & 0xff;
  global const uchar* a = w + w_off + up[0] + (j - up[5]) * lora_row_bytes(ad, K);
  float4 acc[4] = {(float4)(0.0f), (float4)(0.0f), (float4)(0.0f), (float4)(0.0f)};
  int k = 0;
  for (; k + 16 <= K; k += 16)
    for (int i = 0; i < 4; ++i) acc[i] = fma(vload4(0, xr + k + 4 * i), lora_value4(a, ad, k + 4 * i), acc[i]);
  const float4 s4 = (acc[0] + acc[1]) + (acc[2] + acc[3]);
  float s = (s4.s0 + s4.s1) + (s4.s2 + s4.s3);
  for (; k < K; ++k) s = fma(xr[k], lora_value(a, ad, k), s);
  t[t_off + (long)row * site_rank + j] = s;
}

// out[row, c] += (scale * row_scales[row]) * t[row, update's columns] . B[c - out_col, :] for the
// update covering output column c; one work-item per (row, c), c fastest.
kernel void lora_expand(global const float* t, long t_off, global const int* row_slots, long rs_off,
                        global const int* table, long table_off, global const uchar* w, long w_off,
                        global float* out, long out_off, int T, int ld, int site, int site_rank,
                        global const float* row_scales, long rsc_off) {
  const long gid = (long)get_global_id(0);  // T * ld may pass 2^31
  if (gid >= (long)T * ld) return;
  const int row = (int)(gid / ld), c = (int)(gid % ld);
  table += table_off;
  int first = 0;
  const int n = lora_updates(table, row_slots[rs_off + row], site, &first);
  for (int u = 0; u < n; ++u) {
    global const int* up = lora_update(table, first + u);
    if (c < up[4] || c >= up[4] + up[3]) continue;
    const int r = up[2];
    global const float* v = t + t_off + (long)row * site_rank + up[5];
    const int bd = up[7] >> 8;
    global const uchar* b = w + w_off + up[1] + (c - up[4]) * lora_row_bytes(bd, r);
    float s = 0.0f;
    for (int i = 0; i < r; ++i) s = fma(v[i], lora_value(b, bd, i), s);
    out[out_off + (long)row * ld + c] += (as_float(up[6]) * row_scales[rsc_off + row]) * s;
  }
}
