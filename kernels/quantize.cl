// 8-bit activations, shared by both kernel families: x [T, K] (K a multiple of 32) quantized per
// 32-element chunk exactly as the CPU backend's Q8_0 activations (cpp/quant/quantize.cpp):
// d = amax / 127, q = round(x / d) with 1 / d in f32, d then rounded to f16; so every backend and
// family dots the same x.
//
// Row t of xq: K int8 quants, then per chunk its scale d and the sum of its dequantized values, as
// floats; rows start every xq_row_bytes(K) bytes (16-byte aligned, so GPUs load quants as vectors).
static inline long xq_row_bytes(int K) { return ((long)K + K / 4 + 15) / 16 * 16; }
static inline const global char* xq_row(const global char* xq, int t, int K) { return xq + (long)t * xq_row_bytes(K); }

// Chunk c of one row: p its 32 floats, row its xq row, chunks = K / 32.
static inline void quantize_chunk(const global float* p, global char* row, int c, int chunks) {
  const float16 a = vload16(0, p), b = vload16(1, p);
  const float16 m = fmax(fabs(a), fabs(b));
  const float8 m8 = fmax(m.lo, m.hi);
  const float4 m4 = fmax(m8.lo, m8.hi);
  const float amax = fmax(fmax(m4.x, m4.y), fmax(m4.z, m4.w));
  const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
  const int16 qa = convert_int16(round(a * id)), qb = convert_int16(round(b * id));
  vstore16(convert_char16(qa), 0, row + 32 * c);
  vstore16(convert_char16(qb), 1, row + 32 * c);
  global float* scales = (global float*)(row + 32 * chunks);
  vstore_half_rte(d, 0, (global half*)(scales + c));  // round d to f16 in its own slot
  const float dh = vload_half(0, (global half*)(scales + c));
  scales[c] = dh;
  const int16 qs = qa + qb;
  const int8 q8 = qs.lo + qs.hi;
  const int4 q4 = q8.lo + q8.hi;
  scales[chunks + c] = dh * (float)(q4.x + q4.y + q4.z + q4.w);
}

// x -> xq, one work-item per (token, chunk).
kernel void quantize_q8_rows(const global float* x, long x_off, int T, int K, global char* xq, long xq_off) {
  const int chunks = K / 32, gid = (int)get_global_id(0);
  const int t = gid / chunks, c = gid % chunks;
  if (t >= T) return;
  quantize_chunk(x + x_off + (long)t * K + 32 * c, (global char*)xq_row(xq + xq_off, t, K), c, chunks);
}
