// Weight rows for the gpu family, read 32 elements (a chunk) at a time with loads as wide as the
// data's alignment allows. Built with one -DW_<TYPE>, -DW_QALIGN=<bytes> (the alignment of every
// block's quants: 2 .. 16) and, for rows in the backend's flat layout, -DW_FLAT.
//
// Layouts of a quantized row of nb blocks (each block's quants are the bytes [W_Q_OFF, W_Q_OFF +
// W_Q_BYTES) of its GGUF block, the rest is its header: scales, mins, ...):
//   GGUF  as stored: block b at row + b * W_BLOCK_BYTES;
//   flat  the row's quants first (block b's at row + b * W_Q_BYTES), then the headers in block
//         order (the bytes before the quants, then those after). The same bytes per row as GGUF, so
//         rows, views and split buffers work alike; the quants of a row whose size is a multiple
//         of 16 are 16-byte aligned. The backend repacks 2-byte aligned types into it at load.
//
// Every quantized type defines chunk_q(row, nb, c, &lo, &hi, &d, &m): chunk c's 32 quants as bytes
// packed in 32-bit words (lo = elements 0..15, hi = 16..31; unpacked by 32-bit masks and shifts,
// which GPUs do 4 quants at a time, and fed to dp4a as they are), standing for the integers
// q + W_Q_ZERO (Q4_0's -8, ...; the signed types' bytes are the integers), with
// w = d.s0 * (q + W_Q_ZERO) + m.s0 for lo and d.s1 * (...) + m.s1 for hi (one scale per 16
// elements for Q2_K / Q3_K / Q6_K); W_HAS_MIN marks the types with an m.
// chunk_dequant computes those products in the reference dequantizer's order
// (cpp/quant/dequantize.cpp; FP_CONTRACT OFF), so embedding rows equal it bit for bit. The float
// types define chunk_f and load_elem (any row length) and W_FLOAT.
#pragma OPENCL FP_CONTRACT OFF

#define CHUNK 32

#ifndef W_QALIGN
#define W_QALIGN 2
#endif

// 16 bytes at p, p aligned to W_QALIGN, as 4 little-endian words (4 quants each).
static inline uint4 load_q16(const global uchar* p) {
#if W_QALIGN >= 16
  return *(const global uint4*)p;
#elif W_QALIGN >= 8
  return as_uint4(vload2(0, (const global ulong*)p));
#elif W_QALIGN >= 4
  return vload4(0, (const global uint*)p);
#else
  return as_uint4(vload8(0, (const global ushort*)p));
#endif
}

// Header fields (at even offsets: every block starts at an even address).
static inline float f16_at(const global uchar* p) { return vload_half(0, (const global half*)p); }
static inline uint u16_at(const global uchar* p) { return *(const global ushort*)p; }
static inline uint u32_at(const global uchar* p) { return u16_at(p) | (u16_at(p + 2) << 16); }

// Bits 0..15 of bits as the fifth bit (16) of bytes 0..15: each word takes 4 bits, spread to its
// bytes by one multiply (the four shifted copies do not overlap).
static inline uint4 fifth_bits(uint bits) {
  const uint4 nibbles = ((uint4)(bits, bits >> 4, bits >> 8, bits >> 12)) & 15u;
  return ((nibbles * 0x00204081u) & 0x01010101u) << 4;
}

// The IQ4 levels of 16 nibbles (one per byte).
static inline uint4 iq4_levels(uint4 nibbles) { return as_uint4(shuffle(IQ4_LEVELS, as_uchar16(nibbles))); }

#if defined(W_F32) || defined(W_F16) || defined(W_BF16)
#define W_FLOAT 1
#define W_CHUNKS 1
#endif

#if defined(W_F32)
static inline float load_elem(const global uchar* row, int k) { return ((const global float*)row)[k]; }
static inline void chunk_f(const global uchar* row, int c, float16* lo, float16* hi) {
  *lo = vload16(2 * c, (const global float*)row);
  *hi = vload16(2 * c + 1, (const global float*)row);
}
#elif defined(W_F16)
static inline float load_elem(const global uchar* row, int k) { return vload_half(k, (const global half*)row); }
static inline void chunk_f(const global uchar* row, int c, float16* lo, float16* hi) {
  *lo = vload_half16(2 * c, (const global half*)row);
  *hi = vload_half16(2 * c + 1, (const global half*)row);
}
#elif defined(W_BF16)
static inline float load_elem(const global uchar* row, int k) { return bf16_to_f32(((const global ushort*)row)[k]); }
static inline void chunk_f(const global uchar* row, int c, float16* lo, float16* hi) {
  *lo = as_float16(convert_uint16(vload16(2 * c, (const global ushort*)row)) << 16);
  *hi = as_float16(convert_uint16(vload16(2 * c + 1, (const global ushort*)row)) << 16);
}

#elif defined(W_Q4_0)  // d, qs[16]; w = d * (q - 8)
#define W_Q_ZERO -8
#define W_CHUNKS 1
#define W_BLOCK_BYTES 18
#define W_Q_OFF 2
#define W_Q_BYTES 16
#elif defined(W_Q4_1)  // d, m, qs[16]; w = d * q + m
#define W_CHUNKS 1
#define W_BLOCK_BYTES 20
#define W_Q_OFF 4
#define W_Q_BYTES 16
#define W_HAS_MIN 1
#elif defined(W_Q5_0)  // d, qh[4], qs[16]; w = d * (q - 16)
#define W_Q_ZERO -16
#define W_CHUNKS 1
#define W_BLOCK_BYTES 22
#define W_Q_OFF 6
#define W_Q_BYTES 16
#elif defined(W_Q5_1)  // d, m, qh[4], qs[16]; w = d * q + m
#define W_CHUNKS 1
#define W_BLOCK_BYTES 24
#define W_Q_OFF 8
#define W_Q_BYTES 16
#define W_HAS_MIN 1
#elif defined(W_Q8_0)  // d, qs[32]; w = d * q
#define W_CHUNKS 1
#define W_BLOCK_BYTES 34
#define W_Q_OFF 2
#define W_Q_BYTES 32
#elif defined(W_IQ4_NL)  // d, qs[16]; w = d * level[q]
#define W_CHUNKS 1
#define W_BLOCK_BYTES 18
#define W_Q_OFF 2
#define W_Q_BYTES 16
#elif defined(W_Q2_K)  // scales[16], qs[64], d, dmin
#define W_CHUNKS 8
#define W_BLOCK_BYTES 84
#define W_Q_OFF 16
#define W_Q_BYTES 64
#define W_HAS_MIN 1
#elif defined(W_Q3_K)  // hmask[32], qs[64], scales[12], d
#define W_Q_ZERO -4
#define W_CHUNKS 8
#define W_BLOCK_BYTES 110
#define W_Q_OFF 0
#define W_Q_BYTES 96
#elif defined(W_Q4_K)  // d, dmin, scales[12], qs[128]
#define W_CHUNKS 8
#define W_BLOCK_BYTES 144
#define W_Q_OFF 16
#define W_Q_BYTES 128
#define W_HAS_MIN 1
#elif defined(W_Q5_K)  // d, dmin, scales[12], qh[32], qs[128]
#define W_CHUNKS 8
#define W_BLOCK_BYTES 176
#define W_Q_OFF 16
#define W_Q_BYTES 160
#define W_HAS_MIN 1
#elif defined(W_Q6_K)  // ql[128], qh[64], scales[16], d
#define W_Q_ZERO -32
#define W_CHUNKS 8
#define W_BLOCK_BYTES 210
#define W_Q_OFF 0
#define W_Q_BYTES 192
#elif defined(W_IQ4_XS)  // d, scales_h, scales_l[4], qs[128]
#define W_CHUNKS 8
#define W_BLOCK_BYTES 136
#define W_Q_OFF 8
#define W_Q_BYTES 128
#else
#error "build with one -DW_<TYPE>"
#endif

#ifndef W_Q_ZERO
#define W_Q_ZERO 0
#endif

#ifndef W_FLOAT
// Block b's quants and header, and a header field's offset from the GGUF block offset `off`.
#ifdef W_FLAT
#define W_H_BYTES (W_BLOCK_BYTES - W_Q_BYTES)
static inline const global uchar* block_quants(const global uchar* row, int nb, int b) { return row + (long)b * W_Q_BYTES; }
static inline const global uchar* block_header(const global uchar* row, int nb, int b) {
  return row + (long)nb * W_Q_BYTES + (long)b * W_H_BYTES;
}
#define HOFF(off) ((off) >= W_Q_OFF ? (off) - W_Q_BYTES : (off))
#else
static inline const global uchar* block_quants(const global uchar* row, int nb, int b) { return row + (long)b * W_BLOCK_BYTES + W_Q_OFF; }
static inline const global uchar* block_header(const global uchar* row, int nb, int b) { return row + (long)b * W_BLOCK_BYTES; }
#define HOFF(off) (off)
#endif

static inline void chunk_q(const global uchar* row, int nb, int c, uint4* lo, uint4* hi, float2* d, float2* m) {
  const int b = c / W_CHUNKS;
#if W_CHUNKS > 1
  const int j = c % W_CHUNKS;  // the chunk within a 256-element block
#endif
  const global uchar* q = block_quants(row, nb, b);
  const global uchar* h = block_header(row, nb, b);
  *m = (float2)(0.0f);
#if defined(W_Q4_0) || defined(W_Q4_1)
  const uint4 v = load_q16(q);
  *lo = v & 0x0F0F0F0Fu;
  *hi = (v >> 4) & 0x0F0F0F0Fu;
  *d = (float2)(f16_at(h));
#ifdef W_Q4_1
  *m = (float2)(f16_at(h + 2));
#endif
#elif defined(W_Q5_0) || defined(W_Q5_1)
#ifdef W_Q5_0
  const uint qh = u32_at(h + 2);
#else
  const uint qh = u32_at(h + 4);
  *m = (float2)(f16_at(h + 2));
#endif
  const uint4 v = load_q16(q);
  *lo = (v & 0x0F0F0F0Fu) | fifth_bits(qh);
  *hi = ((v >> 4) & 0x0F0F0F0Fu) | fifth_bits(qh >> 16);
  *d = (float2)(f16_at(h));
#elif defined(W_Q8_0)
  *lo = load_q16(q);
  *hi = load_q16(q + 16);
  *d = (float2)(f16_at(h));
#elif defined(W_IQ4_NL)
  const uint4 v = load_q16(q);
  *lo = iq4_levels(v & 0x0F0F0F0Fu);
  *hi = iq4_levels((v >> 4) & 0x0F0F0F0Fu);
  *d = (float2)(f16_at(h));
#elif defined(W_Q2_K)
  // Each 32 bytes of qs hold four 2-bit planes of 32 elements; chunk j is plane j % 4 of half j / 4,
  // each 16 elements with their own scale / min nibbles (sub-blocks 2j, 2j + 1).
  const global uchar* p = q + 32 * (j >> 2);
  const uint shift = 2 * (j & 3);
  *lo = (load_q16(p) >> shift) & 0x03030303u;
  *hi = (load_q16(p + 16) >> shift) & 0x03030303u;
  const uint s0 = h[HOFF(2 * j)], s1 = h[HOFF(2 * j + 1)];
  const float dd = f16_at(h + HOFF(80)), dmin = f16_at(h + HOFF(82));
  *d = (float2)(dd * (float)(s0 & 15), dd * (float)(s1 & 15));
  *m = -(float2)(dmin * (float)(s0 >> 4), dmin * (float)(s1 >> 4));
#elif defined(W_Q3_K)
  // As Q2_K's planes (qs after the 32 bytes of hmask) plus 4 where bit j of hmask[l] is set; less 4.
  const global uchar* p = q + 32 + 32 * (j >> 2);
  const uint shift = 2 * (j & 3);
  *lo = ((load_q16(p) >> shift) & 0x03030303u) | (((load_q16(q) >> (uint)j) & 0x01010101u) << 2);
  *hi = ((load_q16(p + 16) >> shift) & 0x03030303u) | (((load_q16(q + 16) >> (uint)j) & 0x01010101u) << 2);
  // 6-bit scale of sub-block i: low 4 bits in nibble i / 8 of byte i % 8, top 2 in byte 8 + i % 4.
  const global uchar* sc = h + HOFF(96);
  const int i0 = 2 * j, i1 = 2 * j + 1;
  const int l0 = i0 < 8 ? (sc[i0] & 15) : (sc[i0 - 8] >> 4), l1 = i1 < 8 ? (sc[i1] & 15) : (sc[i1 - 8] >> 4);
  const int t0 = (sc[8 + i0 % 4] >> (2 * (i0 / 4))) & 3, t1 = (sc[8 + i1 % 4] >> (2 * (i1 / 4))) & 3;
  const float dd = f16_at(h + HOFF(108));
  *d = (float2)(dd * (float)((l0 | (t0 << 4)) - 32), dd * (float)((l1 | (t1 << 4)) - 32));
#elif defined(W_Q4_K) || defined(W_Q5_K)
  // Sub-block j: 6-bit scale and min (formats.h: k4_scale_min); chunks 2i, 2i + 1 are the low and
  // high nibbles of qs[32i .. 32i + 31]; Q5_K's fifth bit of element l is bit j of qh[l].
  const global uchar* sc = h + HOFF(4);
  int s, mn;
  if (j < 4) {
    s = sc[j] & 63;
    mn = sc[j + 4] & 63;
  } else {
    s = (sc[j + 4] & 15) | ((sc[j - 4] >> 6) << 4);
    mn = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
  }
#ifdef W_Q5_K
  const global uchar* qs = q + 32 + 32 * (j >> 1);
  const uint4 h0 = ((load_q16(q) >> (uint)j) & 0x01010101u) << 4;
  const uint4 h1 = ((load_q16(q + 16) >> (uint)j) & 0x01010101u) << 4;
#else
  const global uchar* qs = q + 32 * (j >> 1);
  const uint4 h0 = (uint4)(0), h1 = (uint4)(0);
#endif
  const uint shift = 4 * (j & 1);
  *lo = ((load_q16(qs) >> shift) & 0x0F0F0F0Fu) | h0;
  *hi = ((load_q16(qs + 16) >> shift) & 0x0F0F0F0Fu) | h1;
  *d = (float2)(f16_at(h) * (float)s);
  *m = (float2)(-(f16_at(h + 2) * (float)mn));
#elif defined(W_Q6_K)
  // Half j / 4 (128 elements) takes 64 bytes of ql and 32 of qh; its chunk g = j % 4 uses the low
  // (g < 2) or high nibbles of ql[32 (g & 1) ..] and the 2-bit field 2g of qh; scales per 16.
  const int hf = j >> 2, g = j & 3;
  const global uchar* ql = q + 64 * hf + 32 * (g & 1);
  const global uchar* qh = q + 128 + 32 * hf;
  const uint ls = 4 * (g >> 1), hs = 2 * g;
  *lo = ((load_q16(ql) >> ls) & 0x0F0F0F0Fu) | (((load_q16(qh) >> hs) & 0x03030303u) << 4);
  *hi = ((load_q16(ql + 16) >> ls) & 0x0F0F0F0Fu) | (((load_q16(qh + 16) >> hs) & 0x03030303u) << 4);
  const global char* sc = (const global char*)(h + HOFF(192)) + 8 * hf + 2 * g;
  const float dd = f16_at(h + HOFF(208));
  *d = (float2)(dd * (float)sc[0], dd * (float)sc[1]);
#elif defined(W_IQ4_XS)
  const uint4 v = load_q16(q + 16 * j);
  *lo = iq4_levels(v & 0x0F0F0F0Fu);
  *hi = iq4_levels((v >> 4) & 0x0F0F0F0Fu);
  const int s = ((h[HOFF(4) + j / 2] >> (4 * (j % 2))) & 15) | (((u16_at(h + HOFF(2)) >> (2 * j)) & 3) << 4);
  *d = (float2)(f16_at(h) * (float)(s - 32));
#endif
}

// A chunk's 16 quants of lo or hi as the integers they stand for (q + W_Q_ZERO), as floats.
static inline float16 quants_float(uint4 q) { return convert_float16(as_char16(q)) + (float)W_Q_ZERO; }
#endif  // !W_FLOAT

// Chunk c of a row as floats, bit for bit the reference dequantizer's values.
static inline void chunk_dequant(const global uchar* row, int nb, int c, float16* lo, float16* hi) {
#ifdef W_FLOAT
  chunk_f(row, c, lo, hi);
#else
  uint4 ql, qh;
  float2 d, m;
  chunk_q(row, nb, c, &ql, &qh, &d, &m);
  *lo = d.s0 * quants_float(ql);
  *hi = d.s1 * quants_float(qh);
#ifdef W_HAS_MIN
  *lo = *lo + m.s0;
  *hi = *hi + m.s1;
#endif
#endif
}

// The same for a row of n elements (embedding.cl).
static inline void row_chunk(const global uchar* row, int n, int c, float16* lo, float16* hi) {
#ifdef W_FLOAT
  chunk_f(row, c, lo, hi);
#else
  chunk_dequant(row, n / (CHUNK * W_CHUNKS), c, lo, hi);
#endif
}
