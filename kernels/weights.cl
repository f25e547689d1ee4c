// Weight rows in their stored layout (plain floats or GGUF blocks, see cpp/quant/formats.h).
// The program is built with exactly one -DW_<TYPE> (F32, F16, BF16, Q4_0 .. Q8_0, Q2_K .. Q6_K,
// IQ4_NL, IQ4_XS), which defines:
//   W_CHUNKS       32-element chunks per block (1 for plain floats and the 32-element formats,
//                  8 for the 256-element k-quants), W_BLOCK_BYTES the block size in bytes;
//   wscales        a block's scales, decoded once per block by block_scales(block);
//   block_chunk    chunk j of a block as two float16 (lo = its first 16 elements).
// Decoding the scales once per block and not once per chunk is what makes the k-quants fast.
// The quantized types also define block_dot (W_BLOCK_DOT), the one-token dot product of a block
// with f32 x without dequantizing it: see there (the IQ4 types have none: linear.cl dots their
// dequantized chunks). W_XSUMS marks the types whose block_dot needs the sums of x over each
// 32-element chunk (those with a per-block min / offset term). All but Q2_K / Q3_K define
// block_dot_q8 (W_DOT_Q8), the same over x quantized to 8 bits (decodes).
//
// Dequantization keeps the operation order of cpp/quant/dequantize.cpp and is not contracted
// into FMAs, so embedding rows equal the reference dequantizer bit for bit.
#pragma OPENCL FP_CONTRACT OFF

#define CHUNK 32  // elements per block_chunk

// 16 bytes from any address. vload16 on uchar is split into byte loads by some compilers
// (pocl among them); an under-aligned vector type gives one unaligned vector load.
typedef uchar16 __attribute__((aligned(1))) uchar16_unaligned;
static inline uchar16 load_bytes16(const global uchar* p) { return *(const global uchar16_unaligned*)p; }

// x86 CPUs under pocl (clang): a few instructions OpenCL C has no words for, through clang's
// builtins (F16C conversions, AVX2 byte multiply-adds, AVX-512 mask expansion). Every other
// device compiles the portable forms beside them, which give the same bits;
// FERRUM_OPENCL_PORTABLE=1 (-DPORTABLE_KERNELS) selects those on x86 too (tests compare them).
#if defined(__clang__) && defined(__AVX2__) && defined(__F16C__) && !defined(PORTABLE_KERNELS)
#define X86_BUILTINS 1
#if defined(__AVX512BW__) && defined(__AVX512VL__)
#define X86_AVX512 1
#endif
#endif

typedef uint __attribute__((aligned(1))) uint_unaligned;

static inline uint load_u32_bytes(const global uchar* p) {
  return (uint)p[0] | ((uint)p[1] << 8) | ((uint)p[2] << 16) | ((uint)p[3] << 24);
}

// The f16 pair (d, m) at p.
static inline float2 load_f16x2(const global uchar* p) {
  const uint2 h = (uint2)(((const global ushort*)p)[0], ((const global ushort*)p)[1]);
  return as_float2(((h & 0x8000u) << 16) | ((h & 0x7fffu) << 13)) * 0x1p112f;
}
// A block's f16 scale. The float's exponent field is re-biased by one multiply, exact for every
// finite half including subnormals (quantizers never write inf / NaN scales); pocl's scalar
// vload_half is a branchy software routine that cost more than the whole block's math.
static inline float load_f16(const global uchar* p) {
  const uint h = *(const global ushort*)p;
  return as_float(((h & 0x8000u) << 16) | ((h & 0x7fffu) << 13)) * 0x1p112f;
}

// The same for block_dot_q8's one block at a time: on x86 one vcvtph2ps (exact too), where the
// re-biasing is seven scalar instructions. The tile kernels keep load_f16: there the compiler
// vectorizes it over a tile's rows, and the builtin made Q4_1 / Q8_0 tiles slower. The halves
// are read as 32-bit integers (bytes past the scale are the block's own): read as 16-bit ones,
// LLVM builds a block pair's scales by inserting them into whatever register is free, often an
// accumulator, a false dependency that slows Q4_0 / Q5_0 badly.
#ifdef X86_BUILTINS
static inline float4 f16x2_to_f32(uint h) { return __builtin_ia32_vcvtph2ps(as_short8((uint4)(h, 0u, 0u, 0u))); }
static inline float2 block_f16x2(const global uchar* p) { return f16x2_to_f32(*(const global uint_unaligned*)p).s01; }
static inline float block_f16(const global uchar* p) { return f16x2_to_f32(*(const global uint_unaligned*)p & 0xffffu).s0; }
#else
static inline float2 block_f16x2(const global uchar* p) { return load_f16x2(p); }
static inline float block_f16(const global uchar* p) { return load_f16(p); }
#endif

// block_dot(b, x, xs, acc, acc_m): acc[0] (+ acc[1]) += the products of block b's quants with
// x[0, 32 * W_CHUNKS), lane-wise (the k-quants alternate between the two accumulators, so their
// FMAs do not wait for each other); acc_m += the rest of the block's dot product (mins times sums
// of x, xs[j] the sum of x over chunk j), lane-wise too (a horizontal sum per block is slower).
// The block's scales multiply sums of products, not every weight: per 32 weights one multiply and
// two FMAs after the int-to-float conversions, where dequantizing first costs four float ops.
// Offsets such as Q4_0's -8 are applied to the bytes (one 16-byte op) before widening to floats.
// On pocl this is bound by vector instructions, not by memory (docs/performance.md).
// A block's scale read back from memory: the FMA then takes it as a broadcast memory operand,
// where a scale in a register costs a 512-bit broadcast, one of ~8 vector ops per 32 weights.
// The volatile keeps the compiler from forwarding the value.
ALWAYS_INLINE float via_memory(float v) {
  volatile float m = v;
  return m;
}

#define CHUNK_DOT(x, q_lo, q_hi) fma(vload16(1, x), convert_float16(q_hi), vload16(0, x) * convert_float16(q_lo))

typedef uchar4 __attribute__((aligned(1))) uchar4_unaligned;

// ---- 8-bit activations (linear_q8) ----
// block_dot_q8(b, xq, xd, xsum, acc, acc_m, acc_s) is block_dot over x quantized per 32
// elements to int8 (see quantize_q8_rows in linear.cl): xq the block's quants, xd / xsum per
// 32-element chunk its scale and the sum of its dequantized values; the 32-element types add
// their min / offset term to the scalar acc_s, the k-quants theirs to acc_m lane-wise. Weight quants times x quants are exact integer
// sums of four products (dot32_*), converted to floats once per 4 products and scaled per chunk
// by d_w * d_x; mins and offsets (Q4_0's 8) come from xsum. On pocl this takes far fewer vector
// instructions than block_dot's float conversions (docs/performance.md).
//
// Lane i of dot32_*(lo, hi, xq) is the sum of w[l] * xq[l] for l = 4i .. 4i + 3 (lo holds
// elements 0..15, hi 16..31), on every device: integers, so the result is exact either way.
#ifdef X86_BUILTINS
// x86 CPUs (pocl): vpmaddubsw (unsigned bytes times signed bytes, adjacent pairs summed to 16
// bits) then vpmaddwd by ones. The pairs cannot saturate: |w| <= 128 and |xq| <= 127, and the
// unsigned weights are below 64 (2 * 63 * 127 < 2^15); signed ones pass |w| and give xq w's sign.
typedef char char32 __attribute__((ext_vector_type(32)));
typedef short short16_x86 __attribute__((ext_vector_type(16)));
typedef char32 __attribute__((aligned(1))) char32_unaligned;
ALWAYS_INLINE int8 sums_of_4(char32 w_unsigned, char32 x) {
  return as_int8(__builtin_ia32_pmaddwd256(__builtin_ia32_pmaddubsw256(w_unsigned, x), (short16_x86)(1)));
}
ALWAYS_INLINE int8 dot32_u(uchar16 lo, uchar16 hi, const global char* xq) {
  return sums_of_4((char32)(as_char16(lo), as_char16(hi)), *(const global char32_unaligned*)xq);
}
ALWAYS_INLINE int8 dot32_s(char16 lo, char16 hi, const global char* xq) {
  const char32 w = (char32)(lo, hi);  // psignb(w, w) = |w| (-128 stays 0x80: 128 unsigned)
  return sums_of_4(__builtin_ia32_psignb256(w, w), __builtin_ia32_psignb256(*(const global char32_unaligned*)xq, w));
}
#else
ALWAYS_INLINE int8 dot32_products(int16 lo, int16 hi, const global char* xq) {
  const int16 p = lo * convert_int16(vload16(0, xq)), q = hi * convert_int16(vload16(1, xq));
  return (int8)(p.s048c + p.s159d + p.s26ae + p.s37bf, q.s048c + q.s159d + q.s26ae + q.s37bf);
}
ALWAYS_INLINE int8 dot32_u(uchar16 lo, uchar16 hi, const global char* xq) {
  return dot32_products(convert_int16(lo), convert_int16(hi), xq);
}
ALWAYS_INLINE int8 dot32_s(char16 lo, char16 hi, const global char* xq) {
  return dot32_products(convert_int16(lo), convert_int16(hi), xq);
}
#endif

// The fifth bits of a Q5_0 / Q5_1 block: bit l of qh (element l) as 16 in byte l % 16 of lo
// (l < 16) or hi. Byte swizzles and a bit test: cheap 16-byte ops, before widening to floats;
// with AVX-512 one mask expansion (vpmovm2b) makes all 32 bytes.
static inline void high_bits32(uchar4 qh, uchar16* lo, uchar16* hi) {
#ifdef X86_AVX512
  const char32 bits = __builtin_ia32_cvtmask2b256(as_uint(qh)) & (char)16;
  *lo = as_uchar16(bits.lo);
  *hi = as_uchar16(bits.hi);
#else
  const uchar16 bit = (uchar16)(1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128);
  *lo = as_uchar16((qh.s0000000011111111 & bit) == bit) & (uchar)16;
  *hi = as_uchar16((qh.s2222222233333333 & bit) == bit) & (uchar)16;
#endif
}

// A Q5_0 / Q5_1 block's 5-bit quants from its qh and qs: elements 0..15 in lo, 16..31 in hi.
ALWAYS_INLINE void q5_quants(const global uchar* qh, const global uchar* qs, uchar16* lo, uchar16* hi) {
  uchar16 h0, h1;
  high_bits32(*(const global uchar4_unaligned*)qh, &h0, &h1);
  const uchar16 q = load_bytes16(qs);
  *lo = (q & (uchar)15) | h0;
  *hi = (q >> (uchar)4) | h1;
}

// Bit j of qh, for j = base .. base + 15, as 0 / 1 per lane.
static inline int16 bits16(uint qh, int base) {
  const uint16 lane = (uint16)(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return convert_int16(((uint16)(qh) >> (lane + (uint)base)) & 1u);
}

// The eight 6-bit scales and mins of a Q4_K / Q5_K super-block (see k4_scale_min in formats.h):
// sub-blocks 0-3 in the low 6 bits of bytes 0-3 / 4-7, sub-blocks 4-7 in bytes 8-11 plus the top
// two bits of bytes 0-3 / 4-7. Multiplied by d / dmin as the reference does.
typedef struct {
  float d[8], m[8];
} k4_scales;
static inline k4_scales k4_block_scales(const global uchar* b) {
  const uchar16 s = load_bytes16(b + 4);  // bytes 4..15 are the scales; 16..19 belong to qs
  const uchar4 lo = s.s0123, mid = s.s4567, hi = s.s89ab;
  const uchar8 sc = (uchar8)(lo & (uchar)63, (hi & (uchar)15) | ((lo >> (uchar)6) << (uchar)4));
  const uchar8 mn = (uchar8)(mid & (uchar)63, (hi >> (uchar)4) | ((mid >> (uchar)6) << (uchar)4));
  k4_scales r;
  vstore8(load_f16(b) * convert_float8(sc), 0, r.d);
  vstore8(load_f16(b + 2) * convert_float8(mn), 0, r.m);
  return r;
}

#if defined(W_F32)
#define W_CHUNKS 1
#define W_BLOCK_BYTES 128
#define W_FLOAT 1
typedef int wscales;
static inline wscales block_scales(const global uchar* b) { return 0; }
static inline float load_elem(const global uchar* row, int k) { return ((const global float*)row)[k]; }
static inline void block_chunk(const global uchar* b, wscales s, int j, float16* lo, float16* hi) {
  *lo = vload16(0, (const global float*)b);
  *hi = vload16(1, (const global float*)b);
}

#elif defined(W_F16)
#define W_CHUNKS 1
#define W_BLOCK_BYTES 64
#define W_FLOAT 1
typedef int wscales;
static inline wscales block_scales(const global uchar* b) { return 0; }
static inline float load_elem(const global uchar* row, int k) { return vload_half(k, (const global half*)row); }
static inline void block_chunk(const global uchar* b, wscales s, int j, float16* lo, float16* hi) {
  *lo = vload_half16(0, (const global half*)b);
  *hi = vload_half16(1, (const global half*)b);
}

#elif defined(W_BF16)
#define W_CHUNKS 1
#define W_BLOCK_BYTES 64
#define W_FLOAT 1
typedef int wscales;
static inline wscales block_scales(const global uchar* b) { return 0; }
static inline float load_elem(const global uchar* row, int k) { return bf16_to_f32(((const global ushort*)row)[k]); }
static inline void block_chunk(const global uchar* b, wscales s, int j, float16* lo, float16* hi) {
  *lo = as_float16(convert_uint16(vload16(0, (const global ushort*)b)) << 16);
  *hi = as_float16(convert_uint16(vload16(1, (const global ushort*)b)) << 16);
}

#elif defined(W_Q4_0) || defined(W_IQ4_NL)  // 18 bytes: d, qs[16]; x = d * (q - 8) / d * level[q]
#define W_CHUNKS 1
#define W_BLOCK_BYTES 18
typedef float wscales;
static inline wscales block_scales(const global uchar* b) { return load_f16(b); }
#ifdef W_IQ4_NL  // the nibbles index the IQ4 levels
static inline void block_chunk(const global uchar* b, wscales d, int j, float16* lo, float16* hi) {
  const uchar16 q = load_bytes16(b + 2);
  *lo = d * convert_float16(shuffle(IQ4_LEVELS, q & (uchar)15));
  *hi = d * convert_float16(shuffle(IQ4_LEVELS, q >> (uchar)4));
}
#define W_DOT_Q8 1
ALWAYS_INLINE void block_dot_q8(const global uchar* b, const global char* xq, const global float* xd, const global float* xsum, float8* acc, float8* acc_m, float* acc_s) {
  const uchar16 q = load_bytes16(b + 2);
  const int8 p = dot32_s(shuffle(IQ4_LEVELS, q & (uchar)15), shuffle(IQ4_LEVELS, q >> (uchar)4), xq);
  acc[0] = fma(convert_float8(p), block_f16(b) * xd[0], acc[0]);
}
#else
static inline void block_chunk(const global uchar* b, wscales d, int j, float16* lo, float16* hi) {
  const uchar16 q = load_bytes16(b + 2);
  *lo = convert_float16(convert_int16(q & (uchar)15) - 8) * d;
  *hi = convert_float16(convert_int16(q >> (uchar)4) - 8) * d;
}
#define W_BLOCK_DOT 1
ALWAYS_INLINE void block_dot(const global uchar* b, const global float* x, const local float* xs, float16* acc, float8* acc_m) {
  const uchar16 q = load_bytes16(b + 2);
  acc[0] = fma(CHUNK_DOT(x, as_char16(q & (uchar)15) - (char)8, as_char16(q >> (uchar)4) - (char)8), via_memory(load_f16(b)), acc[0]);
}

#define W_DOT_Q8 1
ALWAYS_INLINE void block_dot_q8(const global uchar* b, const global char* xq, const global float* xd, const global float* xsum, float8* acc, float8* acc_m, float* acc_s) {
  const uchar16 q = load_bytes16(b + 2);
  const float d = block_f16(b);
  acc[0] = fma(convert_float8(dot32_u(q & (uchar)15, q >> (uchar)4, xq)), d * xd[0], acc[0]);
  *acc_s = fma(-8.0f * d, xsum[0], *acc_s);
}
#endif
#elif defined(W_Q4_1)  // 20 bytes: d, m, qs[16]; x = d * q + m
#define W_CHUNKS 1
#define W_BLOCK_BYTES 20
typedef float2 wscales;
static inline wscales block_scales(const global uchar* b) { return load_f16x2(b); }
static inline void block_chunk(const global uchar* b, wscales dm, int j, float16* lo, float16* hi) {
  const uchar16 q = load_bytes16(b + 4);
  *lo = convert_float16(q & (uchar)15) * dm.x + dm.y;
  *hi = convert_float16(q >> (uchar)4) * dm.x + dm.y;
}
#define W_BLOCK_DOT 1
#define W_XSUMS 1
ALWAYS_INLINE void block_dot(const global uchar* b, const global float* x, const local float* xs, float16* acc, float8* acc_m) {
  const uchar16 q = load_bytes16(b + 4);
  const float2 dm = load_f16x2(b);
  acc[0] = fma(CHUNK_DOT(x, q & (uchar)15, q >> (uchar)4), via_memory(dm.x), acc[0]);
  *acc_m += (float8)(dm.y * xs[0], 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f);
}

#define W_DOT_Q8 1
ALWAYS_INLINE void block_dot_q8(const global uchar* b, const global char* xq, const global float* xd, const global float* xsum, float8* acc, float8* acc_m, float* acc_s) {
  const uchar16 q = load_bytes16(b + 4);
  const float2 dm = block_f16x2(b);
  acc[0] = fma(convert_float8(dot32_u(q & (uchar)15, q >> (uchar)4, xq)), dm.x * xd[0], acc[0]);
  *acc_s = fma(dm.y, xsum[0], *acc_s);
}
#elif defined(W_Q5_0)  // 22 bytes: d, qh[4], qs[16]; x = d * (q - 16)
#define W_CHUNKS 1
#define W_BLOCK_BYTES 22
typedef float wscales;
static inline wscales block_scales(const global uchar* b) { return load_f16(b); }
static inline void block_chunk(const global uchar* b, wscales d, int j, float16* lo, float16* hi) {
  const uint qh = load_u32_bytes(b + 2);
  const uchar16 q = load_bytes16(b + 6);
  *lo = convert_float16((convert_int16(q & (uchar)15) | (bits16(qh, 0) << 4)) - 16) * d;
  *hi = convert_float16((convert_int16(q >> (uchar)4) | (bits16(qh, 16) << 4)) - 16) * d;
}
#define W_BLOCK_DOT 1
ALWAYS_INLINE void block_dot(const global uchar* b, const global float* x, const local float* xs, float16* acc, float8* acc_m) {
  uchar16 lo, hi;
  q5_quants(b + 2, b + 6, &lo, &hi);
  acc[0] = fma(CHUNK_DOT(x, as_char16(lo) - (char)16, as_char16(hi) - (char)16), via_memory(load_f16(b)), acc[0]);
}

#define W_DOT_Q8 1
ALWAYS_INLINE void block_dot_q8(const global uchar* b, const global char* xq, const global float* xd, const global float* xsum, float8* acc, float8* acc_m, float* acc_s) {
  uchar16 lo, hi;
  q5_quants(b + 2, b + 6, &lo, &hi);
  const float d = block_f16(b);
  acc[0] = fma(convert_float8(dot32_u(lo, hi, xq)), d * xd[0], acc[0]);
  *acc_s = fma(-16.0f * d, xsum[0], *acc_s);
}
#elif defined(W_Q5_1)  // 24 bytes: d, m, qh[4], qs[16]; x = d * q + m
#define W_CHUNKS 1
#define W_BLOCK_BYTES 24
typedef float2 wscales;
static inline wscales block_scales(const global uchar* b) { return load_f16x2(b); }
static inline void block_chunk(const global uchar* b, wscales dm, int j, float16* lo, float16* hi) {
  const uint qh = load_u32_bytes(b + 4);
  const uchar16 q = load_bytes16(b + 8);
  *lo = convert_float16(convert_int16(q & (uchar)15) | (bits16(qh, 0) << 4)) * dm.x + dm.y;
  *hi = convert_float16(convert_int16(q >> (uchar)4) | (bits16(qh, 16) << 4)) * dm.x + dm.y;
}
#define W_BLOCK_DOT 1
#define W_XSUMS 1
ALWAYS_INLINE void block_dot(const global uchar* b, const global float* x, const local float* xs, float16* acc, float8* acc_m) {
  uchar16 lo, hi;
  q5_quants(b + 4, b + 8, &lo, &hi);
  const float2 dm = load_f16x2(b);
  acc[0] = fma(CHUNK_DOT(x, lo, hi), via_memory(dm.x), acc[0]);
  *acc_m += (float8)(dm.y * xs[0], 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f);
}

#define W_DOT_Q8 1
ALWAYS_INLINE void block_dot_q8(const global uchar* b, const global char* xq, const global float* xd, const global float* xsum, float8* acc, float8* acc_m, float* acc_s) {
  uchar16 lo, hi;
  q5_quants(b + 4, b + 8, &lo, &hi);
  const float2 dm = block_f16x2(b);
  acc[0] = fma(convert_float8(dot32_u(lo, hi, xq)), dm.x * xd[0], acc[0]);
  *acc_s = fma(dm.y, xsum[0], *acc_s);
}
#elif defined(W_Q8_0)  // 34 bytes: d, qs[32]; x = d * q
#define W_CHUNKS 1
#define W_BLOCK_BYTES 34
typedef float wscales;
static inline wscales block_scales(const global uchar* b) { return load_f16(b); }
static inline void block_chunk(const global uchar* b, wscales d, int j, float16* lo, float16* hi) {
  *lo = convert_float16(as_char16(load_bytes16(b + 2))) * d;
  *hi = convert_float16(as_char16(load_bytes16(b + 18))) * d;
}
#define W_BLOCK_DOT 1
ALWAYS_INLINE void block_dot(const global uchar* b, const global float* x, const local float* xs, float16* acc, float8* acc_m) {
  acc[0] = fma(CHUNK_DOT(x, as_char16(load_bytes16(b + 2)), as_char16(load_bytes16(b + 18))), via_memory(load_f16(b)), acc[0]);
}

#define W_DOT_Q8 1
ALWAYS_INLINE void block_dot_q8(const global uchar* b, const global char* xq, const global float* xd, const global float* xsum, float8* acc, float8* acc_m, float* acc_s) {
  const int8 p = dot32_s(as_char16(load_bytes16(b + 2)), as_char16(load_bytes16(b + 18)), xq);
  acc[0] = fma(convert_float8(p), block_f16(b) * xd[0], acc[0]);
}
#elif defined(W_Q4_K)  // 144 bytes: d, dmin, scales[12], qs[128]; x = d*sc*q - dmin*m
#define W_CHUNKS 8
#define W_BLOCK_BYTES 144
typedef k4_scales wscales;
static inline wscales block_scales(const global uchar* b) { return k4_block_scales(b); }
static inline void block_chunk(const global uchar* b, wscales s, int j, float16* lo, float16* hi) {
  // Chunks 2i and 2i + 1 are the low and high nibbles of qs[32i .. 32i + 31].
  const global uchar* q = b + 16 + 32 * (j >> 1);
  const uchar shift = (uchar)(4 * (j & 1));
  *lo = s.d[j] * convert_float16((load_bytes16(q) >> shift) & (uchar)15) - s.m[j];
  *hi = s.d[j] * convert_float16((load_bytes16(q + 16) >> shift) & (uchar)15) - s.m[j];
}
#define W_BLOCK_DOT 1
#define W_XSUMS 1
ALWAYS_INLINE void block_dot(const global uchar* b, const global float* x, const local float* xs, float16* acc, float8* acc_m) {
  const k4_scales s = k4_block_scales(b);
#pragma unroll
  for (int i = 0; i < 4; ++i) {  // chunks 2i, 2i + 1: low / high nibbles of qs[32i .. 32i + 31]
    const uchar16 q0 = load_bytes16(b + 16 + 32 * i), q1 = load_bytes16(b + 32 + 32 * i);
    acc[0] = fma(CHUNK_DOT(x + 64 * i, q0 & (uchar)15, q1 & (uchar)15), s.d[2 * i], acc[0]);
    acc[1] = fma(CHUNK_DOT(x + 64 * i + 32, q0 >> (uchar)4, q1 >> (uchar)4), s.d[2 * i + 1], acc[1]);
  }
  *acc_m = fma(-vload8(0, s.m), vload8(0, xs), *acc_m);
}

#define W_DOT_Q8 1
ALWAYS_INLINE void block_dot_q8(const global uchar* b, const global char* xq, const global float* xd, const global float* xsum, float8* acc, float8* acc_m, float* acc_s) {
  const k4_scales s = k4_block_scales(b);
  float dd[8];  // sub-block scale times the x chunk's
  vstore8(vload8(0, s.d) * vload8(0, xd), 0, dd);
#pragma unroll
  for (int i = 0; i < 4; ++i) {  // chunks 2i, 2i + 1: low / high nibbles of qs[32i .. 32i + 31]
    const uchar16 q0 = load_bytes16(b + 16 + 32 * i), q1 = load_bytes16(b + 32 + 32 * i);
    acc[0] = fma(convert_float8(dot32_u(q0 & (uchar)15, q1 & (uchar)15, xq + 64 * i)), dd[2 * i], acc[0]);
    acc[1] = fma(convert_float8(dot32_u(q0 >> (uchar)4, q1 >> (uchar)4, xq + 64 * i + 32)), dd[2 * i + 1], acc[1]);
  }
  *acc_m = fma(-vload8(0, s.m), vload8(0, xsum), *acc_m);
}
#elif defined(W_Q5_K)  // 176 bytes: d, dmin, scales[12], qh[32], qs[128]
#define W_CHUNKS 8
#define W_BLOCK_BYTES 176
typedef k4_scales wscales;
static inline wscales block_scales(const global uchar* b) { return k4_block_scales(b); }
static inline void block_chunk(const global uchar* b, wscales s, int j, float16* lo, float16* hi) {
  const global uchar* q = b + 48 + 32 * (j >> 1);
  const uchar shift = (uchar)(4 * (j & 1)), hb = (uchar)j;  // element l's fifth bit: bit j of qh[l]
  const uchar16 q0 = ((load_bytes16(q) >> shift) & (uchar)15) | (((load_bytes16(b + 16) >> hb) & (uchar)1) << (uchar)4);
  const uchar16 q1 = ((load_bytes16(q + 16) >> shift) & (uchar)15) | (((load_bytes16(b + 32) >> hb) & (uchar)1) << (uchar)4);
  *lo = s.d[j] * convert_float16(q0) - s.m[j];
  *hi = s.d[j] * convert_float16(q1) - s.m[j];
}
#define W_BLOCK_DOT 1
#define W_XSUMS 1
ALWAYS_INLINE void block_dot(const global uchar* b, const global float* x, const local float* xs, float16* acc, float8* acc_m) {
  const k4_scales s = k4_block_scales(b);
  const uchar16 h0 = load_bytes16(b + 16), h1 = load_bytes16(b + 32);  // bit j: chunk j's fifth bits
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uchar16 q0 = load_bytes16(b + 48 + 32 * i), q1 = load_bytes16(b + 64 + 32 * i);
    const uchar lo = (uchar)(2 * i), hi = (uchar)(2 * i + 1);
    acc[0] = fma(CHUNK_DOT(x + 64 * i, (q0 & (uchar)15) | (((h0 >> lo) & (uchar)1) << (uchar)4),
                           (q1 & (uchar)15) | (((h1 >> lo) & (uchar)1) << (uchar)4)), s.d[2 * i], acc[0]);
    acc[1] = fma(CHUNK_DOT(x + 64 * i + 32, (q0 >> (uchar)4) | (((h0 >> hi) & (uchar)1) << (uchar)4),
                           (q1 >> (uchar)4) | (((h1 >> hi) & (uchar)1) << (uchar)4)), s.d[2 * i + 1], acc[1]);
  }
  *acc_m = fma(-vload8(0, s.m), vload8(0, xs), *acc_m);
}

#define W_DOT_Q8 1
ALWAYS_INLINE void block_dot_q8(const global uchar* b, const global char* xq, const global float* xd, const global float* xsum, float8* acc, float8* acc_m, float* acc_s) {
  const k4_scales s = k4_block_scales(b);
  float dd[8];  // sub-block scale times the x chunk's
  vstore8(vload8(0, s.d) * vload8(0, xd), 0, dd);
  const uchar16 h0 = load_bytes16(b + 16), h1 = load_bytes16(b + 32);  // bit j: chunk j's fifth bits
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uchar16 q0 = load_bytes16(b + 48 + 32 * i), q1 = load_bytes16(b + 64 + 32 * i);
    const uchar lo = (uchar)(2 * i), hi = (uchar)(2 * i + 1);
    acc[0] = fma(convert_float8(dot32_u((q0 & (uchar)15) | (((h0 >> lo) & (uchar)1) << (uchar)4),
                                        (q1 & (uchar)15) | (((h1 >> lo) & (uchar)1) << (uchar)4), xq + 64 * i)),
                 dd[2 * i], acc[0]);
    acc[1] = fma(convert_float8(dot32_u((q0 >> (uchar)4) | (((h0 >> hi) & (uchar)1) << (uchar)4),
                                        (q1 >> (uchar)4) | (((h1 >> hi) & (uchar)1) << (uchar)4), xq + 64 * i + 32)),
                 dd[2 * i + 1], acc[1]);
  }
  *acc_m = fma(-vload8(0, s.m), vload8(0, xsum), *acc_m);
}
#elif defined(W_Q6_K)  // 210 bytes: ql[128], qh[64], scales[16] (int8), d; x = d*sc*(q - 32)
#define W_CHUNKS 8
#define W_BLOCK_BYTES 210
typedef struct {
  float d[16];
} wscales;
static inline wscales block_scales(const global uchar* b) {
  wscales s;
  vstore16(load_f16(b + 208) * convert_float16(as_char16(load_bytes16(b + 192))), 0, s.d);
  return s;
}
// Chunk j's quants minus 32 (elements 0..15 in q0, 16..31 in q1). Each half (128 elements) takes
// 64 bytes of ql and 32 of qh; its four chunks g = 0..3 use the low / high nibbles of ql[0..31] /
// ql[32..63] and the 2-bit fields 2g of qh.
ALWAYS_INLINE void q6k_chunk(const global uchar* b, int j, char16* q0, char16* q1) {
  const int h = j >> 2, g = j & 3;
  const global uchar* ql = b + 64 * h + 32 * (g & 1);
  const global uchar* qh = b + 128 + 32 * h;
  const uchar ls = (uchar)(4 * (g >> 1)), hs = (uchar)(2 * g);
  *q0 = as_char16(((load_bytes16(ql) >> ls) & (uchar)15) | (((load_bytes16(qh) >> hs) & (uchar)3) << (uchar)4)) - (char)32;
  *q1 = as_char16(((load_bytes16(ql + 16) >> ls) & (uchar)15) | (((load_bytes16(qh + 16) >> hs) & (uchar)3) << (uchar)4)) - (char)32;
}
static inline void block_chunk(const global uchar* b, wscales s, int j, float16* lo, float16* hi) {
  char16 q0, q1;
  q6k_chunk(b, j, &q0, &q1);
  *lo = s.d[2 * j] * convert_float16(q0);
  *hi = s.d[2 * j + 1] * convert_float16(q1);
}
#define W_BLOCK_DOT 1
ALWAYS_INLINE void block_dot(const global uchar* b, const global float* x, const local float* xs, float16* acc, float8* acc_m) {
  // Scales per 16 elements: each half-chunk's products are scaled on their own (2 FMAs per 16).
  const wscales s = block_scales(b);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    char16 q0, q1;
    q6k_chunk(b, j, &q0, &q1);
    acc[0] = fma(vload16(0, x + 32 * j) * convert_float16(q0), s.d[2 * j], acc[0]);
    acc[1] = fma(vload16(1, x + 32 * j) * convert_float16(q1), s.d[2 * j + 1], acc[1]);
  }
}

#define W_DOT_Q8 1
ALWAYS_INLINE void block_dot_q8(const global uchar* b, const global char* xq, const global float* xd, const global float* xsum, float8* acc, float8* acc_m, float* acc_s) {
  // Scales per 16 elements: lanes 0-3 of a chunk's sums are its first 16 elements, 4-7 the rest.
  const wscales s = block_scales(b);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    char16 q0, q1;
    q6k_chunk(b, j, &q0, &q1);
    const float8 scale = (float8)((float4)(s.d[2 * j]), (float4)(s.d[2 * j + 1])) * xd[j];
    acc[j & 1] = fma(convert_float8(dot32_s(q0, q1, xq + 32 * j)), scale, acc[j & 1]);
  }
}
#elif defined(W_Q2_K)  // 84 bytes: scales[16], qs[64], d, dmin; x = d*(sc&15)*q - dmin*(sc>>4)
#define W_CHUNKS 8
#define W_BLOCK_BYTES 84
typedef struct {
  float d[16], m[16];
} wscales;
static inline wscales block_scales(const global uchar* b) {
  const uchar16 sc = load_bytes16(b);
  wscales s;
  vstore16(load_f16(b + 80) * convert_float16(sc & (uchar)15), 0, s.d);
  vstore16(load_f16(b + 82) * convert_float16(sc >> (uchar)4), 0, s.m);
  return s;
}
static inline void block_chunk(const global uchar* b, wscales s, int j, float16* lo, float16* hi) {
  // Each half (128 elements) is 32 bytes of qs holding four 2-bit planes; chunk j is plane j % 4
  // of half j / 4, and its two 16-element parts have their own scale / min (sub-blocks 2j, 2j+1).
  const global uchar* q = b + 16 + 32 * (j >> 2);
  const uchar shift = (uchar)(2 * (j & 3));
  *lo = s.d[2 * j] * convert_float16((load_bytes16(q) >> shift) & (uchar)3) - s.m[2 * j];
  *hi = s.d[2 * j + 1] * convert_float16((load_bytes16(q + 16) >> shift) & (uchar)3) - s.m[2 * j + 1];
}

#elif defined(W_Q3_K)  // 110 bytes: hmask[32], qs[64], scales[12], d; x = d*(sc-32)*(q-4)
#define W_CHUNKS 8
#define W_BLOCK_BYTES 110
typedef struct {
  float d[16];
} wscales;
typedef uchar8 __attribute__((aligned(1))) uchar8_unaligned;
static inline wscales block_scales(const global uchar* b) {
  // Sub-block i's 6-bit scale: low 4 bits from the low (i < 8) or high nibble of byte i % 8,
  // top 2 bits from bits 2 (i / 4) of byte 8 + i % 4 (see q3k_scale in formats.h).
  const uchar8 low = *(const global uchar8_unaligned*)(b + 96);
  const uchar4 top = *(const global uchar4_unaligned*)(b + 104);
  const uchar16 shifts = (uchar16)(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6);
  const uchar16 sc = (uchar16)(low & (uchar)15, low >> (uchar)4) |
                     ((((uchar16)(top, top, top, top) >> shifts) & (uchar)3) << (uchar)4);
  wscales s;
  vstore16(load_f16(b + 108) * convert_float16(convert_int16(sc) - 32), 0, s.d);
  return s;
}
static inline void block_chunk(const global uchar* b, wscales s, int j, float16* lo, float16* hi) {
  // As Q2_K's planes, plus a third bit per element: bit j of hmask[k] set means q, clear q - 4.
  const global uchar* q = b + 32 + 32 * (j >> 2);
  const uchar shift = (uchar)(2 * (j & 3)), hb = (uchar)j;
  const int16 v0 = convert_int16((load_bytes16(q) >> shift) & (uchar)3) - 4 + 4 * convert_int16((load_bytes16(b) >> hb) & (uchar)1);
  const int16 v1 = convert_int16((load_bytes16(q + 16) >> shift) & (uchar)3) - 4 + 4 * convert_int16((load_bytes16(b + 16) >> hb) & (uchar)1);
  *lo = s.d[2 * j] * convert_float16(v0);
  *hi = s.d[2 * j + 1] * convert_float16(v1);
}

#elif defined(W_IQ4_XS)  // 136 bytes: d, scales_h, scales_l[4], qs[128]; x = d*(scale-32)*level[q]
#define W_CHUNKS 8
#define W_BLOCK_BYTES 136
typedef struct {
  float d[8];
} wscales;
// Sub-block j's 6-bit scale: low 4 bits in nibble j % 2 of scales_l[j / 2], top 2 in bits 2j of
// scales_h (formats.h: iq4xs_scale).
static inline wscales block_scales(const global uchar* b) {
  const float d = load_f16(b);
  const int top = *(const global ushort*)(b + 2);
  wscales s;
  for (int j = 0; j < 8; ++j) s.d[j] = d * (float)((((b[4 + j / 2] >> (4 * (j % 2))) & 15) | (((top >> (2 * j)) & 3) << 4)) - 32);
  return s;
}
static inline void block_chunk(const global uchar* b, wscales s, int j, float16* lo, float16* hi) {
  const uchar16 q = load_bytes16(b + 8 + 16 * j);
  *lo = s.d[j] * convert_float16(shuffle(IQ4_LEVELS, q & (uchar)15));
  *hi = s.d[j] * convert_float16(shuffle(IQ4_LEVELS, q >> (uchar)4));
}
#define W_DOT_Q8 1
ALWAYS_INLINE void block_dot_q8(const global uchar* b, const global char* xq, const global float* xd, const global float* xsum, float8* acc, float8* acc_m, float* acc_s) {
  const wscales s = block_scales(b);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const uchar16 q = load_bytes16(b + 8 + 16 * j);
    const int8 p = dot32_s(shuffle(IQ4_LEVELS, q & (uchar)15), shuffle(IQ4_LEVELS, q >> (uchar)4), xq + 32 * j);
    acc[j & 1] = fma(convert_float8(p), s.d[j] * xd[j], acc[j & 1]);
  }
}

#else
#error "build with one -DW_<TYPE>"
#endif

// Chunk c of a row (of any length) as floats (embedding.cl).
static inline void row_chunk(const global uchar* row, int n, int c, float16* lo, float16* hi) {
  const global uchar* blk = row + (long)(c / W_CHUNKS) * W_BLOCK_BYTES;
  block_chunk(blk, block_scales(blk), c % W_CHUNKS, lo, hi);
}
