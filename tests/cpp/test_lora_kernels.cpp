// The LoRA kernels' AVX-512 copy (backend/cpu/lora_kernels.h) computes the AVX2 kernels' bits,
// for every storage dtype, rank count, tail length and row block, and a row's result does not
// depend on the rows it is computed with.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "backend/cpu/cpu_kernels.h"
#include "backend/cpu/lora_kernels.h"
#include "quant/quant.h"

namespace ferrum::cpu {
namespace {

std::vector<float> normal(std::mt19937& rng, size_t n) {
  std::normal_distribution<float> d;
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

std::vector<uint8_t> stored(DType t, const std::vector<float>& v) {
  std::vector<uint8_t> bytes(dtype_bytes(t, int64_t(v.size())));
  quant::quantize_row(t, v.data(), bytes.data(), int64_t(v.size()));
  return bytes;
}

const DType kTypes[] = {DType::F32, DType::F16, DType::BF16};

// k.shrink for `rows` rows of x from row r0, against n ranks.
std::vector<float> shrink(const LoraKernels& k, DType t, int rows, int64_t n, const std::vector<float>& x, int r0,
                          const std::vector<uint8_t>& a, int64_t K) {
  std::vector<float> out(size_t(rows * n));
  const float* xs[8];
  float* outs[8];
  for (int r = 0; r < rows; ++r) xs[r] = x.data() + (r0 + r) * K, outs[r] = out.data() + r * n;
  k.shrink(t, rows, n)(xs, a.data(), K, outs);
  return out;
}

TEST(LoraKernels, Avx512ShrinkComputesTheAvx2Bits) {
  if (!avx512_copies()) GTEST_SKIP() << "no AVX-512 here: only the AVX2 kernels run";
  std::mt19937 rng(1);
  const LoraKernels &narrow = lora_kernels_avx2(), &wide = lora_kernels_avx512();
  for (DType t : kTypes)
    for (int64_t K : {8, 64, 75, 2048})
      for (int64_t n = 1; n <= 4; ++n) {
        const std::vector<uint8_t> a = stored(t, normal(rng, size_t(n * K)));
        const std::vector<float> x = normal(rng, size_t(8 * K));
        std::vector<float> alone;  // each row on its own, AVX2
        for (int r = 0; r < 8; ++r) {
          const std::vector<float> row = shrink(narrow, t, 1, n, x, r, a, K);
          alone.insert(alone.end(), row.begin(), row.end());
        }
        for (const LoraKernels* k : {&narrow, &wide})
          for (int rows : {1, k->shrink_rows}) {
            const std::vector<float> got = shrink(*k, t, rows, n, x, 0, a, K);
            EXPECT_EQ(0, std::memcmp(got.data(), alone.data(), got.size() * 4))
                << dtype_name(t) << " K " << K << " n " << n << " rows " << rows;
          }
      }
}

TEST(LoraKernels, Avx512ExpandComputesTheAvx2Bits) {
  if (!avx512_copies()) GTEST_SKIP() << "no AVX-512 here: only the AVX2 kernels run";
  std::mt19937 rng(2);
  const LoraKernels &narrow = lora_kernels_avx2(), &wide = lora_kernels_avx512();
  for (DType t : kTypes)
    for (int64_t rank : {1, 3, 16, 64})
      for (int64_t width : {16, 5, 1}) {
        const std::vector<uint8_t> b = stored(t, normal(rng, size_t(rank * 16)));
        const std::vector<float> v = normal(rng, size_t(8 * rank)), start = normal(rng, 8 * 16),
                                 scale = normal(rng, 8);
        const auto run = [&](const LoraKernels& k, int rows) {
          std::vector<float> out = start;
          const float* vs[8];
          float* outs[8];
          for (int r = 0; r < rows; ++r) vs[r] = v.data() + r * rank, outs[r] = out.data() + r * 16;
          k.expand(t, rows)(vs, b.data(), rank, width, scale.data(), outs);
          return out;
        };
        const std::vector<float> want = run(narrow, 1);
        for (const LoraKernels* k : {&narrow, &wide})
          for (int rows : {1, k->expand_rows}) {
            const std::vector<float> got = run(*k, rows);
            // row 0's columns (the others are another row's or untouched past `width`)
            EXPECT_EQ(0, std::memcmp(got.data(), want.data(), 16 * 4)) << dtype_name(t) << " rank " << rank;
            for (int r = 0; r < rows; ++r)
              for (int64_t c = width; c < 16; ++c) EXPECT_EQ(got[size_t(r * 16 + c)], start[size_t(r * 16 + c)]);
          }
        // every row of a block is its own single-row result
        const std::vector<float> block = run(wide, wide.expand_rows);
        for (int r = 1; r < wide.expand_rows; ++r) {
          std::vector<float> alone = start;
          const float* vs[1] = {v.data() + r * rank};
          float* outs[1] = {alone.data() + r * 16};
          narrow.expand(t, 1)(vs, b.data(), rank, width, scale.data() + r, outs);
          EXPECT_EQ(0, std::memcmp(block.data() + r * 16, alone.data() + r * 16, 16 * 4)) << "row " << r;
        }
      }
}

}  // namespace
}  // namespace ferrum::cpu
