// The R16 layout (quant/repack.h): a lossless rearrangement of Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 /
// Q2_K .. Q6_K / IQ4_NL / IQ4_XS / F16 / BF16 rows whose kernels give the GGUF kernels' results
// bit for bit (the k-quants: their GGUF GEMM's; the IQ4 types, which have none: the dequantized
// reference's within rounding, and one float order at every T; F16 / BF16: their GEMM's, and a
// row kernel of its own float order, within its rounding of the exact dot).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "core/cpu_features.h"
#include "core/error.h"
#include "quant/quant.h"
#include "quant/repack.h"

namespace ferrum::quant {
namespace {

const DType kFileTypes[] = {DType::Q4_0, DType::Q4_1, DType::Q5_0, DType::Q5_1, DType::Q8_0, DType::Q2_K,
                            DType::Q3_K, DType::Q4_K, DType::Q5_K, DType::Q6_K, DType::IQ4_NL, DType::IQ4_XS};
const DType kFloatTypes[] = {DType::F16, DType::BF16};
// Types with no AVX-512 kernel in the file layout: their R16 kernels are checked against the
// dequantized reference (within rounding), then against their own row kernel bit for bit.
bool has_file_layout_kernel(DType t) { return t != DType::IQ4_NL && t != DType::IQ4_XS; }

int64_t block_elems(DType t) { return dtype_info(t).block_elems; }

// rows x n weights of file type t from varied random floats.
std::vector<uint8_t> random_weights(DType t, int64_t rows, int64_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<uint8_t> w(dtype_bytes(t, n) * size_t(rows));
  std::vector<float> x(static_cast<size_t>(n));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < n; ++i) x[size_t(i)] = (i % 32 == 0 ? 4.0f : 1.0f) * u(rng) + 0.2f * float(r % 3) + 0.1f * float(i % 64 / 32);
    quantize_row(t, x.data(), w.data() + r * dtype_bytes(t, n), n);
  }
  return w;
}

TEST(Repack, RoundTripsEveryRowAndDequantizesAsTheFileType) {
  std::mt19937 rng(5);
  std::vector<DType> types(std::begin(kFileTypes), std::end(kFileTypes));
  types.insert(types.end(), std::begin(kFloatTypes), std::end(kFloatTypes));
  for (DType t : types) {
    ASSERT_TRUE(has_r16_layout(t));
    const int64_t rows = 48, n = 3 * r16_block_elems(t);
    const size_t row_bytes = dtype_bytes(t, n);
    const std::vector<uint8_t> w = random_weights(t, rows, n, rng);
    std::vector<uint8_t> packed(w.size() + 64, 0xab);  // the layout keeps the file's sizes: nothing past w.size()
    repack_r16(t, w.data(), packed.data(), rows, n);
    EXPECT_EQ(std::vector<uint8_t>(packed.begin() + std::ptrdiff_t(w.size()), packed.end()), std::vector<uint8_t>(64, 0xab));
    packed.resize(w.size());
    EXPECT_NE(packed, w);
    std::vector<uint8_t> row(row_bytes);
    std::vector<float> want(static_cast<size_t>(n)), got(static_cast<size_t>(n * 3));
    for (int64_t r = 0; r < rows; ++r) {
      unpack_r16_row(t, packed.data(), r, n, row.data());
      EXPECT_EQ(std::vector<uint8_t>(w.begin() + r * row_bytes, w.begin() + (r + 1) * row_bytes), row)
          << dtype_name(t) << " row " << r;
    }
    for (int64_t r0 : {0, 15, 45}) {  // across group boundaries
      dequantize_rows(t, WeightLayout::R16, packed.data(), r0, 3, n, got.data());
      for (int64_t k = 0; k < 3; ++k) {
        dequantize_row(t, w.data() + (r0 + k) * row_bytes, want.data(), n);
        EXPECT_EQ(std::vector<float>(got.begin() + k * n, got.begin() + (k + 1) * n), want) << r0 + k;
      }
    }
  }
  std::vector<uint8_t> w(dtype_bytes(DType::Q4_0, 32) * 8), out(w.size());
  EXPECT_THROW(repack_r16(DType::Q4_0, w.data(), out.data(), 8, 32), ValueError);  // not 16 rows
  EXPECT_THROW(repack_r16(DType::Q8_K, w.data(), out.data(), 16, 256), ValueError);
  EXPECT_FALSE(has_r16_layout(DType::Q8_K));
}

// Every ISA's R16 row kernel from any group start and R16 GEMM / batched kernel at every T equal
// the file type's row kernel bit for bit (the k-quants: its GEMM, which has another float order
// than its row kernel). AVX2 has R16 kernels for every one of these types, which give the scalar
// kernel's bits.
TEST(Repack, KernelsMatchTheFileTypesKernelsBitForBit) {
  const CpuFeatures& f = cpu_features();
  const bool vnni = f.avx512f && f.avx512bw && f.avx512vl && f.avx512_vnni;
  for (DType t : kFileTypes) ASSERT_EQ(gemm_kernel(t, WeightLayout::R16) != nullptr, vnni || (f.avx2 && f.fma && f.f16c));
  std::mt19937 rng(9);
  for (const char* isa : {"avx512", "avx2"})
  for (DType t : kFileTypes) {
    const DotKernel* r16_kernel = dot_kernel_for_isa(t, isa, WeightLayout::R16);
    if (!r16_kernel) continue;  // without the kernels the CPU backend never repacks
    const bool avx2 = std::string(isa) == "avx2";
    for (int64_t blocks : {1, 3, 18}) {
      const int64_t n = blocks * block_elems(t);
      SCOPED_TRACE(std::string(isa) + " " + dtype_name(t) + " n=" + std::to_string(n));
      const int64_t rows = 48, T = 37;
      const DType act_type = dot_kernel(t).act_type;
      const size_t row_bytes = dtype_bytes(t, n), act_bytes = dtype_bytes(act_type, n);
      const std::vector<uint8_t> w = random_weights(t, rows, n, rng);
      std::vector<uint8_t> packed(w.size()), act(act_bytes * T);
      repack_r16(t, w.data(), packed.data(), rows, n);
      std::uniform_real_distribution<float> u(-2, 2);
      std::vector<float> a(static_cast<size_t>(n));
      for (int64_t i = 0; i < T; ++i) {
        for (float& v : a) v = u(rng);
        quantize_row(act_type, a.data(), act.data() + i * act_bytes, n);
      }
      const DotKernel& r16 = *r16_kernel;
      EXPECT_EQ(r16.act_type, act_type);
      std::vector<float> want(size_t(T * rows));
      if (avx2) {
        for (int64_t i = 0; i < T; ++i)
          dot_kernel_scalar(t).dot_rows(n, w.data(), row_bytes, rows, act.data() + i * act_bytes, want.data() + i * rows);
      } else if (!has_file_layout_kernel(t)) {
        std::vector<float> wf(static_cast<size_t>(n)), af(static_cast<size_t>(n));
        for (int64_t i = 0; i < T; ++i) {
          r16.dot_rows(n, packed.data(), row_bytes, rows, act.data() + i * act_bytes, want.data() + i * rows);
          dequantize_row(act_type, act.data() + i * act_bytes, af.data(), n);
          double sum_abs_a = 0;
          for (float v : af) sum_abs_a += std::fabs(v);
          for (int64_t r = 0; r < rows; ++r) {
            dequantize_row(t, w.data() + r * row_bytes, wf.data(), n);
            double ref = 0, wmax = 0;
            for (int64_t k = 0; k < n; ++k) {
              ref += double(wf[size_t(k)]) * af[size_t(k)];
              wmax = std::max(wmax, double(std::fabs(wf[size_t(k)])));
            }
            EXPECT_NEAR(want[size_t(i * rows + r)], ref, 2e-5 * wmax * sum_abs_a) << "t " << i << " r " << r;
          }
        }
      } else if (block_elems(t) == 256) {
        gemm_kernel(t)(n, w.data(), row_bytes, rows, act.data(), act_bytes, T, want.data(), rows);
      } else {
        for (int64_t i = 0; i < T; ++i) dot_kernel(t).dot_rows(n, w.data(), row_bytes, rows, act.data() + i * act_bytes, want.data() + i * rows);
      }
      for (int64_t i = 0; i < T; ++i) {
        std::vector<float> got(size_t(rows), -7.0f);
        r16.dot_rows(n, packed.data(), row_bytes, rows, act.data() + i * act_bytes, got.data());
        EXPECT_EQ(got, std::vector<float>(want.begin() + i * rows, want.begin() + (i + 1) * rows)) << "t " << i;
        // from the second group, 24 rows (a partial last group)
        std::vector<float> part(26, -7.0f);
        r16.dot_rows(n, packed.data() + 16 * row_bytes, row_bytes, 24, act.data() + i * act_bytes, part.data());
        for (int64_t r = 0; r < 24; ++r) EXPECT_EQ(part[size_t(r)], want[size_t(i * rows + 16 + r)]) << "t " << i << " r " << r;
        EXPECT_EQ(part[24], -7.0f);
      }
      for (DotBatchFn fn : {gemm_kernel_for_isa(t, isa, WeightLayout::R16),
                            avx2 ? gemm_kernel_for_isa(t, isa, WeightLayout::R16) : dot_batch_kernel(t, WeightLayout::R16)}) {
        ASSERT_NE(fn, nullptr);
        for (int64_t T1 = 1; T1 <= T; ++T1) {
          for (int64_t r0 : {int64_t(0), int64_t(16)}) {
            const int64_t count = rows - r0 - (r0 ? 8 : 0), ldo = rows + 2;
            std::vector<float> got(size_t(T1 * ldo), -7.0f);
            fn(n, packed.data() + r0 * row_bytes, row_bytes, count, act.data(), act_bytes, T1, got.data(), ldo);
            for (int64_t i = 0; i < T1; ++i) {
              for (int64_t r = 0; r < count; ++r)
                EXPECT_EQ(got[size_t(i * ldo + r)], want[size_t(i * rows + r0 + r)]) << "T " << T1 << " t " << i << " r " << r;
              for (int64_t r = count; r < ldo; ++r) EXPECT_EQ(got[size_t(i * ldo + r)], -7.0f);
            }
          }
        }
      }
    }
  }
}

// F16 / BF16: the R16 row kernel (its own float order) follows the exact dot within its
// accumulation rounding and gives the same bits from any group start, as does F16's batched
// kernel at any T; the R16 GEMM gives the file layout's GEMM results bit for bit.
TEST(Repack, FloatKernelsFollowTheReferenceAndTheFileLayoutsGemm) {
  const CpuFeatures& f = cpu_features();
  const bool bf16 = f.avx512f && f.avx512bw && f.avx512vl && f.avx512_vnni && f.avx512_bf16;
  ASSERT_EQ(gemm_kernel(DType::F16, WeightLayout::R16) != nullptr, bf16);
  if (!bf16) return;  // without the kernels the CPU backend never repacks
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> u(-2, 2);
  for (DType t : kFloatTypes) {
    for (int64_t n : {32, 96, 576}) {
      SCOPED_TRACE(std::string(dtype_name(t)) + " n=" + std::to_string(n));
      const DotKernel& r16 = dot_kernel(t, WeightLayout::R16);
      const DType gemm_act = gemm_act_type(t);
      EXPECT_EQ(r16.act_type, DType::F32);
      const DotBatchFn batch = dot_batch_kernel(t, WeightLayout::R16);
      EXPECT_EQ(batch != nullptr, t == DType::F16);  // BF16's batched decode: the row kernel per activation row
      const int64_t rows = 48, T = 37;
      const size_t row_bytes = dtype_bytes(t, n), gemm_act_bytes = dtype_bytes(gemm_act, n);
      const std::vector<uint8_t> w = random_weights(t, rows, n, rng);
      std::vector<uint8_t> packed(w.size()), gemm_acts(gemm_act_bytes * T);
      repack_r16(t, w.data(), packed.data(), rows, n);
      std::vector<float> acts(static_cast<size_t>(n * T)), wf(static_cast<size_t>(n));
      for (int64_t i = 0; i < T; ++i) {
        for (int64_t k = 0; k < n; ++k) acts[size_t(i * n + k)] = u(rng);
        quantize_row(gemm_act, &acts[size_t(i * n)], gemm_acts.data() + i * gemm_act_bytes, n);
      }
      for (int64_t i = 0; i < T; ++i) {
        const float* a = &acts[size_t(i * n)];
        std::vector<float> got(static_cast<size_t>(rows));
        r16.dot_rows(n, packed.data(), row_bytes, rows, a, got.data());
        for (int64_t r = 0; r < rows; ++r) {
          dequantize_row(t, w.data() + r * row_bytes, wf.data(), n);
          double ref = 0, sum_abs = 0;
          for (int64_t k = 0; k < n; ++k) {
            ref += double(wf[size_t(k)]) * a[k];
            sum_abs += std::fabs(double(wf[size_t(k)]) * a[k]);
          }
          // 8 lanes of n / 8 multiply-adds each, then a 3-level tree: at most n / 8 + 3 roundings.
          EXPECT_NEAR(got[size_t(r)], ref, double(n / 8 + 4) * std::ldexp(1.0, -24) * sum_abs) << "t " << i << " r " << r;
        }
        std::vector<float> part(26, -7.0f);  // from the second group, 24 rows (a partial last group)
        r16.dot_rows(n, packed.data() + 16 * row_bytes, row_bytes, 24, a, part.data());
        for (int64_t r = 0; r < 24; ++r) EXPECT_EQ(part[size_t(r)], got[size_t(16 + r)]) << "t " << i << " r " << r;
        EXPECT_EQ(part[24], -7.0f);
      }
      // The batched kernel: the row kernel's bits for every activation row, whatever T.
      for (int64_t T1 = 2; batch && T1 <= T; T1 += T1 < 10 ? 1 : 9) {
        for (int64_t r0 : {int64_t(0), int64_t(16)}) {
          const int64_t count = rows - r0 - (r0 ? 8 : 0), ldo = rows + 2;
          std::vector<float> got(size_t(T1 * ldo), -7.0f), want(static_cast<size_t>(count));
          batch(n, packed.data() + r0 * row_bytes, row_bytes, count, acts.data(), n * sizeof(float), T1, got.data(), ldo);
          for (int64_t i = 0; i < T1; ++i) {
            r16.dot_rows(n, packed.data() + r0 * row_bytes, row_bytes, count, &acts[size_t(i * n)], want.data());
            for (int64_t r = 0; r < count; ++r)
              EXPECT_EQ(got[size_t(i * ldo + r)], want[size_t(r)]) << "T " << T1 << " r0 " << r0 << " t " << i << " r " << r;
            EXPECT_EQ(got[size_t(i * ldo + count)], -7.0f);
          }
        }
      }
      for (int64_t T1 : {1, 5, 37}) {
        for (int64_t r0 : {int64_t(0), int64_t(16)}) {
          const int64_t count = rows - r0 - (r0 ? 8 : 0), ldo = rows + 2;
          std::vector<float> want(size_t(T1 * ldo), -7.0f), got(size_t(T1 * ldo), -7.0f);
          gemm_kernel(t)(n, w.data() + r0 * row_bytes, row_bytes, count, gemm_acts.data(), gemm_act_bytes, T1, want.data(), ldo);
          gemm_kernel(t, WeightLayout::R16)(n, packed.data() + r0 * row_bytes, row_bytes, count, gemm_acts.data(), gemm_act_bytes, T1, got.data(), ldo);
          EXPECT_EQ(got, want) << "T " << T1 << " r0 " << r0;
        }
      }
    }
  }
}

}  // namespace
}  // namespace ferrum::quant
