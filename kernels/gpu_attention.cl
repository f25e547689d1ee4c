// RoPE + KV write and paged attention for the gpu family (after gpu_common.cl and kv_pool.cl).
// Built with -DKV_<TYPE>, -DMAX_HEAD_DIM and -DMAX_GROUP (query heads per work-group). Semantics
// are the cpu family's (attention.cl); the work is spread differently:
//   qkv_rope_cache  a work-group of ATTN_WG per (token, head): the head's elements spread over the
//                   work-items (QK-norm's sum and the int8 row maximum as tree reductions).
//   attention_split a work-group per (token, KV head, group of up to MAX_GROUP of its query heads,
//                   split of the visible positions): the query heads share every K / V row the
//                   work-group loads. Positions go ATTN_WG at a time: a work-item per position
//                   for the scores, a softmax update per head (running maximum m, sum l), a
//                   work-item per head dimension for the V sum. With one split per token (long
//                   prompts) it writes the output; with several (decodes: flash-decoding, one
//                   split per ATTN_SPLIT positions, so a short batch still fills the device) it
//                   writes each split's (acc, m, l) for attention_combine.
// The kernel that writes the output can also write it quantized to 8 bits for the o projection
// (quantize != 0, head_dim % 32 == 0: each head's chunks of the row [H * head_dim]; quantize.cl).
#pragma OPENCL FP_CONTRACT OFF

#define HEAD_PER_ITEM ((MAX_HEAD_DIM + ATTN_WG - 1) / ATTN_WG)  // head dimensions per work-item

// Quantizes heads [h0, h0 + nh) of token t's output row, after the work-group wrote them (a barrier
// every work-item reaches, whatever nh).
static inline void quantize_heads(global float* out, int t, int h0, int nh, int H, int hd, global char* xq, int lid) {
  barrier(CLK_GLOBAL_MEM_FENCE);
  const int per_head = hd / 32, chunks = H * per_head;
  global char* row = (global char*)xq_row(xq, t, H * hd);
  for (int c = h0 * per_head + lid; c < (h0 + nh) * per_head; c += ATTN_WG)
    quantize_chunk(out + ((long)t * H) * hd + 32 * c, row, c, chunks);
}

kernel __attribute__((reqd_work_group_size(ATTN_WG, 1, 1)))
void qkv_rope_cache(const global float* qkv, long qkv_off, const global float* q_norm, long qn_off,
                    const global float* k_norm, long kn_off, int has_norm, float eps,
                    const global float* cos_t, long cos_off, const global float* sin_t, long sin_off,
                    int rot_half, int max_pos, int interleaved, const global int* token_pos, long pos_off,
                    const global int* slot_mapping, long slot_off, int T, int H, int KV, int hd,
                    global float* q_out, long q_off, global KV_T* k_pool, long k_off, global KV_T* v_pool,
                    long v_off, global float* k_scale, long ks_off, global float* v_scale, long vs_off,
                    int block_size, int total_slots) {
  local float v[MAX_HEAD_DIM];
  local float scratch[ATTN_WG];
  const int heads_all = H + 2 * KV, lid = (int)get_local_id(0);
  const int t = (int)get_group_id(0) / heads_all, h = (int)get_group_id(0) % heads_all;
  const bool is_q = h < H, is_k = !is_q && h < H + KV;
  const int slot = is_q ? 0 : slot_mapping[slot_off + t];
  const bool skip = !is_q && (slot < 0 || slot >= total_slots);  // a padding token's K / V
  // Every work-item reaches every barrier (the reductions too), whatever the head.
  const global float* src = qkv + qkv_off + ((long)t * heads_all + h) * hd;
  for (int i = lid; i < hd; i += ATTN_WG) v[i] = src[i];

  const bool norm = has_norm && (is_q || is_k) && !skip;
  float ss = 0.0f;
  for (int i = lid; norm && i < hd; i += ATTN_WG) ss = fma(v[i], v[i], ss);
  const float inv_rms = 1.0f / sqrt(group_sum(ss, scratch) / (float)hd + eps);
  const global float* wn = is_q ? q_norm + qn_off : k_norm + kn_off;
  for (int i = lid; norm && i < hd; i += ATTN_WG) v[i] = v[i] * inv_rms * wn[i];
  barrier(CLK_LOCAL_MEM_FENCE);  // RoPE pairs cross work-items

  const int pos = token_pos[pos_off + t];
  if ((is_q || is_k) && !skip && pos >= 0 && pos < max_pos) {
    const global float* c = cos_t + cos_off + (long)pos * rot_half;
    const global float* s = sin_t + sin_off + (long)pos * rot_half;
    for (int i = lid; i < rot_half; i += ATTN_WG) {
      const int ia = interleaved ? 2 * i : i, ib = interleaved ? 2 * i + 1 : i + rot_half;
      const float2 r = rope_rotate(v[ia], v[ib], c[i], s[i]);
      v[ia] = r.x;
      v[ib] = r.y;
    }
  }
  barrier(CLK_LOCAL_MEM_FENCE);

  if (is_q) {
    global float* dst = q_out + q_off + ((long)t * H + h) * hd;
    for (int i = lid; i < hd; i += ATTN_WG) dst[i] = v[i];
  }
  const long row = skip || is_q ? 0 : pool_row(slot, is_k ? h - H : h - H - KV, KV, block_size);
  global KV_T* pool = (is_k ? k_pool + k_off : v_pool + v_off) + row * hd;
  const bool store = !is_q && !skip;
#if defined(KV_F32)
  for (int i = lid; store && i < hd; i += ATTN_WG) pool[i] = v[i];
#elif defined(KV_F16)
  for (int i = lid; store && i < hd; i += ATTN_WG) vstore_half_rte(v[i], i, pool);
#else
  float amax = 0.0f;
  for (int i = lid; i < hd; i += ATTN_WG) amax = fmax(amax, fabs(v[i]));
  const float scale = group_max(amax, scratch) / 127.0f;
  const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
  for (int i = lid; store && i < hd; i += ATTN_WG) pool[i] = convert_char_sat_rte(v[i] * inv);
  if (store && lid == 0) (is_k ? k_scale + ks_off : v_scale + vs_off)[row] = scale;
#endif
}

// Positions [j0, j1) visible to a token at pos in split `split` of `splits` (all of them when
// splits == 1).
static inline int2 split_range(int pos, int window, int split, int splits) {
  const int first = window > 0 ? max(0, pos - window + 1) : 0;
  if (splits == 1) return (int2)(first, pos + 1);
  return (int2)(max(first, split * ATTN_SPLIT), min(pos + 1, (split + 1) * ATTN_SPLIT));
}

// out / part: see the file comment. part [T, H, splits, hd + 2]: acc[hd], m, l per split.
kernel __attribute__((reqd_work_group_size(ATTN_WG, 1, 1)))
void attention_split(const global float* q, long q_off, global float* out, long out_off,
                     const global int* token_seq, long seq_off, const global int* token_pos, long pos_off,
                     const global int* block_tables, long bt_off, int max_blocks,
                     const global KV_T* k_pool, long k_off, const global KV_T* v_pool, long v_off,
                     const global float* k_scale, long ks_off, const global float* v_scale, long vs_off,
                     int num_blocks, int block_size, int T, int H, int KV, int hd, float scale, int window,
                     int splits, global float* part, long part_off, global char* xq, long xq_off, int quantize) {
  local float qs[MAX_GROUP * MAX_HEAD_DIM];
  local float p[MAX_GROUP * ATTN_WG];  // the tile's scores, then its probabilities, per head
  local float stat[3 * MAX_GROUP];     // per head: running max, running sum, this tile's rescale
  const int lid = (int)get_local_id(0), G = H / KV, head_groups = (G + MAX_GROUP - 1) / MAX_GROUP;
  int g = (int)get_group_id(0);
  const int split = g % splits;
  g /= splits;
  const int hg = g % head_groups;
  g /= head_groups;
  const int kvh = g % KV, t = g / KV;
  const int h0 = kvh * G + hg * MAX_GROUP, nh = min(MAX_GROUP, G - hg * MAX_GROUP);
  // A padding token, or a split past the token's position, has no positions: the work-group
  // still reaches every barrier (no early return before one).
  const int pos = token_pos[pos_off + t];
  const bool real = pos >= 0 && pos < max_blocks * block_size;
  const int2 range = real ? split_range(pos, window, split, splits) : (int2)(0, 0);
  const bool active = range.x < range.y;
  const global int* table = block_tables + bt_off + (long)token_seq[seq_off + t] * max_blocks;
  k_pool += k_off;
  v_pool += v_off;
  k_scale += ks_off;
  v_scale += vs_off;

  for (int e = lid; e < nh * hd; e += ATTN_WG) qs[e] = q[q_off + ((long)t * H + h0) * hd + e];
  if (lid < nh) {
    stat[lid] = -INFINITY;
    stat[MAX_GROUP + lid] = 0.0f;
  }
  float acc[MAX_GROUP][HEAD_PER_ITEM];
#pragma unroll
  for (int i = 0; i < MAX_GROUP; ++i)
#pragma unroll
    for (int k = 0; k < HEAD_PER_ITEM; ++k) acc[i][k] = 0.0f;
  barrier(CLK_LOCAL_MEM_FENCE);

  const int hd4 = hd / 4;
  for (int j0 = range.x; j0 < range.y; j0 += ATTN_WG) {
    const int n = min(ATTN_WG, range.y - j0);
    // Scores: a work-item per position, its K row read once for all heads.
    {
      const int j = j0 + lid;
      const int b = lid < n ? table[j / block_size] : -1;
      float s[MAX_GROUP];
#pragma unroll
      for (int i = 0; i < MAX_GROUP; ++i) s[i] = 0.0f;
      if (b >= 0 && b < num_blocks) {
        const long row = ((long)b * KV + kvh) * block_size + j % block_size;
        for (int d4 = 0; d4 < hd4; ++d4) {
          const float4 k4 = kv_load4(k_pool, k_scale, row, hd, d4);
#pragma unroll
          for (int i = 0; i < MAX_GROUP; ++i)
            if (i < nh) s[i] = fma(k4.w, qs[i * hd + 4 * d4 + 3], fma(k4.z, qs[i * hd + 4 * d4 + 2],
                               fma(k4.y, qs[i * hd + 4 * d4 + 1], fma(k4.x, qs[i * hd + 4 * d4], s[i]))));
        }
        for (int d = 4 * hd4; d < hd; ++d) {
          const float kd = kv_load(k_pool, k_scale, row, hd, d);
#pragma unroll
          for (int i = 0; i < MAX_GROUP; ++i)
            if (i < nh) s[i] = fma(kd, qs[i * hd + d], s[i]);
        }
      }
      const bool valid = b >= 0 && b < num_blocks;  // unmapped blocks contribute nothing
#pragma unroll
      for (int i = 0; i < MAX_GROUP; ++i)
        if (i < nh) p[i * ATTN_WG + lid] = valid ? s[i] * scale : -INFINITY;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    // Softmax update: a work-item per head over the tile's scores.
    if (lid < nh) {
      local float* ph = p + lid * ATTN_WG;
      const float m_old = stat[lid];
      float m = m_old;
      for (int j = 0; j < n; ++j) m = fmax(m, ph[j]);
      float sum = 0.0f;
      for (int j = 0; j < n; ++j) {
        const float e = ph[j] == -INFINITY ? 0.0f : exp(ph[j] - m);
        ph[j] = e;
        sum += e;
      }
      const float corr = m_old == -INFINITY ? 0.0f : exp(m_old - m);
      stat[lid] = m;
      stat[MAX_GROUP + lid] = stat[MAX_GROUP + lid] * corr + sum;
      stat[2 * MAX_GROUP + lid] = corr;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    // V: a work-item per head dimension; each V row loaded once for all heads.
#pragma unroll
    for (int i = 0; i < MAX_GROUP; ++i)
#pragma unroll
      for (int k = 0; k < HEAD_PER_ITEM; ++k) acc[i][k] *= i < nh ? stat[2 * MAX_GROUP + i] : 1.0f;
    for (int jj = 0; jj < n; ++jj) {
      const int j = j0 + jj, b = table[j / block_size];
      if (b < 0 || b >= num_blocks) continue;
      const long row = ((long)b * KV + kvh) * block_size + j % block_size;
#pragma unroll
      for (int k = 0; k < HEAD_PER_ITEM; ++k) {
        const int d = lid + k * ATTN_WG;
        if (d >= hd) break;
        const float vd = kv_load(v_pool, v_scale, row, hd, d);
#pragma unroll
        for (int i = 0; i < MAX_GROUP; ++i)
          if (i < nh) acc[i][k] = fma(p[i * ATTN_WG + jj], vd, acc[i][k]);
      }
    }
    barrier(CLK_LOCAL_MEM_FENCE);  // p is rewritten by the next tile
  }

#pragma unroll
  for (int i = 0; i < MAX_GROUP; ++i) {
    if (i >= nh || !active) break;
    const long head = (long)t * H + h0 + i;
    const float l = stat[MAX_GROUP + i];
    if (splits == 1) {
      const float inv = l > 0.0f ? 1.0f / l : 0.0f;
#pragma unroll
      for (int k = 0; k < HEAD_PER_ITEM; ++k) {
        const int d = lid + k * ATTN_WG;
        if (d < hd) out[out_off + head * hd + d] = acc[i][k] * inv;
      }
    } else {
      global float* ps = part + part_off + (head * splits + split) * (hd + 2);
#pragma unroll
      for (int k = 0; k < HEAD_PER_ITEM; ++k) {
        const int d = lid + k * ATTN_WG;
        if (d < hd) ps[d] = acc[i][k];
      }
      if (lid == 0) {
        ps[hd] = stat[i];
        ps[hd + 1] = l;
      }
    }
  }
  // (splits == 1; padding rows too, as a quantize_q8_rows launch would; every work-item, every time)
  quantize_heads(out + out_off, t, h0, quantize ? nh : 0, H, hd, xq + xq_off, lid);
}

// out[t, h] = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s over the splits the token's
// positions reach (M the largest m_s), in split order. A work-group per (token, head).
kernel __attribute__((reqd_work_group_size(ATTN_WG, 1, 1)))
void attention_combine(const global float* part, long part_off, global float* out, long out_off,
                       const global int* token_pos, long pos_off, int T, int H, int hd, int window,
                       int splits, int max_positions, global char* xq, long xq_off, int quantize) {
  const int lid = (int)get_local_id(0), head = (int)get_group_id(0), t = head / H;
  const int pos = token_pos[pos_off + t];
  const bool real = pos >= 0 && pos < max_positions;  // padding tokens: nothing, but every barrier
  const global float* ps = part + part_off + (long)head * splits * (hd + 2);
  const int first = real ? (window > 0 ? max(0, pos - window + 1) : 0) / ATTN_SPLIT : 0, last = real ? pos / ATTN_SPLIT : -1;
  float M = -INFINITY;
  for (int s = first; s <= last; ++s) M = fmax(M, ps[s * (hd + 2) + hd]);
  float L = 0.0f;
  for (int s = first; s <= last; ++s) {
    const float m = ps[s * (hd + 2) + hd];
    if (m != -INFINITY) L = fma(exp(m - M), ps[s * (hd + 2) + hd + 1], L);
  }
  const float inv = L > 0.0f ? 1.0f / L : 0.0f;
  for (int d = lid; real && d < hd; d += ATTN_WG) {
    float o = 0.0f;
    for (int s = first; s <= last; ++s) {
      const float m = ps[s * (hd + 2) + hd];
      if (m != -INFINITY) o = fma(exp(m - M), ps[s * (hd + 2) + d], o);
    }
    out[out_off + (long)head * hd + d] = o * inv;
  }
  quantize_heads(out + out_off, t, head % H, quantize ? 1 : 0, H, hd, xq + xq_off, lid);
}
