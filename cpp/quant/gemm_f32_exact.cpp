// An f32 GEMM whose every result is one dot product in one fixed order (eight running sums over
// k mod 8, then summed pairwise), whatever the number of activation rows and a row's place
// among them: scores computed with it do not depend on how a sequence is chunked or batched.
// Where the CPU has ferrum's AVX-512 f32 GEMM (which has the same property) that runs instead,
// faster; the portable form is written with GCC vector types, so it compiles to whatever vector
// width the build targets.
#include "quant/quant.h"

namespace ferrum::quant {

namespace {
typedef float F8 __attribute__((vector_size(32)));

F8 load8(const float* p) {
  F8 v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

float sum8(F8 v) { return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7])); }

// Weight rows [r, r + R) times activation row x: R results, each in the order above.
template <int R>
void dot_block(int64_t K, const float* w, int64_t w_stride, const float* x, float* out) {
  F8 acc[R] = {};
  const int64_t k8 = K / 8 * 8;
  for (int64_t k = 0; k < k8; k += 8) {
    const F8 xv = load8(x + k);
    for (int i = 0; i < R; ++i) acc[i] += load8(w + i * w_stride + k) * xv;
  }
  for (int i = 0; i < R; ++i) {
    float s = sum8(acc[i]);
    for (int64_t k = k8; k < K; ++k) s += w[i * w_stride + k] * x[k];
    out[i] = s;
  }
}
}  // namespace

void gemm_f32_exact(int64_t K, const float* w, int64_t rows, const float* x, int64_t T, float* out, int64_t ldo) {
  static const DotBatchFn avx512 = gemm_kernel(DType::F32, WeightLayout::Plain);
  if (avx512) {
    avx512(K, w, size_t(K) * 4, rows, x, size_t(K) * 4, T, out, ldo);
    return;
  }
  constexpr int kRows = 4;  // weight rows a pass keeps in registers for one activation row
  int64_t r = 0;
  for (; r + kRows <= rows; r += kRows)
    for (int64_t t = 0; t < T; ++t) dot_block<kRows>(K, w + r * K, K, x + t * K, out + t * ldo + r);
  for (; r < rows; ++r)
    for (int64_t t = 0; t < T; ++t) dot_block<1>(K, w + r * K, K, x + t * K, out + t * ldo + r);
}

}  // namespace ferrum::quant
