// RoPE, the paged KV write and paged attention (cpu family; after kv_pool.cl). Built with one
// -DKV_F32 / -DKV_F16 / -DKV_I8 (the pool's element type) and -DMAX_HEAD_DIM. Offsets are in
// elements. Semantics follow the CPU backend (cpp/backend/cpu/cpu_kernels.cpp).

static inline void kv_store(global KV_T* pool, global float* scales, long row, int hd, const float* v) {
#if defined(KV_F32)
  for (int i = 0; i < hd; ++i) pool[row * hd + i] = v[i];
#elif defined(KV_F16)
  for (int i = 0; i < hd; ++i) vstore_half_rte(v[i], row * hd + i, pool);
#else
  // Symmetric int8, one scale per row: the row's largest magnitude maps to 127.
  float amax = 0.0f;
  for (int i = 0; i < hd; ++i) amax = fmax(amax, fabs(v[i]));
  const float scale = amax / 127.0f;
  const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
  for (int i = 0; i < hd; ++i) pool[row * hd + i] = convert_char_sat_rte(v[i] * inv);
  scales[row] = scale;
#endif
}

static inline void rms_norm_head(float* v, const global float* w, float eps, int hd) {
  float ss = 0.0f;
  for (int i = 0; i < hd; ++i) ss = fma(v[i], v[i], ss);
  const float inv = 1.0f / sqrt(ss / (float)hd + eps);
  for (int i = 0; i < hd; ++i) v[i] = v[i] * inv * w[i];
}

// Rotates one head in place: pairs (i, i + rot_half) or (2i, 2i + 1).
static inline void rope_head(float* v, const global float* c, const global float* s, int rot_half,
                      int interleaved) {
  const int stride = interleaved ? 1 : rot_half, step = interleaved ? 2 : 1;
  for (int i = 0; i < rot_half; ++i) {
    const int ia = i * step, ib = ia + stride;
    const float2 r = rope_rotate(v[ia], v[ib], c[i], s[i]);
    v[ia] = r.x;
    v[ib] = r.y;
  }
}

// qkv [T, (H + 2 KV) * hd] -> q_out [T, H, hd] and the pool rows at slot_mapping[t]; optional
// per-head RMS norm of q and k (QK-norm), RoPE of q and k. One work-item per (token, head).
kernel void qkv_to_cache(const global float* qkv, long qkv_off, const global float* q_norm,
                         long qn_off, const global float* k_norm, long kn_off, int has_norm,
                         float eps, const global float* cos_t, long cos_off,
                         const global float* sin_t, long sin_off, int rot_half, int max_pos,
                         int interleaved, const global int* token_pos, long pos_off,
                         const global int* slot_mapping, long slot_off, int T, int H, int KV,
                         int hd, global float* q_out, long q_off, global KV_T* k_pool, long k_off,
                         global KV_T* v_pool, long v_off, global float* k_scale, long ks_off,
                         global float* v_scale, long vs_off, int block_size, int total_slots) {
  const int heads_all = H + 2 * KV;
  const int gid = (int)get_global_id(0);
  if (gid >= T * heads_all) return;
  const int t = gid / heads_all, h = gid % heads_all;
  const global float* src = qkv + qkv_off + (long)t * heads_all * hd + (long)h * hd;
  const int pos = token_pos[pos_off + t];
  const bool rotate = pos >= 0 && pos < max_pos;
  const global float* c = cos_t + cos_off + (long)(rotate ? pos : 0) * rot_half;
  const global float* s = sin_t + sin_off + (long)(rotate ? pos : 0) * rot_half;
  float v[MAX_HEAD_DIM];
  for (int i = 0; i < hd; ++i) v[i] = src[i];

  if (h < H) {  // query head -> q_out
    if (has_norm) rms_norm_head(v, q_norm + qn_off, eps, hd);
    if (rotate) rope_head(v, c, s, rot_half, interleaved);
    global float* dst = q_out + q_off + ((long)t * H + h) * hd;
    for (int i = 0; i < hd; ++i) dst[i] = v[i];
    return;
  }
  const int slot = slot_mapping[slot_off + t];
  if (slot < 0 || slot >= total_slots) return;  // padding token
  if (h < H + KV) {  // key head: norm, rotate, store
    if (has_norm) rms_norm_head(v, k_norm + kn_off, eps, hd);
    if (rotate) rope_head(v, c, s, rot_half, interleaved);
    kv_store(k_pool + k_off, k_scale + ks_off, pool_row(slot, h - H, KV, block_size), hd, v);
  } else {
    kv_store(v_pool + v_off, v_scale + vs_off, pool_row(slot, h - H - KV, KV, block_size), hd, v);
  }
}

// Causal GQA attention of q [T, H, hd] over the pool: the token at position p of sequence
// token_seq[t] sees positions max(0, p - window + 1) .. p through its block table. One
// work-item per (token, head), one pass with a running maximum (online softmax).
kernel void paged_attention(const global float* q, long q_off, global float* out, long out_off,
                            const global int* token_seq, long seq_off, const global int* token_pos,
                            long pos_off, const global int* block_tables, long bt_off,
                            int max_blocks, const global KV_T* k_pool, long k_off,
                            const global KV_T* v_pool, long v_off, const global float* k_scale,
                            long ks_off, const global float* v_scale, long vs_off, int num_blocks,
                            int block_size, int T, int H, int KV, int hd, float scale, int window) {
  const int gid = (int)get_global_id(0);
  if (gid >= T * H) return;
  const int t = gid / H, h = gid % H;
  const int pos = token_pos[pos_off + t];
  if (pos < 0 || pos >= max_blocks * block_size) return;  // padding token
  const int kvh = h / (H / KV);
  const int first = window > 0 ? max(0, pos - window + 1) : 0;
  const global int* table = block_tables + bt_off + (long)token_seq[seq_off + t] * max_blocks;
  k_pool += k_off;
  v_pool += v_off;
  k_scale += ks_off;
  v_scale += vs_off;

  // head_dim in float4 steps plus a 2-element tail (head_dim is even).
  const int hd4 = hd / 4;
  float qv[MAX_HEAD_DIM], acc[MAX_HEAD_DIM];
  const global float* qt = q + q_off + (long)gid * hd;
  for (int i = 0; i < hd; ++i) {
    qv[i] = qt[i];
    acc[i] = 0.0f;
  }
  float m = -INFINITY, l = 0.0f;
  for (int j = first; j <= pos; ++j) {
    const int b = table[j / block_size];
    if (b < 0 || b >= num_blocks) continue;  // unmapped block: contributes nothing
    const long row = ((long)b * KV + kvh) * block_size + j % block_size;
    float4 d4 = (float4)(0.0f);
    for (int i = 0; i < hd4; ++i) d4 = fma(vload4(i, qv), kv_load4(k_pool, k_scale, row, hd, i), d4);
    float dot = (d4.x + d4.y) + (d4.z + d4.w);
    for (int i = 4 * hd4; i < hd; ++i) dot = fma(qv[i], kv_load(k_pool, k_scale, row, hd, i), dot);
    const float sc = dot * scale;
    if (sc > m) {  // new maximum: rescale what was accumulated so far
      const float corr = exp(m - sc);
      l *= corr;
      for (int i = 0; i < hd; ++i) acc[i] *= corr;
      m = sc;
    }
    const float p = exp(sc - m);
    l += p;
    for (int i = 0; i < hd4; ++i) vstore4(fma((float4)(p), kv_load4(v_pool, v_scale, row, hd, i), vload4(i, acc)), i, acc);
    for (int i = 4 * hd4; i < hd; ++i) acc[i] = fma(p, kv_load(v_pool, v_scale, row, hd, i), acc[i]);
  }
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
  global float* o = out + out_off + (long)gid * hd;
  for (int i = 0; i < hd; ++i) o[i] = acc[i] * inv;
}
