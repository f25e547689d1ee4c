// The paged KV pool, for both kernel families' attention programs: built with one -DKV_F32 /
// -DKV_F16 / -DKV_I8 (the pool's element type). Pools are [blocks, kv_heads, block_size,
// head_dim]; i8 pools keep one f32 scale per (block, kv_head, slot) row (symmetric, amax / 127).

#if defined(KV_F32)
#define KV_T float
#elif defined(KV_F16)
#define KV_T half
#elif defined(KV_I8)
#define KV_T char
#else
#error "build with one -DKV_<TYPE>"
#endif

// Pool row of (slot, kv_head).
static inline long pool_row(int slot, int kvh, int kv_heads, int bs) {
  return ((long)(slot / bs) * kv_heads + kvh) * bs + slot % bs;
}

static inline float kv_load(const global KV_T* pool, const global float* scales, long row, int hd, int i) {
#if defined(KV_F32)
  return pool[row * hd + i];
#elif defined(KV_F16)
  return vload_half(row * hd + i, pool);
#else
  return (float)pool[row * hd + i] * scales[row];
#endif
}

// Elements 4 i4 .. 4 i4 + 3 of a pool row.
static inline float4 kv_load4(const global KV_T* pool, const global float* scales, long row, int hd, int i4) {
#if defined(KV_F32)
  return vload4(i4, pool + row * hd);
#elif defined(KV_F16)
  return vload_half4(i4, pool + row * hd);
#else
  return convert_float4(vload4(i4, pool + row * hd)) * scales[row];
#endif
}


// RoPE of one pair (a, b) by the angle with cosine c and sine s.
static inline float2 rope_rotate(float a, float b, float c, float s) { return (float2)(a * c - b * s, b * c + a * s); }
