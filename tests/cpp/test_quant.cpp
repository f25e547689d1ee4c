// Block formats, reference quantizers and dot kernels (every ISA variant this CPU supports).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/cpu_features.h"
#include "core/error.h"
#include "quant/formats.h"
#include "quant/quant.h"

namespace ferrum::quant {
namespace {

std::vector<float> dequant(DType t, const void* src, int64_t n) {
  std::vector<float> out(static_cast<size_t>(n));
  dequantize_row(t, src, out.data(), n);
  return out;
}

template <class Block>
std::vector<float> dequant_block(DType t, const Block& b) {
  return dequant(t, &b, dtype_info(t).block_elems);
}

// f16 bit patterns used below (all exact): 0.25, 0.5, 1, 2, 3, -1.
constexpr uint16_t kH025 = 0x3400, kH05 = 0x3800, kH1 = 0x3C00, kH2 = 0x4000, kH3 = 0x4200,
                   kHm1 = 0xBC00;

// ---- (a) hand-made blocks: each check follows the format definition by hand ----

TEST(Dequantize, Plain) {
  const float f[2] = {1.5f, -0.0f};
  EXPECT_EQ(dequant(DType::F32, f, 2), std::vector<float>({1.5f, -0.0f}));
  const uint16_t h[3] = {kH05, 0xC200 /* -3 */, 0x0001 /* 2^-24 */};
  EXPECT_EQ(dequant(DType::F16, h, 3), std::vector<float>({0.5f, -3.0f, std::ldexp(1.0f, -24)}));
  const uint16_t b[2] = {0x3FC0 /* 1.5 */, 0xC080 /* -4 */};
  EXPECT_EQ(dequant(DType::BF16, b, 2), std::vector<float>({1.5f, -4.0f}));
}

TEST(Dequantize, Q4_0) {
  BlockQ4_0 b{};
  b.d = kH05;
  std::memset(b.qs, 0x88, sizeof b.qs);  // every element q = 8 -> 0
  b.qs[0] = 0x0F;  // element 0: q = 15, element 16: q = 0
  b.qs[5] = 0x83;  // element 5: q = 3, element 21: q = 8
  auto y = dequant_block(DType::Q4_0, b);
  EXPECT_EQ(y[0], 3.5f);
  EXPECT_EQ(y[16], -4.0f);
  EXPECT_EQ(y[5], -2.5f);
  EXPECT_EQ(y[21], 0.0f);
  EXPECT_EQ(y[31], 0.0f);
}

TEST(Dequantize, Q4_1) {
  BlockQ4_1 b{};
  b.d = kH025;
  b.m = kHm1;
  b.qs[1] = 0xF2;
  auto y = dequant_block(DType::Q4_1, b);
  EXPECT_EQ(y[1], 2 * 0.25f - 1);
  EXPECT_EQ(y[17], 15 * 0.25f - 1);
  EXPECT_EQ(y[0], -1.0f);
}

TEST(Dequantize, Q5_0) {
  BlockQ5_0 b{};
  b.d = kH2;
  b.qs[2] = 0x1F;
  b.qs[3] = 0x1F;
  const uint32_t qh = (1u << 2) | (1u << 18);  // fifth bits of elements 2 and 18
  std::memcpy(b.qh, &qh, 4);
  auto y = dequant_block(DType::Q5_0, b);
  EXPECT_EQ(y[2], 2.0f * (31 - 16));
  EXPECT_EQ(y[18], 2.0f * (17 - 16));
  EXPECT_EQ(y[3], 2.0f * (15 - 16));
  EXPECT_EQ(y[19], 2.0f * (1 - 16));
}

TEST(Dequantize, Q5_1) {
  BlockQ5_1 b{};
  b.d = kH05;
  b.m = kH3;
  b.qs[0] = 0x21;
  const uint32_t qh = 1u << 16;
  std::memcpy(b.qh, &qh, 4);
  auto y = dequant_block(DType::Q5_1, b);
  EXPECT_EQ(y[0], 1 * 0.5f + 3);
  EXPECT_EQ(y[16], 18 * 0.5f + 3);
}

TEST(Dequantize, Q8_0_Q8_1_Q8_K) {
  BlockQ8_0 a{};
  a.d = kH025;
  a.qs[7] = -100;
  a.qs[31] = 127;
  auto y = dequant_block(DType::Q8_0, a);
  EXPECT_EQ(y[7], -25.0f);
  EXPECT_EQ(y[31], 31.75f);
  BlockQ8_1 b{};
  b.d = kH1;
  b.qs[0] = -128;
  EXPECT_EQ(dequant_block(DType::Q8_1, b)[0], -128.0f);
  BlockQ8_K k{};
  k.d = 0.125f;
  k.qs[255] = -3;
  EXPECT_EQ(dequant_block(DType::Q8_K, k)[255], -0.375f);
}

TEST(Dequantize, Q2_K) {
  BlockQ2_K b{};
  b.d = kH1;
  b.dmin = kH05;
  b.scales[5] = 0x23;   // sub-block 5 (elements 80..95): scale 3, min 2
  b.scales[1] = 0x11;   // sub-block 1 (16..31): scale 1, min 1
  b.scales[14] = 0x07;  // sub-block 14 (224..239): scale 7, min 0
  b.qs[16] = 0x20;      // bits 4..5 -> element 128*0 + 32*2 + 16 = 80: q = 2
  b.qs[37] = 0xC0;      // bits 6..7 of qs[32 + 5] -> element 128 + 96 + 5 = 229: q = 3
  auto y = dequant_block(DType::Q2_K, b);
  EXPECT_EQ(y[80], 1.0f * 3 * 2 - 0.5f * 2);
  EXPECT_EQ(y[16], -0.5f);
  EXPECT_EQ(y[229], 21.0f);
}

TEST(Dequantize, Q3_K) {
  BlockQ3_K b{};
  b.d = kH05;
  b.scales[0] = 1;        // sub-block 0 code = 1 | (2 << 4) = 33 -> scale 1
  b.scales[8] = 2;
  b.scales[5] = 4 << 4;   // sub-block 13: low nibble 4 (high nibble of byte 5) ...
  b.scales[9] = 1 << 6;   // ... top bits 1 (byte 8 + 13 % 4, bits 2 * (13 / 4)): code 20 -> -12
  b.qs[0] = 3;            // element 0: low bits 3, hmask bit 0 set -> q = 3
  b.hmask[0] = 1;
  b.qs[48] = 1 << 4;      // element 208 (half 1, field 2, k 16): low bits 1, hmask bit 6 clear
  auto y = dequant_block(DType::Q3_K, b);
  EXPECT_EQ(y[0], 0.5f * 1 * 3);
  EXPECT_EQ(y[208], 0.5f * -12 * (1 - 4));
  EXPECT_EQ(y[1], 0.5f * 1 * -4);     // sub-block 0, q = 0 - 4
  EXPECT_EQ(y[100], 0.5f * -32 * -4);  // code 0 -> scale -32
}

void set_k4_scales(uint8_t* s) {
  s[1] = 5;     // sub-block 1: scale 5
  s[5] = 3;     //              min 3
  s[10] = 0x21; // sub-block 6: low 4 bits of scale 1 / min 2 ...
  s[2] = 0x40;  // ... top bits of the scale (1 -> 17)
  s[6] = 0x80;  // ... top bits of the min (2 -> 34)
}

TEST(Dequantize, Q4_K) {
  BlockQ4_K b{};
  b.d = kH1;
  b.dmin = kH025;
  set_k4_scales(b.scales);
  b.qs[2] = 0x70;       // element 32 + 2 (sub-block 1, high nibble): q = 7
  b.qs[96 + 1] = 0x03;  // element 192 + 1 (sub-block 6, low nibble): q = 3
  auto y = dequant_block(DType::Q4_K, b);
  EXPECT_EQ(y[34], 5.0f * 7 - 0.25f * 3);
  EXPECT_EQ(y[193], 17.0f * 3 - 0.25f * 34);
  EXPECT_EQ(y[0], 0.0f);
}

TEST(Dequantize, Q5_K) {
  BlockQ5_K b{};
  b.d = kH1;
  b.dmin = kH025;
  set_k4_scales(b.scales);
  b.qs[2] = 0x70;
  b.qs[96 + 1] = 0x03;
  b.qh[2] = 1 << 1;  // fifth bit of sub-block 1 element 2
  b.qh[1] = 1 << 6;  // fifth bit of sub-block 6 element 1
  auto y = dequant_block(DType::Q5_K, b);
  EXPECT_EQ(y[34], 5.0f * 23 - 0.25f * 3);
  EXPECT_EQ(y[193], 17.0f * 19 - 0.25f * 34);
  EXPECT_EQ(y[2], 0.0f);  // sub-block 0 has scale 0
}

TEST(Dequantize, Q6_K) {
  BlockQ6_K b{};
  b.d = kH05;
  b.scales[0] = 2;
  b.scales[11] = -3;
  b.ql[5] = 0x0A;  // element 5: low 4 bits 10 ...
  b.qh[5] = 0x02;  // ... high bits 2 -> q = 42 - 32 = 10
  b.ql[116] = 0x05;   // element 180 (half 1, group 1, k 20): ql[64 + 32 + 20] low nibble
  b.qh[52] = 1 << 2;  // qh[32 + 20] bits 2..3 = 1 -> q = 21 - 32
  auto y = dequant_block(DType::Q6_K, b);
  EXPECT_EQ(y[5], 0.5f * 2 * 10);
  EXPECT_EQ(y[180], 0.5f * -3 * -11);
  EXPECT_EQ(y[6], 0.5f * 2 * -32);
}

TEST(Quantize, Q8_1StoresScaledSumAndQ8_KBlockSums) {
  std::vector<float> x(256);
  for (int i = 0; i < 256; ++i) x[i] = std::sin(0.37f * i) * 3;
  BlockQ8_1 b[8];
  quantize_row(DType::Q8_1, x.data(), b, 256);
  for (int i = 0; i < 8; ++i) {
    float amax = 0;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[32 * i + j]));
    int sum = 0;
    for (int8_t q : b[i].qs) sum += q;
    // s is rounded once from the f32 scale, as in llama.cpp (not from the f16-rounded d).
    EXPECT_EQ(b[i].s, f32_to_f16(float(sum) * (amax / 127)));
  }
  BlockQ8_K k;
  quantize_row(DType::Q8_K, x.data(), &k, 256);
  for (int s = 0; s < 16; ++s) {
    int sum = 0;
    for (int l = 0; l < 16; ++l) sum += k.qs[16 * s + l];
    EXPECT_EQ(k.bsums[s], sum);
  }
}

TEST(Quantize, RejectsPartialBlocks) {
  std::vector<float> x(40);
  std::vector<uint8_t> out(1024);
  EXPECT_THROW(quantize_row(DType::Q4_0, x.data(), out.data(), 40), ValueError);
  EXPECT_THROW(dequantize_row(DType::Q4_K, out.data(), x.data(), 32), ValueError);
  EXPECT_THROW(dot_kernel(DType::I32), ValueError);
}

// ---- (b) round trip: per block, max |x - dequant(quant(x))| <= bound * block absmax ----

// Bounds, as fractions of the (super-)block's absmax A:
//  symmetric formats with 2^(b-1) negative levels (Q4_0, Q5_0, Q3_K, Q6_K): the extreme value
//    is exact but the other sign is clamped one level short, so up to one step A / 2^(b-1);
//  Q8_0 / Q8_1 / Q8_K (127 levels each side): half a step A / 254;
//  Q4_1 / Q5_1: half a step of the range (<= 2A) over 15 / 31;
//  k-quants with quantized sub-block scales add the code rounding times the level count;
//  every f16 scale adds up to 2^-11 relative (levels * step * 2^-11 <= 2^-10 A).
double roundtrip_bound(DType t) {
  const double f16 = 1.0 / 1024;
  switch (t) {
    case DType::F32: return 0;
    case DType::F16: return 1.0 / 2048;
    case DType::BF16: return 1.0 / 256;
    case DType::Q4_0: return 1.0 / 8 + f16;
    case DType::Q5_0: return 1.0 / 16 + f16;
    case DType::Q8_0: case DType::Q8_1: return 1.0 / 254 + f16;
    case DType::Q8_K: return 1.0 / 254 * 1.001;
    case DType::Q4_1: return 2.0 / 15 / 2 + f16;
    case DType::Q5_1: return 2.0 / 31 / 2 + f16;
    // step/2 = A/3, 4-bit scale codes: 3 levels * step/30 + min code rounding A/30.
    case DType::Q2_K: return 1.0 / 3 + 1.0 / 15 + 1.0 / 30 + f16;
    // one clamped step A/4 plus 4 levels * (A/4) / 64 from the 6-bit signed scale codes.
    case DType::Q3_K: return 1.0 / 4 + 1.0 / 64 + f16;
    // step/2 = A/15, 15 levels * max_step/126 = A/63, min code A/126.
    case DType::Q4_K: return 1.0 / 15 + 1.0 / 63 + 1.0 / 126 + f16;
    case DType::Q5_K: return 1.0 / 31 + 1.0 / 63 + 1.0 / 126 + f16;
    // one clamped step A/32 plus 32 levels * (A/32) / 256 from the 8-bit scale codes.
    case DType::Q6_K: return 1.0 / 32 + 1.0 / 256 + f16;
    // A at the level -127: the widest half gap is 113..127 (values past 113 d), 14 d = 14A/127.
    case DType::IQ4_NL: return 14.0 / 127 + f16;
    // the same per sub-block scale s (<= A/127), whose 6-bit code is off by up to one step
    // (A/127/32; a full step where +32 clamps to 31): 14 (s + step) + 127 step.
    case DType::IQ4_XS: return 14.0 / 127 * (1 + 1.0 / 32) + 1.0 / 32 + f16;
    default: return 0;
  }
}

const DType kAllTypes[] = {DType::F32,  DType::F16,  DType::BF16, DType::Q4_0,   DType::Q4_1,
                           DType::Q5_0, DType::Q5_1, DType::Q8_0, DType::Q8_1,   DType::Q2_K,
                           DType::Q3_K, DType::Q4_K, DType::Q5_K, DType::Q6_K,   DType::Q8_K,
                           DType::IQ4_NL, DType::IQ4_XS};

// Random rows whose blocks have different magnitudes and offsets, with an occasional outlier.
std::vector<float> random_row(std::mt19937& rng, int64_t n) {
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<float> x(static_cast<size_t>(n));
  float amp = 1, shift = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (i % 32 == 0) amp = std::exp(2 * u(rng)), shift = 0.3f * u(rng);
    x[i] = amp * (u(rng) + shift);
    if (u(rng) > 0.995f) x[i] *= 4;
  }
  return x;
}

TEST(Quantize, RoundTripWithinFormatBound) {
  std::mt19937 rng(1);
  for (DType t : kAllTypes) {
    SCOPED_TRACE(dtype_name(t));
    const int64_t n = 4096, block = std::max(dtype_info(t).block_elems, 32);
    std::vector<float> x = random_row(rng, n);
    x[5] = 0;  // plus an all-zero block
    std::fill(x.begin() + 256, x.begin() + 512, 0.0f);
    std::vector<uint8_t> q(dtype_bytes(t, n));
    quantize_row(t, x.data(), q.data(), n);
    std::vector<float> y = dequant(t, q.data(), n);
    double worst = 0;
    for (int64_t b0 = 0; b0 < n; b0 += block) {
      double amax = 0, err = 0;
      for (int64_t i = b0; i < b0 + block; ++i) {
        amax = std::max(amax, double(std::fabs(x[i])));
        err = std::max(err, std::fabs(double(x[i]) - y[i]));
      }
      if (amax == 0) {
        EXPECT_EQ(err, 0) << "block " << b0;
        continue;
      }
      if (t == DType::F32 || t == DType::F16 || t == DType::BF16) continue;
      EXPECT_LE(err, roundtrip_bound(t) * amax) << "block " << b0;
      worst = std::max(worst, err / amax);
    }
    for (int64_t i = 0; i < n && (t == DType::F16 || t == DType::BF16 || t == DType::F32); ++i)
      ASSERT_LE(std::fabs(double(x[i]) - y[i]), roundtrip_bound(t) * std::fabs(x[i]));
    RecordProperty(std::string("worst_") + dtype_name(t), std::to_string(worst));
  }
}

// ---- (c) dot kernels: every ISA against dequantize(w) . dequantize(quantize(act)) in double ----

void check_dot(DType wt, const DotKernel& k, int64_t n, int64_t rows, std::mt19937& rng) {
  SCOPED_TRACE(std::string(dtype_name(wt)) + " " + k.isa + " n=" + std::to_string(n) +
               " rows=" + std::to_string(rows));
  const size_t row_bytes = dtype_bytes(wt, n);
  std::vector<uint8_t> w(row_bytes * size_t(rows));
  std::vector<float> wf(size_t(n * rows));
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<float> x = random_row(rng, n);
    quantize_row(wt, x.data(), w.data() + r * row_bytes, n);
    dequantize_row(wt, w.data() + r * row_bytes, wf.data() + r * n, n);
  }
  std::vector<float> a = random_row(rng, n);
  std::vector<uint8_t> aq(dtype_bytes(k.act_type, n));
  quantize_row(k.act_type, a.data(), aq.data(), n);
  std::vector<float> af = dequant(k.act_type, aq.data(), n);
  std::vector<float> out(size_t(rows) + 1, -12345.0f);  // one guard element past the end
  k.dot_rows(n, w.data(), row_bytes, rows, aq.data(), out.data());
  double sum_abs_a = 0;
  for (float v : af) sum_abs_a += std::fabs(v);
  for (int64_t r = 0; r < rows; ++r) {
    double ref = 0, wmax = 0;
    for (int64_t i = 0; i < n; ++i) {
      ref += double(wf[r * n + i]) * af[i];
      wmax = std::max(wmax, double(std::fabs(wf[r * n + i])));
    }
    // Float accumulation and per-block float scale products: a few ulps of the magnitudes.
    EXPECT_NEAR(out[r], ref, 2e-5 * wmax * sum_abs_a + 1e-30) << "row " << r;
  }
  EXPECT_EQ(out[rows], -12345.0f);
}

TEST(DotKernel, EveryIsaMatchesDequantizedReference) {
  std::mt19937 rng(7);
  int checked = 0;
  for (DType wt : kAllTypes) {
    if (dot_kernel_isas(wt).empty()) continue;
    const int64_t block = dtype_info(wt).block_elems;
    std::vector<int64_t> ns = {block == 1 ? 256 : block, 2 * std::max<int64_t>(block, 32), 1024 + 256, 4096 + 256};
    if (block == 1) ns.insert(ns.end(), {1, 7, 31, 33, 100, 129});
    for (const char* isa : dot_kernel_isas(wt)) {
      const DotKernel* k = dot_kernel_for_isa(wt, isa);
      ASSERT_NE(k, nullptr);
      EXPECT_STREQ(k->isa, isa);
      EXPECT_EQ(k->act_type, dot_kernel_scalar(wt).act_type);
      for (int64_t n : ns)
        for (int64_t rows : {1, 3, 7}) check_dot(wt, *k, n, rows, rng);
      ++checked;
    }
  }
  EXPECT_GE(checked, 13);
}

// The types dotted with Q8_0 activations share the scalar kernel's float chain (whole integer sums
// per block, then one fused multiply-add per scale) on every ISA, so a model computes the same
// bits on every CPU, and FERRUM_CPU_ISA caps change no result. (IQ4_NL has no AVX-512 kernel in
// the file layout; its R16 kernels take the chain too: test_repack.cpp.)
TEST(DotKernel, LegacyFormatsGiveTheSameBitsOnEveryIsa) {
  std::mt19937 rng(11);
  for (DType wt : {DType::Q4_0, DType::Q4_1, DType::Q5_0, DType::Q5_1, DType::Q8_0, DType::IQ4_NL}) {
    const int64_t n = 1024 + 96, rows = 37;
    const size_t row_bytes = dtype_bytes(wt, n);
    std::vector<uint8_t> w(row_bytes * size_t(rows));
    for (int64_t r = 0; r < rows; ++r) quantize_row(wt, random_row(rng, n).data(), w.data() + r * row_bytes, n);
    const DotKernel& scalar = dot_kernel_scalar(wt);
    std::vector<uint8_t> aq(dtype_bytes(scalar.act_type, n));
    quantize_row(scalar.act_type, random_row(rng, n).data(), aq.data(), n);
    std::vector<float> ref(size_t(rows), 0.0f);
    scalar.dot_rows(n, w.data(), row_bytes, rows, aq.data(), ref.data());
    for (const char* isa : dot_kernel_isas(wt)) {
      std::vector<float> out(size_t(rows), 0.0f);
      dot_kernel_for_isa(wt, isa)->dot_rows(n, w.data(), row_bytes, rows, aq.data(), out.data());
      for (int64_t r = 0; r < rows; ++r)
        EXPECT_EQ(out[r], ref[r]) << dtype_name(wt) << " " << isa << " row " << r;
    }
  }
}

// The scalar kernels take the int8 GEMMs' float order (so do the R16 kernels, test_repack.cpp):
// a model capped to scalar (FERRUM_CPU_ISA) computes what an AVX-512 VNNI CPU does.
TEST(DotKernel, ScalarKernelsEqualTheGemmsBitForBit) {
  std::mt19937 rng(13);
  int checked = 0;
  for (DType wt : kAllTypes) {
    const DotBatchFn gemm = is_quantized(wt) ? gemm_kernel_for_isa(wt, "avx512") : nullptr;
    if (!gemm) continue;
    const int64_t n = 5 * std::max<int64_t>(dtype_info(wt).block_elems, 64), rows = 21, T = 3;
    const size_t row_bytes = dtype_bytes(wt, n);
    std::vector<uint8_t> w(row_bytes * size_t(rows));
    for (int64_t r = 0; r < rows; ++r) quantize_row(wt, random_row(rng, n).data(), w.data() + r * row_bytes, n);
    const DotKernel& scalar = dot_kernel_scalar(wt);
    const size_t act_bytes = dtype_bytes(scalar.act_type, n);
    std::vector<uint8_t> act(act_bytes * size_t(T));
    for (int64_t t = 0; t < T; ++t) quantize_row(scalar.act_type, random_row(rng, n).data(), act.data() + t * act_bytes, n);
    std::vector<float> got(static_cast<size_t>(T * rows)), want(static_cast<size_t>(rows));
    gemm(n, w.data(), row_bytes, rows, act.data(), act_bytes, T, got.data(), rows);
    for (int64_t t = 0; t < T; ++t) {
      scalar.dot_rows(n, w.data(), row_bytes, rows, act.data() + t * act_bytes, want.data());
      for (int64_t r = 0; r < rows; ++r) EXPECT_EQ(got[size_t(t * rows + r)], want[size_t(r)]) << dtype_name(wt) << " t " << t << " r " << r;
    }
    ++checked;
  }
  const CpuFeatures& f = cpu_features();
  if (f.avx512f && f.avx512bw && f.avx512vl && f.avx512_vnni) {
    EXPECT_GE(checked, 10);
  }
}

TEST(DotKernel, BestIsaIsTheFirstListed) {
  for (DType wt : {DType::F32, DType::Q4_0, DType::Q4_K, DType::Q6_K}) {
    auto isas = dot_kernel_isas(wt);
    ASSERT_FALSE(isas.empty());
    EXPECT_STREQ(dot_kernel(wt).isa, isas.front());
    EXPECT_STREQ(isas.back(), "scalar");
  }
  EXPECT_EQ(dot_kernel_for_isa(DType::Q4_0, "neon"), nullptr);
  const CpuFeatures& f = cpu_features();
  if (f.avx512bw && f.avx512vl && f.avx512_vnni) {
    EXPECT_STREQ(dot_kernel(DType::Q4_K).isa, "avx512");
  } else if (f.avx2 && f.fma) {
    EXPECT_STREQ(dot_kernel(DType::Q4_K).isa, "avx2");
  }
  EXPECT_TRUE(dot_kernel_isas(DType::Q8_K).empty());
}

}  // namespace
}  // namespace ferrum::quant
