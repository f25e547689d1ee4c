// Helpers of the gpu kernel family (after common.cl). Its sizes are -D defines chosen per device in
// cpp/backend/opencl/cl_family.cpp (GpuTuning):
//   LANES        work-items sharing one weight row in a GEMV, consecutive local ids (a warp on
//                NVIDIA); a power of two
//   GEMV_GROUPS  lane groups per GEMV work-group; GEMV_ROWS weight rows per lane group;
//                GEMV_TOKENS tokens per pass of the batched GEMV
//   GEMM_TM / GEMM_TN / GEMM_TK  GEMM work-group tile (tokens x weight rows) and K step;
//                GEMM_WM / GEMM_WN the register block of one work-item
//   ATTN_WG      attention work-group size (KV positions per tile); MAX_GROUP query heads per
//                attention work-group; ATTN_SPLIT KV positions per split of the decode attention
//   ROW_WG       work-group of the row kernels (norms, QK-norm + RoPE + KV write)
//   NV_ASM       NVIDIA only: warp shuffles and dp4a as inline PTX. The portable forms beside
//                them give the same bits (the same sums in the same association), and the
//                backend rebuilds without NV_ASM if a driver rejects it.

#define GEMV_WG (LANES * GEMV_GROUPS)

#ifdef NV_ASM
static inline float shfl_xor(float v, int mask) {
  float r;
  asm volatile("shfl.sync.bfly.b32 %0, %1, %2, 0x1f, 0xffffffff;" : "=f"(r) : "f"(v), "r"(mask));
  return r;
}
static inline int dp4a(int a, int b, int c) {
  int r;
  asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}
#endif

// The sum over the 16 bytes of a and b (each 4 per word, signed) of a[i] * b[i]: exact
// (|a|, |b| <= 128).
static inline int idot16(uint4 a, uint4 b) {
#ifdef NV_ASM
  return dp4a(a.w, b.w, dp4a(a.z, b.z, dp4a(a.y, b.y, dp4a(a.x, b.x, 0))));
#else
  const short16 p = convert_short16(as_char16(a)) * convert_short16(as_char16(b));  // |p| <= 2^14
  const int8 s = convert_int8(p.lo) + convert_int8(p.hi);
  const int4 t = s.lo + s.hi;
  return (t.x + t.y) + (t.z + t.w);
#endif
}

// The sum of the 16 signed bytes of a.
static inline int isum16(uint4 a) {
#ifdef NV_ASM
  const int ones = 0x01010101;
  return dp4a(a.w, ones, dp4a(a.z, ones, dp4a(a.y, ones, dp4a(a.x, ones, 0))));
#else
  const short8 s = convert_short8(as_char8(a.lo)) + convert_short8(as_char8(a.hi));
  const short4 t = s.lo + s.hi;
  return (int)(t.x + t.y) + (int)(t.z + t.w);
#endif
}

static inline float fdot16(float16 a, float16 b) {
  return (dot(a.s0123, b.s0123) + dot(a.s4567, b.s4567)) + (dot(a.s89ab, b.s89ab) + dot(a.scdef, b.scdef));
}

// v[0, n) are this work-item's partial sums; on return, lane 0 of every lane group (LANES
// consecutive local ids) holds the group's totals in v. Lanes l and l + s are added for s =
// LANES / 2 .. 1 in both forms (same association, same bits). Every work-item of the work-group
// must call it (barriers); scratch: n * local size floats.
static inline void lane_sums(float* v, const int n, local float* scratch) {
#ifdef NV_ASM
  if (LANES <= 32) {
    for (int e = 0; e < n; ++e)
      for (int s = LANES / 2; s > 0; s >>= 1) v[e] += shfl_xor(v[e], s);
    return;
  }
#endif
  const int lid = (int)get_local_id(0), lane = lid % LANES, wg = (int)get_local_size(0);
  for (int e = 0; e < n; ++e) scratch[e * wg + lid] = v[e];
  for (int s = LANES / 2; s > 0; s >>= 1) {
    barrier(CLK_LOCAL_MEM_FENCE);
    if (lane < s)
      for (int e = 0; e < n; ++e) scratch[e * wg + lid] += scratch[e * wg + lid + s];
  }
  barrier(CLK_LOCAL_MEM_FENCE);
  for (int e = 0; e < n; ++e) v[e] = scratch[e * wg + lid];
}

// The sum (or max) of v over the whole work-group, returned to every work-item: a tree over
// local memory (scratch: local size floats, a power of two). Every work-item must call it.
static inline float group_sum(float v, local float* scratch) {
  const int lid = (int)get_local_id(0), wg = (int)get_local_size(0);
  scratch[lid] = v;
  for (int s = wg / 2; s > 0; s >>= 1) {
    barrier(CLK_LOCAL_MEM_FENCE);
    if (lid < s) scratch[lid] += scratch[lid + s];
  }
  barrier(CLK_LOCAL_MEM_FENCE);
  const float r = scratch[0];
  barrier(CLK_LOCAL_MEM_FENCE);  // scratch is free again for the caller's next reduction
  return r;
}

static inline float group_max(float v, local float* scratch) {
  const int lid = (int)get_local_id(0), wg = (int)get_local_size(0);
  scratch[lid] = v;
  for (int s = wg / 2; s > 0; s >>= 1) {
    barrier(CLK_LOCAL_MEM_FENCE);
    if (lid < s) scratch[lid] = fmax(scratch[lid], scratch[lid + s]);
  }
  barrier(CLK_LOCAL_MEM_FENCE);
  const float r = scratch[0];
  barrier(CLK_LOCAL_MEM_FENCE);
  return r;
}
