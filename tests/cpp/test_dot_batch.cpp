// The batched dot kernels and GEMMs (many activation rows per weight block): equal to the
// dequantized reference within float rounding, and a row's result independent of the batch.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "core/cpu_features.h"
#include "quant/quant.h"

namespace ferrum::quant {
namespace {

std::vector<float> random_row(std::mt19937& rng, int64_t n) {
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<float> x(static_cast<size_t>(n));
  float amp = 1, shift = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (i % 32 == 0) amp = std::exp(2 * u(rng)), shift = 0.3f * u(rng);
    x[size_t(i)] = amp * (u(rng) + shift);
  }
  return x;
}

struct Case {
  std::vector<uint8_t> w, act;
  std::vector<float> wf, af;  // dequantized weights [rows, n] and activations [T, n]
  size_t w_row_bytes = 0, act_row_bytes = 0;
};

Case make_case(DType wt, int64_t n, int64_t rows, int64_t T, std::mt19937& rng) {
  Case c;
  const DType at = dot_kernel(wt).act_type;
  c.w_row_bytes = dtype_bytes(wt, n);
  c.act_row_bytes = dtype_bytes(at, n);
  c.w.resize(c.w_row_bytes * size_t(rows));
  c.wf.resize(size_t(rows * n));
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<float> x = random_row(rng, n);
    quantize_row(wt, x.data(), c.w.data() + r * c.w_row_bytes, n);
    dequantize_row(wt, c.w.data() + r * c.w_row_bytes, c.wf.data() + r * n, n);
  }
  c.act.resize(c.act_row_bytes * size_t(T));
  c.af.resize(size_t(T * n));
  for (int64_t t = 0; t < T; ++t) {
    std::vector<float> a = random_row(rng, n);
    quantize_row(at, a.data(), c.act.data() + t * c.act_row_bytes, n);
    dequantize_row(at, c.act.data() + t * c.act_row_bytes, c.af.data() + t * n, n);
  }
  return c;
}

const DType kLegacy[] = {DType::Q4_0, DType::Q4_1, DType::Q5_0, DType::Q5_1, DType::Q8_0};

// How far a result may be from the double reference: scale * max|w| * sum|a|, or scale *
// sum|w * a| (tighter, for kernels whose only float error is per super-block).
enum class Bound { MaxWeightTimesActSum, SumAbsProducts };

// Runs a batched kernel over c's T activation rows into rows + 3 output columns; checks every
// result against the dequantized reference and that the columns past `rows` are untouched.
std::vector<float> run_checked(DotBatchFn fn, const Case& c, int64_t n, int64_t rows, int64_t T,
                               Bound bound, double scale) {
  const int64_t ldo = rows + 3;
  std::vector<float> out(size_t(T * ldo), -7.0f);
  fn(n, c.w.data(), c.w_row_bytes, rows, c.act.data(), c.act_row_bytes, T, out.data(), ldo);
  for (int64_t t = 0; t < T; ++t) {
    double sum_abs_a = 0;
    for (int64_t i = 0; i < n; ++i) sum_abs_a += std::fabs(c.af[size_t(t * n + i)]);
    for (int64_t r = 0; r < rows; ++r) {
      double ref = 0, wmax = 0, sum_abs = 0;
      for (int64_t i = 0; i < n; ++i) {
        const double w = c.wf[size_t(r * n + i)], p = w * c.af[size_t(t * n + i)];
        ref += p;
        sum_abs += std::fabs(p);
        wmax = std::max(wmax, std::fabs(w));
      }
      const double tol = scale * (bound == Bound::SumAbsProducts ? sum_abs : wmax * sum_abs_a);
      EXPECT_NEAR(out[size_t(t * ldo + r)], ref, tol) << "t " << t << " r " << r;
    }
    for (int64_t r = rows; r < ldo; ++r) EXPECT_EQ(out[size_t(t * ldo + r)], -7.0f);  // untouched
  }
  return out;
}

// The legacy formats have one float order for every kernel: the row kernel, the batched decode
// kernel and the GEMM agree bit for bit at every T, row count (tiles of 16 / 32 rows plus
// tails) and block count (odd ones too), and are within rounding of the dequantized reference.
TEST(DotBatch, LegacyKernelsAgreeBitForBitAtEveryBatchSize) {
  const CpuFeatures& f = cpu_features();
  const bool expected = f.avx512f && f.avx512bw && f.avx512vl && f.avx512_vnni;
  std::mt19937 rng(3);
  for (DType wt : kLegacy) {
    DotBatchFn batch = dot_batch_kernel(wt), gemm = gemm_kernel(wt);
    EXPECT_EQ(batch != nullptr, expected) << dtype_name(wt);
    EXPECT_NE(gemm, nullptr) << dtype_name(wt);  // every ISA has one
    if (!batch || !gemm) continue;
    for (int64_t n : {32, 64, 96, 160, 576, 32 * 49}) {
      const int64_t rows = n == 576 ? 53 : n == 160 ? 16 : 37, T = 70;
      SCOPED_TRACE(std::string(dtype_name(wt)) + " n=" + std::to_string(n));
      Case c = make_case(wt, n, rows, T, rng);
      const int64_t ldo = rows + 3;
      const std::vector<float> out = run_checked(gemm, c, n, rows, T, Bound::MaxWeightTimesActSum, 2e-5);
      // The row kernel, one activation row at a time, over all rows and from row 5 (another
      // place in its 16-row groups).
      for (int64_t t = 0; t < T; ++t) {
        std::vector<float> by_row(static_cast<size_t>(rows)), skipped(static_cast<size_t>(rows));
        const uint8_t* a = c.act.data() + t * c.act_row_bytes;
        dot_kernel(wt).dot_rows(n, c.w.data(), c.w_row_bytes, rows, a, by_row.data());
        dot_kernel(wt).dot_rows(n, c.w.data() + 5 * c.w_row_bytes, c.w_row_bytes, rows - 5, a, skipped.data() + 5);
        for (int64_t r = 0; r < rows; ++r) {
          EXPECT_EQ(by_row[size_t(r)], out[size_t(t * ldo + r)]) << "t " << t << " r " << r;
          if (r >= 5) {
            EXPECT_EQ(skipped[size_t(r)], out[size_t(t * ldo + r)]) << "t " << t << " r " << r;
          }
        }
      }
      // The batched kernel and the GEMM at every T from 1 to 70 (the first T activation rows),
      // the GEMM also from row 7 (another place in its 32-row tiles).
      for (int64_t T1 = 1; T1 <= T; ++T1) {
        std::vector<float> b(static_cast<size_t>(T1 * rows)), g(static_cast<size_t>(T1 * rows));
        batch(n, c.w.data(), c.w_row_bytes, rows, c.act.data(), c.act_row_bytes, T1, b.data(), rows);
        gemm(n, c.w.data() + 7 * c.w_row_bytes, c.w_row_bytes, rows - 7, c.act.data(), c.act_row_bytes, T1,
             g.data() + 7, rows);
        for (int64_t t = 0; t < T1; ++t)
          for (int64_t r = 0; r < rows; ++r) {
            EXPECT_EQ(b[size_t(t * rows + r)], out[size_t(t * ldo + r)]) << "T " << T1 << " t " << t << " r " << r;
            if (r >= 7) {
              EXPECT_EQ(g[size_t(t * rows + r)], out[size_t(t * ldo + r)]) << "T " << T1 << " t " << t;
            }
          }
      }
    }
  }
  EXPECT_EQ(dot_batch_kernel(DType::F32), nullptr);  // the row kernels serve the other types
  EXPECT_EQ(gemm_kernel(DType::Q8_1), nullptr);      // float weights: test_gemm_float.cpp
}

// The k-quant GEMM (Q8_K activations): within rounding of the dequantized reference, and a row's
// result bit-identical whatever T (odd weight rows past the 32-row tiles, T past the register
// blocks of 4).
TEST(Gemm, KQuantsMatchDequantizedReferenceAndIgnoreBatchSize) {
  std::mt19937 rng(7);
  for (DType wt : {DType::Q2_K, DType::Q3_K, DType::Q4_K, DType::Q5_K, DType::Q6_K}) {
    DotBatchFn gemm = gemm_kernel(wt);
    ASSERT_NE(gemm, nullptr);  // every ISA has one
    for (int64_t n : {256, 512, 2816}) {
      const int64_t rows = n == 2816 ? 45 : 71;  // tiles of 32 plus 13 / 7
      const int64_t T = n == 512 ? 128 : 33;
      SCOPED_TRACE(std::string(dtype_name(wt)) + " n=" + std::to_string(n));
      Case c = make_case(wt, n, rows, T, rng);
      const int64_t ldo = rows + 3;
      // float rounding of the per-super-block scale products only
      const std::vector<float> out = run_checked(gemm, c, n, rows, T, Bound::SumAbsProducts, 1e-5);
      // The same rows at other batch sizes (each activation row alone, the first 9) and from a
      // weight pointer that puts them at another place in the tiles.
      for (int64_t t = 0; t < T; ++t) {
        std::vector<float> one(static_cast<size_t>(rows));
        gemm(n, c.w.data(), c.w_row_bytes, rows, c.act.data() + t * c.act_row_bytes, c.act_row_bytes, 1,
             one.data(), rows);
        for (int64_t r = 0; r < rows; ++r) EXPECT_EQ(one[size_t(r)], out[size_t(t * ldo + r)]);
      }
      const int64_t T9 = 9, skip = 5;
      std::vector<float> nine(size_t(T9 * rows));
      gemm(n, c.w.data() + skip * c.w_row_bytes, c.w_row_bytes, rows - skip, c.act.data(), c.act_row_bytes, T9,
           nine.data(), rows);
      for (int64_t t = 0; t < T9; ++t)
        for (int64_t r = skip; r < rows; ++r) EXPECT_EQ(nine[size_t(t * rows + r - skip)], out[size_t(t * ldo + r)]);
    }
  }
}

// Below AVX-512 VNNI (FERRUM_CPU_ISA=avx2 / scalar, or such a CPU) linear() runs a prefill on the
// GEMM of the row kernel's ISA and shorter calls on the row kernel: each ISA's GEMM must give
// its row kernel's bits at every T, for every weight row count (the AVX2 GEMMs take 4 weight
// rows and up to 4 activation rows at a time) and from any weight row. The types dotted with
// Q8_0 activations also give the scalar kernel's bits on every ISA.
TEST(Gemm, EveryIsaEqualsItsRowKernelAtEveryBatchSize) {
  std::mt19937 rng(17);
  int checked = 0;
  for (DType wt : {DType::Q4_0, DType::Q4_1, DType::Q5_0, DType::Q5_1, DType::Q8_0, DType::IQ4_NL, DType::Q2_K,
                   DType::Q3_K, DType::Q4_K, DType::Q5_K, DType::Q6_K, DType::IQ4_XS}) {
    for (const char* isa : dot_kernel_isas(wt)) {
      const DotBatchFn gemm = gemm_kernel_for_isa(wt, isa);
      if (std::string(isa) == "avx512") continue;  // LegacyKernelsAgree..., test_quant.cpp, test_repack.cpp
      ASSERT_NE(gemm, nullptr) << dtype_name(wt) << " " << isa;
      const DotKernel& row = *dot_kernel_for_isa(wt, isa);
      const bool scalar_order = row.act_type == DType::Q8_0;
      const int64_t block = dtype_info(wt).block_elems;
      for (int64_t n : {block, 3 * block}) {
        const int64_t rows = 23, T = 70;  // rows: 4-row groups plus 3
        SCOPED_TRACE(std::string(dtype_name(wt)) + " " + isa + " n=" + std::to_string(n));
        Case c = make_case(wt, n, rows, T, rng);
        std::vector<float> want(static_cast<size_t>(T * rows)), scalar(static_cast<size_t>(rows));
        for (int64_t t = 0; t < T; ++t) {
          const uint8_t* a = c.act.data() + t * c.act_row_bytes;
          row.dot_rows(n, c.w.data(), c.w_row_bytes, rows, a, want.data() + t * rows);
          dot_kernel_scalar(wt).dot_rows(n, c.w.data(), c.w_row_bytes, rows, a, scalar.data());
          for (int64_t r = 0; r < rows && scalar_order; ++r)
            ASSERT_EQ(want[size_t(t * rows + r)], scalar[size_t(r)]) << "t " << t << " r " << r;
        }
        std::vector<int64_t> batch_sizes = {33, 64, 70};
        for (int64_t t = 1; t <= 20; ++t) batch_sizes.push_back(t);
        for (int64_t T1 : batch_sizes)
          for (int64_t skip : {0, 1, 6}) {  // every weight row at another place in the 4-row groups
            const int64_t ldo = rows + 2;
            std::vector<float> got(size_t(T1 * ldo), -7.0f);
            gemm(n, c.w.data() + skip * c.w_row_bytes, c.w_row_bytes, rows - skip, c.act.data(), c.act_row_bytes, T1,
                 got.data() + skip, ldo);
            for (int64_t t = 0; t < T1; ++t) {
              for (int64_t r = skip; r < rows; ++r)
                ASSERT_EQ(got[size_t(t * ldo + r)], want[size_t(t * rows + r)]) << "T " << T1 << " skip " << skip << " t " << t << " r " << r;
              for (int64_t r = rows; r < ldo; ++r) ASSERT_EQ(got[size_t(t * ldo + r)], -7.0f);  // untouched
            }
          }
      }
      ++checked;
    }
  }
  EXPECT_GE(checked, 12);  // scalar, at least
}

}  // namespace
}  // namespace ferrum::quant
