// The gpu family's LoRA shrink (after gpu_common.cl and lora.cl, whose lora_expand it shares):
// t[row, j] = x[row, :] . A[j', :], a lane group per (row, j) with GEMV_GROUPS of them per
// work-group; lane l sums elements l, l + LANES, ... (a group's loads are contiguous), then the
// lane tree. Each (row, j)'s sum is formed the same whichever pairs share its work-group.
kernel void gpu_lora_shrink(global const float* x, long x_off, global const int* row_slots, long rs_off,
                            global const int* table, long table_off, global const uchar* w, long w_off,
                            global float* t, long t_off, int T, int K, int site, int site_rank,
                            local float* scratch) {
  const int lid = (int)get_local_id(0), lane = lid % LANES;
  const long pair = (long)get_group_id(0) * GEMV_GROUPS + lid / LANES;
  const int row = (int)(pair / site_rank), j = (int)(pair % site_rank);
  table += table_off;
  global const int* up = pair < (long)T * site_rank ? lora_update_of_rank(table, row_slots[rs_off + row], site, j) : 0;
  float s = 0.0f;
  if (up) {
    global const float* xr = x + x_off + (long)row * K;
    const int ad = up[7] & 0xff;
    global const uchar* a = w + w_off + up[0] + (j - up[5]) * lora_row_bytes(ad, K);
    for (int k = lane; k < K; k += LANES) s = fma(xr[k], lora_value(a, ad, k), s);
  }
  lane_sums(&s, 1, scratch);  // every work-item reaches its barriers
  if (up && lane == 0) t[t_off + (long)row * site_rank + j] = s;
}
