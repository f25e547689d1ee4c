// Row kernels of the gpu family (after gpu_common.cl and quantize.cl): a work-group of ROW_WG
// work-items per row (the cpu family's take a work-item per row). Each can also write its output
// quantized to 8 bits for the matmul that reads it (quantize != 0: xq rows as quantize.cl), which
// saves that matmul a launch and a pass over x: the backend turns this on when it records the
// matmul (cpp/backend/opencl/cl_stream.h: QuantizableOutput).
#pragma OPENCL FP_CONTRACT OFF

// out = rms_norm(v) * w per row, v = x or, with has_res, res += x (add_rms_norm). out may alias x.
kernel __attribute__((reqd_work_group_size(ROW_WG, 1, 1)))
void norm_rows(global float* res, long res_off, int has_res, const global float* x, long x_off,
               const global float* w, long w_off, float eps, global float* out, long out_off, int d,
               global char* xq, long xq_off, int quantize) {
  local float scratch[ROW_WG];
  const int r = (int)get_group_id(0), lid = (int)get_local_id(0);
  res += res_off + (long)r * d;
  x += x_off + (long)r * d;
  w += w_off;
  out += out_off + (long)r * d;
  float ss = 0.0f;
  for (int i = lid; i < d; i += ROW_WG) {
    float v = x[i];
    if (has_res) {
      v = res[i] + v;
      res[i] = v;
    }
    ss = fma(v, v, ss);
  }
  const float inv = 1.0f / sqrt(group_sum(ss, scratch) / (float)d + eps);
  for (int i = lid; i < d; i += ROW_WG) out[i] = (has_res ? res[i] : x[i]) * inv * w[i];
  barrier(CLK_GLOBAL_MEM_FENCE);  // quantize: the chunks read back what the work-group wrote
  for (int c = lid; quantize && c < d / 32; c += ROW_WG)  // d % 32 == 0
    quantize_chunk(out + 32 * c, (global char*)xq_row(xq + xq_off, r, d), c, d / 32);
}

// out[r, i] = silu(gu[r, i]) * gu[r, n + i]; one work-item per 32 elements of a row, which it
// quantizes itself when asked (n % 32 == 0).
kernel void swiglu_rows(const global float* gu, long gu_off, global float* out, long out_off, int rows, int n,
                        global char* xq, long xq_off, int quantize) {
  const int chunks = (n + 31) / 32, gid = (int)get_global_id(0);
  if (gid >= rows * chunks) return;
  const int r = gid / chunks, c = gid % chunks;
  const global float* g = gu + gu_off + (long)r * 2 * n;
  global float* o = out + out_off + (long)r * n;
  for (int i = 32 * c; i < min(32 * c + 32, n); ++i) o[i] = g[i] / (1.0f + exp(-g[i])) * g[n + i];
  if (quantize) quantize_chunk(o + 32 * c, (global char*)xq_row(xq + xq_off, r, n), c, chunks);
}
