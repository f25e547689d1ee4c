// Weight rows in their stored layout (plain floats or GGUF blocks, see cpp/quant/formats.h),
// read 32 elements at a time. The program is built with exactly one -DW_<TYPE>; every loader
// gives elements [32c, 32c + 32) of a row as two float16 (lo = first 16).
//
// Dequantization keeps the operation order of cpp/quant/dequantize.cpp and is not contracted
// into FMAs, so embedding rows equal the reference dequantizer bit for bit.
#pragma OPENCL FP_CONTRACT OFF

#define CHUNK 32

inline uint load_u32_bytes(const global uchar* p) {
  return (uint)p[0] | ((uint)p[1] << 8) | ((uint)p[2] << 16) | ((uint)p[3] << 24);
}
inline float load_f16(const global uchar* p) { return vload_half(0, (const global half*)p); }

// Bit j of qh, for j = base .. base + 15, as 0 / 1 per lane.
inline int16 bits16(uint qh, int base) {
  const uint16 lane = (uint16)(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return convert_int16(((uint16)(qh) >> (lane + (uint)base)) & 1u);
}

// Sub-block j (0..7) scale and min of a Q4_K / Q5_K super-block (see k4_scale_min).
inline int2 k4_scale_min(const global uchar* s, int j) {
  if (j < 4) return (int2)(s[j] & 63, s[j + 4] & 63);
  return (int2)((s[j + 4] & 15) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4));
}

#if defined(W_F32)
#define W_BLOCK_ELEMS 1
#define W_FLOAT 1
inline float load_elem(const global uchar* row, int k) { return ((const global float*)row)[k]; }
inline void load_chunk(const global uchar* row, int c, float16* lo, float16* hi) {
  const global float* r = (const global float*)row + CHUNK * c;
  *lo = vload16(0, r);
  *hi = vload16(1, r);
}

#elif defined(W_F16)
#define W_BLOCK_ELEMS 1
#define W_FLOAT 1
inline float load_elem(const global uchar* row, int k) { return vload_half(k, (const global half*)row); }
inline void load_chunk(const global uchar* row, int c, float16* lo, float16* hi) {
  const global half* r = (const global half*)row + CHUNK * c;
  *lo = vload_half16(0, r);
  *hi = vload_half16(1, r);
}

#elif defined(W_BF16)
#define W_BLOCK_ELEMS 1
#define W_FLOAT 1
inline float load_elem(const global uchar* row, int k) { return bf16_to_f32(((const global ushort*)row)[k]); }
inline void load_chunk(const global uchar* row, int c, float16* lo, float16* hi) {
  const global ushort* r = (const global ushort*)row + CHUNK * c;
  *lo = as_float16(convert_uint16(vload16(0, r)) << 16);
  *hi = as_float16(convert_uint16(vload16(1, r)) << 16);
}

#elif defined(W_Q4_0)  // 18 bytes: d, qs[16]; x = d * (q - 8)
#define W_BLOCK_ELEMS 32
inline void load_chunk(const global uchar* row, int c, float16* lo, float16* hi) {
  const global uchar* b = row + 18 * c;
  const float d = load_f16(b);
  const uchar16 q = vload16(0, b + 2);
  *lo = convert_float16(convert_int16(q & (uchar)15) - 8) * d;
  *hi = convert_float16(convert_int16(q >> (uchar)4) - 8) * d;
}

#elif defined(W_Q4_1)  // 20 bytes: d, m, qs[16]; x = d * q + m
#define W_BLOCK_ELEMS 32
inline void load_chunk(const global uchar* row, int c, float16* lo, float16* hi) {
  const global uchar* b = row + 20 * c;
  const float d = load_f16(b), m = load_f16(b + 2);
  const uchar16 q = vload16(0, b + 4);
  *lo = convert_float16(q & (uchar)15) * d + m;
  *hi = convert_float16(q >> (uchar)4) * d + m;
}

#elif defined(W_Q5_0)  // 22 bytes: d, qh[4], qs[16]; x = d * (q - 16)
#define W_BLOCK_ELEMS 32
inline void load_chunk(const global uchar* row, int c, float16* lo, float16* hi) {
  const global uchar* b = row + 22 * c;
  const float d = load_f16(b);
  const uint qh = load_u32_bytes(b + 2);
  const uchar16 q = vload16(0, b + 6);
  *lo = convert_float16((convert_int16(q & (uchar)15) | (bits16(qh, 0) << 4)) - 16) * d;
  *hi = convert_float16((convert_int16(q >> (uchar)4) | (bits16(qh, 16) << 4)) - 16) * d;
}

#elif defined(W_Q5_1)  // 24 bytes: d, m, qh[4], qs[16]; x = d * q + m
#define W_BLOCK_ELEMS 32
inline void load_chunk(const global uchar* row, int c, float16* lo, float16* hi) {
  const global uchar* b = row + 24 * c;
  const float d = load_f16(b), m = load_f16(b + 2);
  const uint qh = load_u32_bytes(b + 4);
  const uchar16 q = vload16(0, b + 8);
  *lo = convert_float16(convert_int16(q & (uchar)15) | (bits16(qh, 0) << 4)) * d + m;
  *hi = convert_float16(convert_int16(q >> (uchar)4) | (bits16(qh, 16) << 4)) * d + m;
}

#elif defined(W_Q8_0)  // 34 bytes: d, qs[32]; x = d * q
#define W_BLOCK_ELEMS 32
inline void load_chunk(const global uchar* row, int c, float16* lo, float16* hi) {
  const global uchar* b = row + 34 * c;
  const float d = load_f16(b);
  const global char* q = (const global char*)(b + 2);
  *lo = convert_float16(vload16(0, q)) * d;
  *hi = convert_float16(vload16(1, q)) * d;
}

#elif defined(W_Q4_K)  // 144 bytes: d, dmin, scales[12], qs[128]; x = d*sc*q - dmin*m
#define W_BLOCK_ELEMS 256
inline void load_chunk(const global uchar* row, int c, float16* lo, float16* hi) {
  const global uchar* b = row + 144 * (c >> 3);
  const int j = c & 7;
  const int2 sm = k4_scale_min(b + 4, j);
  const float dl = load_f16(b) * (float)sm.x, ml = load_f16(b + 2) * (float)sm.y;
  const global uchar* q = b + 16 + 32 * (j >> 1);
  const uchar shift = (uchar)(4 * (j & 1));
  *lo = dl * convert_float16((vload16(0, q) >> shift) & (uchar)15) - ml;
  *hi = dl * convert_float16((vload16(1, q) >> shift) & (uchar)15) - ml;
}

#elif defined(W_Q5_K)  // 176 bytes: d, dmin, scales[12], qh[32], qs[128]
#define W_BLOCK_ELEMS 256
inline void load_chunk(const global uchar* row, int c, float16* lo, float16* hi) {
  const global uchar* b = row + 176 * (c >> 3);
  const int j = c & 7;
  const int2 sm = k4_scale_min(b + 4, j);
  const float dl = load_f16(b) * (float)sm.x, ml = load_f16(b + 2) * (float)sm.y;
  const global uchar* q = b + 48 + 32 * (j >> 1);
  const uchar shift = (uchar)(4 * (j & 1));
  const uchar hb = (uchar)j;  // element l's fifth bit is bit j of qh[l]
  const int16 q0 = convert_int16(((vload16(0, q) >> shift) & (uchar)15) | (((vload16(0, b + 16) >> hb) & (uchar)1) << 4));
  const int16 q1 = convert_int16(((vload16(1, q) >> shift) & (uchar)15) | (((vload16(1, b + 16) >> hb) & (uchar)1) << 4));
  *lo = dl * convert_float16(q0) - ml;
  *hi = dl * convert_float16(q1) - ml;
}

#elif defined(W_Q6_K)  // 210 bytes: ql[128], qh[64], scales[16] (int8), d; x = d*sc*(q - 32)
#define W_BLOCK_ELEMS 256
inline void load_chunk(const global uchar* row, int c, float16* lo, float16* hi) {
  const global uchar* b = row + 210 * (c >> 3);
  const int j = c & 7, half_ = j >> 2, g = j & 3;
  const global uchar* ql = b + 64 * half_ + 32 * (g & 1);
  const global uchar* qh = b + 128 + 32 * half_;
  const global char* sc = (const global char*)(b + 192) + 8 * half_ + 2 * g;
  const float d = load_f16(b + 208);
  const uchar lshift = (uchar)(4 * (g >> 1)), hshift = (uchar)(2 * g);
  const int16 q0 = convert_int16(((vload16(0, ql) >> lshift) & (uchar)15) | (((vload16(0, qh) >> hshift) & (uchar)3) << 4)) - 32;
  const int16 q1 = convert_int16(((vload16(1, ql) >> lshift) & (uchar)15) | (((vload16(1, qh) >> hshift) & (uchar)3) << 4)) - 32;
  *lo = (d * (float)sc[0]) * convert_float16(q0);
  *hi = (d * (float)sc[1]) * convert_float16(q1);
}

#else
#error "build with one -DW_<TYPE>"
#endif
