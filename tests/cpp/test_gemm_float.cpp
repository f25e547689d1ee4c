// The float-weight prefill GEMMs (BF16: vdpbf16ps on bf16 activations; F16, F32: f32 FMAs) and the
// SIMD f16 / bf16 conversions that quantize_row / dequantize_row use: conversions bit for bit
// the scalar reference's; a GEMM within float rounding of a double reference on the inputs it
// sees, within bf16 rounding of the f32-activation product, and a row's result the same
// whatever T or its place in a tile.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/cpu_features.h"
#include "core/dtype.h"
#include "quant/quant.h"

namespace ferrum::quant {
namespace {

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

TEST(Convert, F16ToF32MatchesReferenceForEveryValue) {
  std::vector<uint16_t> h(65536 + 7);  // + 7: a masked tail
  for (size_t i = 0; i < h.size(); ++i) h[i] = uint16_t(i);
  std::vector<float> out(h.size());
  dequantize_row(DType::F16, h.data(), out.data(), int64_t(h.size()));
  for (size_t i = 0; i < h.size(); ++i) {
    const float ref = f16_to_f32(h[i]);
    if (std::isnan(ref)) EXPECT_TRUE(std::isnan(out[i])) << i;  // signaling NaNs come back quiet
    else EXPECT_EQ(bits(out[i]), bits(ref)) << i;
  }
}

TEST(Convert, F32ToBF16MatchesReference) {
  // Ties (both parities), subnormals, the largest finite values, infinities and NaNs, plus
  // random patterns; an odd count leaves a masked tail.
  std::vector<uint32_t> u = {0x00000000, 0x80000000, 0x00000001, 0x00008000, 0x00018000, 0x007fffff,
                             0x3f808000, 0x3f818000, 0x3f80ffff, 0x7f7fffff, 0xff7f8000, 0x7f800000,
                             0xff800000, 0x7fc00000, 0x7f800001, 0xffa00000, 0x7fffffff};
  std::mt19937 rng(11);
  for (int i = 0; i < 100003; ++i) u.push_back(uint32_t(rng()));
  std::vector<float> f(u.size());
  for (size_t i = 0; i < u.size(); ++i) f[i] = from_bits(u[i]);
  std::vector<uint16_t> out(u.size());
  quantize_row(DType::BF16, f.data(), out.data(), int64_t(f.size()));
  for (size_t i = 0; i < u.size(); ++i) EXPECT_EQ(out[i], f32_to_bf16(f[i])) << std::hex << u[i];
}

bool float_gemm_expected() {
  const CpuFeatures& f = cpu_features();
  return f.avx512f && f.avx512bw && f.avx512vl && f.f16c && f.avx512_bf16;
}

TEST(GemmFloat, DispatchAndActivationType) {
  EXPECT_EQ(gemm_kernel(DType::BF16) != nullptr, float_gemm_expected());
  EXPECT_EQ(gemm_kernel(DType::F16) != nullptr, float_gemm_expected());
  EXPECT_EQ(gemm_act_type(DType::BF16), DType::BF16);
  EXPECT_EQ(gemm_act_type(DType::F16), DType::F32);
  EXPECT_EQ(gemm_act_type(DType::Q4_0), dot_kernel(DType::Q4_0).act_type);
  EXPECT_EQ(gemm_kernel(DType::F32) != nullptr, float_gemm_expected());
  EXPECT_EQ(gemm_act_type(DType::F32), DType::F32);
}

std::vector<float> random_row(std::mt19937& rng, int64_t n) {
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<float> x(static_cast<size_t>(n));
  float amp = 1;
  for (int64_t i = 0; i < n; ++i) {
    if (i % 32 == 0) amp = std::exp(2 * u(rng));
    x[size_t(i)] = amp * u(rng);
  }
  return x;
}

// BF16: bf16 activations; F16, F32: f32 activations.
TEST(GemmFloat, MatchesReferenceAndIgnoresBatchAndTilePlace) {
  for (DType wt : {DType::BF16, DType::F16, DType::F32}) {
    const DotBatchFn gemm = gemm_kernel(wt);
    if (!gemm) continue;
    const DType at = gemm_act_type(wt);
    std::mt19937 rng(7);
    // n: whole 16-step chunks, a tail, an odd length; rows: two 32-row tiles plus 3.
    for (int64_t n : {576, 1536 + 34, 33}) {
      for (int64_t T : {9, 33, 128}) {
        SCOPED_TRACE(std::string(dtype_name(wt)) + " n=" + std::to_string(n) + " T=" + std::to_string(T));
        const int64_t rows = 67, ldo = rows + 3;
        const size_t w_row_bytes = dtype_bytes(wt, n), a_row_bytes = dtype_bytes(at, n);
        std::vector<uint8_t> w(w_row_bytes * size_t(rows)), a(a_row_bytes * size_t(T));
        std::vector<float> wf(size_t(rows * n)), xf(size_t(T * n)), af(size_t(T * n));  // weights, f32 / kernel activations
        for (int64_t r = 0; r < rows; ++r) {
          std::vector<float> x = random_row(rng, n);
          quantize_row(wt, x.data(), &w[r * w_row_bytes], n);
          dequantize_row(wt, &w[r * w_row_bytes], &wf[size_t(r * n)], n);
        }
        for (int64_t t = 0; t < T; ++t) {
          std::vector<float> x = random_row(rng, n);
          std::copy(x.begin(), x.end(), xf.begin() + t * n);
          quantize_row(at, x.data(), &a[t * a_row_bytes], n);
          dequantize_row(at, &a[t * a_row_bytes], &af[size_t(t * n)], n);
        }
        std::vector<float> out(size_t(T * ldo), -7.0f);
        gemm(n, w.data(), w_row_bytes, rows, a.data(), a_row_bytes, T, out.data(), ldo);
        for (int64_t t = 0; t < T; ++t) {
          for (int64_t r = 0; r < rows; ++r) {
            double ref = 0, ref_f32 = 0, sum_abs = 0, sum_abs_f32 = 0;
            for (int64_t i = 0; i < n; ++i) {
              const double wi = wf[size_t(r * n + i)];
              ref += wi * af[size_t(t * n + i)];
              ref_f32 += wi * xf[size_t(t * n + i)];
              sum_abs += std::fabs(wi * af[size_t(t * n + i)]);
              sum_abs_f32 += std::fabs(wi * xf[size_t(t * n + i)]);
            }
            const float got = out[size_t(t * ldo + r)];
            // Same inputs: only f32 accumulation rounding (one accumulator per output).
            EXPECT_NEAR(got, ref, 1e-6 * sum_abs) << "t " << t << " r " << r;
            // Against f32 activations: bf16 rounds each activation (relative error <= 2^-8);
            // twice that for the accumulation's share. (F16, F32: the same as the check above.)
            EXPECT_NEAR(got, ref_f32, std::ldexp(1.0, -7) * sum_abs_f32) << "t " << t << " r " << r;
          }
          for (int64_t r = rows; r < ldo; ++r) EXPECT_EQ(out[size_t(t * ldo + r)], -7.0f);  // untouched
        }
        // Each activation row alone, and activation rows 1.. (every row one place earlier in
        // the register blocks), and weight rows 1.. (every row one lane earlier in its tile):
        // the same bits.
        std::vector<float> again(size_t(T * ldo));
        for (int64_t t = 0; t < T; t += 7) {
          gemm(n, w.data(), w_row_bytes, rows, &a[t * a_row_bytes], a_row_bytes, 1, again.data(), ldo);
          for (int64_t r = 0; r < rows; ++r) ASSERT_EQ(again[size_t(r)], out[size_t(t * ldo + r)]) << t << " " << r;
        }
        gemm(n, w.data(), w_row_bytes, rows, &a[a_row_bytes], a_row_bytes, T - 1, again.data(), ldo);
        for (int64_t t = 1; t < T; ++t)
          for (int64_t r = 0; r < rows; ++r) ASSERT_EQ(again[size_t((t - 1) * ldo + r)], out[size_t(t * ldo + r)]);
        gemm(n, &w[w_row_bytes], w_row_bytes, rows - 1, a.data(), a_row_bytes, T, again.data(), ldo);
        for (int64_t t = 0; t < T; ++t)
          for (int64_t r = 1; r < rows; ++r) ASSERT_EQ(again[size_t(t * ldo + r - 1)], out[size_t(t * ldo + r)]);
      }
    }
  }
}

}  // namespace
}  // namespace ferrum::quant
