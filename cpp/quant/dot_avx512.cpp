// AVX-512 (F/BW/VL + VNNI) dot kernels. Integer dot products use vpdpbusd (unsigned x signed
// bytes) with the weight quants kept unsigned and the zero point removed through the activation
// sum, and vpdpwssd to apply the k-quant sub-block scales.
#include <algorithm>
#include <cstddef>
#include <cstring>
#include <vector>

#include "quant/avx512_common.h"
#include "quant/formats.h"
#include "quant/kernels.h"

namespace ferrum::quant::detail {

namespace {

// ---- float weights against f32 activations; the tail is a masked load ----

FERRUM_AVX512 inline __m512 load16_f32(const float* p, __mmask16 m) {
  return _mm512_maskz_loadu_ps(m, p);
}
FERRUM_AVX512 inline __m512 load16_f16(const uint16_t* p, __mmask16 m) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}
FERRUM_AVX512 inline __m512 load16_bf16(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

template <class T, __m512 (*Load16)(const T*, __mmask16)>
FERRUM_AVX512 float dot_float(int64_t n, const void* w, const void* act) {
  const T* x = static_cast<const T*>(w);
  const float* a = static_cast<const float*>(act);
  const __mmask16 all = 0xffff;
  __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    acc0 = _mm512_fmadd_ps(Load16(x + i, all), _mm512_loadu_ps(a + i), acc0);
    acc1 = _mm512_fmadd_ps(Load16(x + i + 16, all), _mm512_loadu_ps(a + i + 16), acc1);
    acc2 = _mm512_fmadd_ps(Load16(x + i + 32, all), _mm512_loadu_ps(a + i + 32), acc2);
    acc3 = _mm512_fmadd_ps(Load16(x + i + 48, all), _mm512_loadu_ps(a + i + 48), acc3);
  }
  for (; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? all : __mmask16((1u << (n - i)) - 1);
    acc0 = _mm512_fmadd_ps(Load16(x + i, m), _mm512_maskz_loadu_ps(m, a + i), acc0);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc0, acc1), _mm512_add_ps(acc2, acc3)));
}

// ---- legacy formats against Q8_0, two blocks per 512-bit register ----

// A block's 32 quants as unsigned bytes in element order (Q8_0: w + 128).
template <class Block, int kBits>
FERRUM_AVX512_INLINE __m256i unsigned_quants(const Block& b) {
  if constexpr (kBits == 8) {
    return _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qs)),
                            _mm256_set1_epi8(char(0x80)));
  } else {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b.qs));
    __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(x, 4), x), _mm256_set1_epi8(15));
    if constexpr (kBits == 5) {
      uint32_t bits;
      std::memcpy(&bits, b.qh, 4);
      q = _mm256_mask_or_epi32(q, 0xff, q, _mm256_maskz_set1_epi8(bits, 0x10));
    }
    return q;
  }
}

FERRUM_AVX512_INLINE __m512i pair(__m256i lo, __m256i hi) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}
FERRUM_AVX512_INLINE __m512 pair(float lo, float hi) {
  return _mm512_insertf32x8(_mm512_set1_ps(lo), _mm256_set1_ps(hi), 1);
}
FERRUM_AVX512_INLINE __m256i load_act(const BlockQ8_0& b) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qs));
}

// Blocks 2p and 2p + 1 of a row as one 512-bit register pair: lanes 0-7 hold block 2p, lanes
// 8-15 block 2p + 1 (zero past an odd last block). Every field of the 4/5-bit formats is 16-bit
// aligned and two blocks span at most 48 bytes, so one load (masked at the end of a row) and
// word permutes place quants and scales; this replaces ~9 scalar scale conversions and inserts
// per pair with 3 vector operations. (Q8_0 only uses quants().)
template <class Block, int kBits>
struct BlockPairs {
  static constexpr int kSize = int(sizeof(Block));
  __m512i quant_words, nibble_shift, scale_words, min_words;

  FERRUM_AVX512 BlockPairs() {
    alignas(64) int16_t q[32], sh[32], d[32], m[32];
    for (int j = 0; j < 32; ++j) {
      const int block = j / 16, in_block = j % 16;
      q[j] = int16_t(block * kSize / 2 + int(offsetof(Block, qs)) / 2 + in_block % 8);
      sh[j] = int16_t(in_block < 8 ? 0 : 4);  // words 8..15 of a block: the high nibbles
      d[j] = int16_t(j < 8 ? 0 : kSize / 2);  // d is every format's first field
      m[j] = int16_t(d[j] + 1);               // m follows d (Q4_1, Q5_1)
    }
    quant_words = _mm512_load_si512(q);
    nibble_shift = _mm512_load_si512(sh);
    scale_words = _mm512_load_si512(d);
    min_words = _mm512_load_si512(m);
  }
  // plain: the 64 bytes from b lie inside the weights, so no mask is needed (two single-thread
  // benchmarks at once: Q4_1 14 -> 15-16 GB/s each with plain loads on Zen 4).
  FERRUM_AVX512_INLINE __m512i load(const Block* b, bool both, bool plain) const {
    if (plain) return _mm512_loadu_si512(b);
    const int bytes = both ? 2 * kSize : kSize;
    return _mm512_maskz_loadu_epi8(bytes >= 64 ? ~__mmask64(0) : (__mmask64(1) << bytes) - 1, b);
  }
  // The two blocks' 32 quants each as unsigned bytes in element order (Q8_0: w + 128).
  FERRUM_AVX512_INLINE __m512i quants(const Block* b, const __m512i& v, bool both) const {
    if constexpr (kBits == 8) {
      const __m512i q = pair(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b[0].qs)),
                             both ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b[1].qs))
                                  : _mm256_set1_epi8(char(0x80)));
      return _mm512_xor_si512(q, _mm512_set1_epi8(char(0x80)));
    } else {
      __m512i q = _mm512_and_si512(_mm512_srlv_epi16(_mm512_permutexvar_epi16(quant_words, v), nibble_shift),
                                   _mm512_set1_epi8(15));
      if constexpr (kBits == 5) {
        uint32_t lo, hi = 0;
        std::memcpy(&lo, b[0].qh, 4);
        if (both) std::memcpy(&hi, b[1].qh, 4);
        q = _mm512_or_si512(q, _mm512_maskz_set1_epi8(__mmask64(lo) | __mmask64(hi) << 32, 0x10));
      }
      return q;
    }
  }
  FERRUM_AVX512_INLINE __m512 scales(const __m512i& v) const { return halves_to_floats(scale_words, v); }
  FERRUM_AVX512_INLINE __m512 mins(const __m512i& v) const { return halves_to_floats(min_words, v); }

 private:
  FERRUM_AVX512_INLINE static __m512 halves_to_floats(const __m512i& words, const __m512i& v) {
    return _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi16(words, v)));
  }
};

// The final sum of the accumulator chains, in one order for the row and batched kernels.
template <bool kHasMin>
FERRUM_AVX512_INLINE float legacy_total(__m512 acc0, __m512 acc1, __m512 acc_min0, __m512 acc_min1) {
  if constexpr (kHasMin)
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc0, acc1), _mm512_add_ps(acc_min0, acc_min1)));
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

// Activation blocks 2i and 2i + 1 of a Q8_0 row (zero past an odd last block): their signed
// quants, d_a over 8 lanes each, and the 16 lane sums of a. Both legacy kernels prepare their
// activations from it, and take the min formats' term d_a * sums from min_term(), so they
// round alike.
struct ActPair {
  __m512i quants, sums;
  __m512 scales;
  FERRUM_AVX512_INLINE __m512 min_term() const { return _mm512_mul_ps(_mm512_cvtepi32_ps(sums), scales); }
};

FERRUM_AVX512_INLINE ActPair act_pair(const BlockQ8_0* y, int64_t nb, int64_t i) {
  const bool both = 2 * i + 1 < nb;
  ActPair p;
  p.quants = pair(load_act(y[2 * i]), both ? load_act(y[2 * i + 1]) : _mm256_setzero_si256());
  p.sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), p.quants);
  p.scales = pair(h2f(y[2 * i].d), both ? h2f(y[2 * i + 1].d) : 0.0f);
  return p;
}

// One activation row prepared once per call for the row kernel, per block pair (act_pair): its
// signed quants, d_a, and the zero-point term -zero * lane sums of a (the integer dot product's
// start) or, for the min formats, the min term.
struct RowActs {
  std::vector<__m512i> quants, zero_terms;
  std::vector<__m512> scales, min_terms;
};

// Raw pointers into RowActs for the kernel loop (the vectors are thread_local).
struct RowActView {
  const __m512i *quants, *zero_terms;
  const __m512 *scales, *min_terms;
};

template <int kOffsetShift, bool kHasMin>
FERRUM_AVX512 void prepare_row_acts(int64_t nb, const BlockQ8_0* y, RowActs& p) {
  const int64_t np = (nb + 1) / 2;
  p.quants.resize(size_t(np));
  p.scales.resize(size_t(np));
  if constexpr (kHasMin) p.min_terms.resize(size_t(np));
  else p.zero_terms.resize(size_t(np));
  for (int64_t i = 0; i < np; ++i) {
    const ActPair a = act_pair(y, nb, i);
    p.quants[i] = a.quants;
    p.scales[i] = a.scales;
    if constexpr (kHasMin) p.min_terms[i] = a.min_term();
    else p.zero_terms[i] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(a.sums, kOffsetShift));
  }
}

// Block pair i of row x into one accumulator chain.
template <class Block, int kBits, bool kHasMin>
FERRUM_AVX512_INLINE void row_pair_step(const BlockPairs<Block, kBits>& pairs, const Block* x, int64_t nb,
                                        int64_t plain_pairs, int64_t i, const RowActView& p, __m512& acc,
                                        __m512& acc_min) {
  const Block* b = x + 2 * i;
  const bool both = 2 * i + 1 < nb;
  // Q8_0's pair spans 68 bytes: its quants are two loads and its scales two scalar conversions
  // (a third, overlapping load for the scales cost ~20% of decode speed on DRAM-bound models).
  const __m512i v = kBits == 8 ? _mm512_setzero_si512() : pairs.load(b, both, both && i < plain_pairs);
  const __m512i start = kHasMin ? _mm512_setzero_si512() : p.zero_terms[i];
  const __m512i sum_qa = _mm512_dpbusd_epi32(start, pairs.quants(b, v, both), p.quants[i]);
  const __m512 dw = kBits == 8 ? pair(h2f(b[0].d), both ? h2f(b[1].d) : 0.0f) : pairs.scales(v);
  const __m512 scale = _mm512_mul_ps(dw, p.scales[i]);
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum_qa), scale, acc);
  if constexpr (kHasMin) acc_min = _mm512_fmadd_ps(p.min_terms[i], pairs.mins(v), acc_min);
}

// Rows of legacy weights against one Q8_0 activation row. Block pair p goes to accumulator
// chain p % 2 for the first nb / 4 * 2 pairs and to chain 0 after them; the batched kernel
// below keeps exactly this float order, so its results equal these bit for bit.
template <class Block, int kBits, int kOffsetShift, bool kHasMin>
FERRUM_AVX512 void dot_rows_legacy(int64_t n, const void* w, size_t w_row_bytes, int64_t rows,
                                   const void* act, float* out) {
  const int64_t nb = n / kQK, np = (nb + 1) / 2, two_chain_pairs = nb / 4 * 2;
  thread_local RowActs acts;
  prepare_row_acts<kOffsetShift, kHasMin>(nb, static_cast<const BlockQ8_0*>(act), acts);
  const RowActView p{acts.quants.data(), acts.zero_terms.data(), acts.scales.data(), acts.min_terms.data()};
  const BlockPairs<Block, kBits> pairs;
  // Pairs whose 64-byte load ends inside the row (the last row's tail must not be read past).
  const int64_t row_bytes = nb * int64_t(sizeof(Block));
  const int64_t plain_pairs = row_bytes >= 64 ? (row_bytes - 64) / (2 * int64_t(sizeof(Block))) + 1 : 0;
  for (int64_t r = 0; r < rows; ++r) {
    const Block* x = reinterpret_cast<const Block*>(static_cast<const char*>(w) + r * w_row_bytes);
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()}, acc_min[2] = {acc[0], acc[0]};
    int64_t i = 0;
    for (; i < two_chain_pairs; i += 2) {
      row_pair_step<Block, kBits, kHasMin>(pairs, x, nb, plain_pairs, i, p, acc[0], acc_min[0]);
      row_pair_step<Block, kBits, kHasMin>(pairs, x, nb, plain_pairs, i + 1, p, acc[1], acc_min[1]);
    }
    for (; i < np; ++i) row_pair_step<Block, kBits, kHasMin>(pairs, x, nb, plain_pairs, i, p, acc[0], acc_min[0]);
    out[r] = legacy_total<kHasMin>(acc[0], acc[1], acc_min[0], acc_min[1]);
  }
}

// ---- legacy formats, many activation rows at once (a batch of decodes) ----
//
// Every result is bit-identical to dot_legacy's whatever the batch size (a sequence's logits do
// not depend on its batch): the integer dot products are exact however they are formed, and the
// float steps are dot_legacy's, in its order (pair p goes to chain p % 2 while dot_legacy's 4-block
// loop runs, to chain 0 after it). What differs is how the integers are formed: activations are
// made unsigned (a + 128) once per call and weights kept signed (q - zero point), so
// dpbusd(acts, weights) = sum(a * w) + 128 * sum(w); the second term depends on the weight row
// only and is subtracted by starting the accumulator at -128 * sum(w). Each weight pair is
// unpacked once for a register block of kRows weight rows x kActs activation rows.

struct PreparedActs {
  int64_t np = 0;               // block pairs per row
  std::vector<__m512i> quants;  // [T][np]: a + 128 of blocks 2p, 2p + 1 (zero past the end)
  std::vector<__m512> scales;   // [T][np]: d_a of the two blocks, each over 8 lanes
  std::vector<__m512> min_terms;  // [T][np]: d_a * lane sums of a (min formats only)
};

template <bool kHasMin>
FERRUM_AVX512 void prepare_acts(int64_t nb, const void* act, size_t act_row_bytes, int64_t T,
                                PreparedActs& p) {
  const int64_t np = (nb + 1) / 2;
  p.np = np;
  p.quants.resize(size_t(T * np));
  p.scales.resize(size_t(T * np));
  if (kHasMin) p.min_terms.resize(size_t(T * np));
  for (int64_t t = 0; t < T; ++t) {
    const BlockQ8_0* y = reinterpret_cast<const BlockQ8_0*>(static_cast<const char*>(act) + t * act_row_bytes);
    for (int64_t i = 0; i < np; ++i) {
      const size_t k = size_t(t * np + i);
      const ActPair a = act_pair(y, nb, i);
      p.quants[k] = _mm512_xor_si512(a.quants, _mm512_set1_epi8(char(0x80)));
      p.scales[k] = a.scales;
      if constexpr (kHasMin) p.min_terms[k] = a.min_term();
    }
  }
}

// A block's 32 quants as signed bytes, minus the zero point for the symmetric formats.
template <class Block, int kBits, int kOffsetShift, bool kHasMin>
FERRUM_AVX512_INLINE __m256i signed_quants(const Block& b) {
  if constexpr (kBits == 8) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qs));
  const __m256i q = unsigned_quants<Block, kBits>(b);
  if constexpr (kHasMin) return q;
  return _mm256_sub_epi8(q, _mm256_set1_epi8(char(1 << kOffsetShift)));
}

// The pairs of accumulator chain c, in order.
template <class F>
inline void for_each_chain_pair(int c, int64_t np, int64_t two_chain_pairs, F&& f) {
  for (int64_t i = c; i < two_chain_pairs; i += 2) f(i);
  if (c == 0)
    for (int64_t i = two_chain_pairs; i < np; ++i) f(i);
}

// out[t][r] for kRows weight rows x kActs activation rows (from t0).
template <class Block, int kBits, int kOffsetShift, bool kHasMin, int kRows, int kActs>
FERRUM_AVX512 void legacy_block(int64_t nb, const char* w, size_t w_row_bytes, const PreparedActs& p,
                                int64_t t0, float* out, int64_t ldo) {
  const int64_t np = p.np, two_chain_pairs = nb / 4 * 2;
  const Block* x[kRows];
  for (int r = 0; r < kRows; ++r) x[r] = reinterpret_cast<const Block*>(w + r * w_row_bytes);
  __m512 chain[2][kRows][kActs], chain_min[2][kRows][kActs];
  for (int c = 0; c < 2; ++c) {
    __m512 acc[kRows][kActs];
    for (auto& row : acc)
      for (auto& v : row) v = _mm512_setzero_ps();
    for_each_chain_pair(c, np, two_chain_pairs, [&](int64_t i) {
      const bool both = 2 * i + 1 < nb;
      __m512i q[kRows], offset[kRows];
      __m512 dw[kRows];
      for (int r = 0; r < kRows; ++r) {
        const Block* b = x[r] + 2 * i;
        q[r] = pair(signed_quants<Block, kBits, kOffsetShift, kHasMin>(b[0]),
                    both ? signed_quants<Block, kBits, kOffsetShift, kHasMin>(b[1]) : _mm256_setzero_si256());
        const __m512i sum_w = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), q[r]);
        offset[r] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sum_w, 7));
        dw[r] = pair(h2f(b[0].d), both ? h2f(b[1].d) : 0.0f);
      }
      for (int j = 0; j < kActs; ++j) {
        const size_t k = size_t((t0 + j) * np + i);
        const __m512i a = p.quants[k];
        const __m512 da = p.scales[k];
        for (int r = 0; r < kRows; ++r) {
          const __m512i sum_qa = _mm512_dpbusd_epi32(offset[r], a, q[r]);
          acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum_qa), _mm512_mul_ps(dw[r], da), acc[r][j]);
        }
      }
    });
    std::memcpy(chain[c], acc, sizeof(acc));
    if constexpr (kHasMin) {  // its own pass: fewer live registers
      for (auto& row : acc)
        for (auto& v : row) v = _mm512_setzero_ps();
      for_each_chain_pair(c, np, two_chain_pairs, [&](int64_t i) {
        const bool both = 2 * i + 1 < nb;
        __m512 m[kRows];
        for (int r = 0; r < kRows; ++r) m[r] = pair(h2f(x[r][2 * i].m), both ? h2f(x[r][2 * i + 1].m) : 0.0f);
        for (int j = 0; j < kActs; ++j) {
          const __m512 s = p.min_terms[size_t((t0 + j) * np + i)];
          for (int r = 0; r < kRows; ++r) acc[r][j] = _mm512_fmadd_ps(s, m[r], acc[r][j]);
        }
      });
      std::memcpy(chain_min[c], acc, sizeof(acc));
    }
  }
  for (int j = 0; j < kActs; ++j)
    for (int r = 0; r < kRows; ++r)
      out[(t0 + j) * ldo + r] = legacy_total<kHasMin>(chain[0][r][j], chain[1][r][j],
                                                      chain_min[0][r][j], chain_min[1][r][j]);
}

// kRows weight rows against activation rows t0.., in blocks of kActs then smaller ones.
template <class Block, int kBits, int kOffsetShift, bool kHasMin, int kRows, int kActs>
FERRUM_AVX512 void legacy_rows(int64_t nb, const char* w, size_t w_row_bytes, const PreparedActs& p,
                               int64_t t0, int64_t T, float* out, int64_t ldo) {
  for (; t0 + kActs <= T; t0 += kActs)
    legacy_block<Block, kBits, kOffsetShift, kHasMin, kRows, kActs>(nb, w, w_row_bytes, p, t0, out, ldo);
  if constexpr (kActs > 1)
    if (t0 < T) legacy_rows<Block, kBits, kOffsetShift, kHasMin, kRows, kActs / 2>(nb, w, w_row_bytes, p, t0, T, out, ldo);
}

template <class Block, int kBits, int kOffsetShift, bool kHasMin>
FERRUM_AVX512 void dot_batch_legacy(int64_t n, const void* w, size_t w_row_bytes, int64_t rows,
                                    const void* act, size_t act_row_bytes, int64_t T, float* out,
                                    int64_t ldo) {
  // 2 x 8 accumulators per pass; measured faster than 4 x 4, 1 x 16 and 2 x 4 (quant_dot_bench).
  constexpr int kRows = 2, kActs = 8;
  const int64_t nb = n / kQK;
  thread_local PreparedActs p;
  prepare_acts<kHasMin>(nb, act, act_row_bytes, T, p);
  const char* wp = static_cast<const char*>(w);
  int64_t r = 0;
  for (; r + kRows <= rows; r += kRows)
    legacy_rows<Block, kBits, kOffsetShift, kHasMin, kRows, kActs>(nb, wp + r * w_row_bytes, w_row_bytes, p, 0, T, out + r, ldo);
  for (; r < rows; ++r)
    legacy_rows<Block, kBits, kOffsetShift, kHasMin, 1, kActs>(nb, wp + r * w_row_bytes, w_row_bytes, p, 0, T, out + r, ldo);
}

// ---- legacy weights x Q8_0 activations, many activation rows (prefill): an int8 GEMM ----
//
// Weight rows go across the lanes, kGemmRows at a time, packed once per tile as their unsigned
// quants q (Q8_0: w + 128) in dpbusd's layout: for block b and 4-element group g, one register
// holds elements 4g..4g+3 of 16 rows. An activation row's 4 bytes are broadcast against it, so
// each packed register serves kGemmActs activation rows and there is no horizontal sum.
// dpbusd gives sum(q * a); the zero point's -zero * sum(a) is the accumulator's start, and the
// min formats add m * (d_a * sum(a)). Each output's arithmetic is the same whatever T and its
// place in the tile, so a row's result does not depend on its batch.

constexpr int kGemmVecs = 2;               // 16-row weight registers per tile
constexpr int kGemmRows = 16 * kGemmVecs;  // weight rows per tile
constexpr int kGemmActs = 4;               // activation rows per register block

struct PackedTile {
  std::vector<__m512i> quants;  // [nb][8 groups][kGemmVecs]
  std::vector<float> scales;    // [nb][kGemmRows] (zero for rows past the end)
  std::vector<float> mins;      // [nb][kGemmRows] (min formats)
};

struct GemmActs {  // per activation row and block
  std::vector<const BlockQ8_0*> rows;
  std::vector<float> scales;       // d_a
  std::vector<int32_t> offsets;    // -zero * sum(a)
  std::vector<float> min_terms;    // d_a * sum(a) (min formats)
};

template <class Block, int kBits, bool kHasMin>
FERRUM_AVX512 void pack_tile(const char* w, size_t w_row_bytes, int64_t rows, int64_t nb, PackedTile& tile) {
  tile.quants.resize(size_t(nb * 8 * kGemmVecs));
  tile.scales.assign(size_t(nb * kGemmRows), 0.0f);
  if (kHasMin) tile.mins.assign(size_t(nb * kGemmRows), 0.0f);
  alignas(64) int32_t groups[8][kGemmRows];  // one block: [group][row]
  for (int64_t b = 0; b < nb; ++b) {
    std::memset(groups, 0, sizeof(groups));
    for (int64_t r = 0; r < rows; ++r) {
      const Block& blk = reinterpret_cast<const Block*>(w + r * w_row_bytes)[b];
      alignas(32) int32_t q[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(q), unsigned_quants<Block, kBits>(blk));
      for (int g = 0; g < 8; ++g) groups[g][r] = q[g];
      tile.scales[size_t(b * kGemmRows + r)] = h2f(blk.d);
      if constexpr (kHasMin) tile.mins[size_t(b * kGemmRows + r)] = h2f(blk.m);
    }
    for (int g = 0; g < 8; ++g)
      for (int v = 0; v < kGemmVecs; ++v)
        tile.quants[size_t((b * 8 + g) * kGemmVecs + v)] = _mm512_load_si512(&groups[g][16 * v]);
  }
}

// kActs activation rows from t0 against a packed tile.
template <bool kHasMin, int kActs>
FERRUM_AVX512 void gemm_block(int64_t nb, const PackedTile& tile, const GemmActs& acts, int64_t t0,
                              float* out, int64_t ldo, int64_t rows) {
  __m512 acc[kActs][kGemmVecs];
  for (auto& a : acc)
    for (auto& v : a) v = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i sum[kActs][kGemmVecs];
    for (int j = 0; j < kActs; ++j)
      for (int v = 0; v < kGemmVecs; ++v) sum[j][v] = _mm512_set1_epi32(acts.offsets[size_t((t0 + j) * nb + b)]);
    const __m512i* q = &tile.quants[size_t(b * 8 * kGemmVecs)];
    for (int g = 0; g < 8; ++g) {
      for (int j = 0; j < kActs; ++j) {
        int32_t a4;
        std::memcpy(&a4, acts.rows[size_t(t0 + j)][b].qs + 4 * g, 4);
        const __m512i a = _mm512_set1_epi32(a4);
        for (int v = 0; v < kGemmVecs; ++v) sum[j][v] = _mm512_dpbusd_epi32(sum[j][v], q[g * kGemmVecs + v], a);
      }
    }
    for (int j = 0; j < kActs; ++j) {
      const size_t k = size_t((t0 + j) * nb + b);
      const __m512 d_act = _mm512_set1_ps(acts.scales[k]);
      for (int v = 0; v < kGemmVecs; ++v) {
        const __m512 scale = _mm512_mul_ps(_mm512_loadu_ps(&tile.scales[size_t(b * kGemmRows + 16 * v)]), d_act);
        acc[j][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[j][v]), scale, acc[j][v]);
        if constexpr (kHasMin)
          acc[j][v] = _mm512_fmadd_ps(_mm512_loadu_ps(&tile.mins[size_t(b * kGemmRows + 16 * v)]),
                                      _mm512_set1_ps(acts.min_terms[k]), acc[j][v]);
      }
    }
  }
  for (int j = 0; j < kActs; ++j)
    for (int v = 0; v < kGemmVecs; ++v) {
      const int64_t left = rows - 16 * v;
      if (left <= 0) break;
      const __mmask16 m = left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
      _mm512_mask_storeu_ps(out + (t0 + j) * ldo + 16 * v, m, acc[j][v]);
    }
}

template <class Block, int kBits, int kOffsetShift, bool kHasMin>
FERRUM_AVX512 void gemm_legacy(int64_t n, const void* w, size_t w_row_bytes, int64_t rows,
                               const void* act, size_t act_row_bytes, int64_t T, float* out,
                               int64_t ldo) {
  const int64_t nb = n / kQK;
  const int32_t zero = kHasMin ? 0 : 1 << kOffsetShift;
  thread_local PackedTile tile;
  thread_local GemmActs acts;
  acts.rows.resize(size_t(T));
  acts.scales.resize(size_t(T * nb));
  acts.offsets.resize(size_t(T * nb));
  if (kHasMin) acts.min_terms.resize(size_t(T * nb));
  for (int64_t t = 0; t < T; ++t) {
    const BlockQ8_0* y = reinterpret_cast<const BlockQ8_0*>(static_cast<const char*>(act) + t * act_row_bytes);
    acts.rows[size_t(t)] = y;
    for (int64_t b = 0; b < nb; ++b) {
      const __m256i lanes = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(1), load_act(y[b]));
      const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(lanes), _mm256_extracti128_si256(lanes, 1));
      const __m128i s2 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
      const int32_t sum_a = _mm_cvtsi128_si32(s2) + _mm_extract_epi32(s2, 1);
      const size_t k = size_t(t * nb + b);
      acts.scales[k] = h2f(y[b].d);
      acts.offsets[k] = -zero * sum_a;
      if constexpr (kHasMin) acts.min_terms[k] = acts.scales[k] * float(sum_a);
    }
  }
  for (int64_t r0 = 0; r0 < rows; r0 += kGemmRows) {
    const int64_t tile_rows = std::min<int64_t>(kGemmRows, rows - r0);
    pack_tile<Block, kBits, kHasMin>(static_cast<const char*>(w) + r0 * w_row_bytes, w_row_bytes, tile_rows, nb, tile);
    int64_t t = 0;
    for (; t + kGemmActs <= T; t += kGemmActs)
      gemm_block<kHasMin, kGemmActs>(nb, tile, acts, t, out + r0, ldo, tile_rows);
    for (; t < T; ++t) gemm_block<kHasMin, 1>(nb, tile, acts, t, out + r0, ldo, tile_rows);
  }
}

// ---- k-quants against Q8_K ----


// sum_j mins[j] * (bsums[2j] + bsums[2j + 1]) as 8 int32 lanes.
FERRUM_AVX512 inline __m256i min_terms(uint64_t mins, const int16_t* bsums) {
  __m256i m32 = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(mins)));
  m32 = _mm256_or_si256(m32, _mm256_slli_epi32(m32, 16));
  return _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bsums)), m32);
}

// int16 lane indices selecting scale 2c for the low 16 words and 2c + 1 for the high 16.
FERRUM_AVX512 inline __m512i scale_pair_index(int c) {
  return _mm512_inserti64x4(_mm512_set1_epi16(short(2 * c)), _mm256_set1_epi16(short(2 * c + 1)),
                            1);
}

// Each 32 bytes of qs are broadcast to both halves and shifted by 0 / 4 per half, which yields
// sub-blocks 2c and 2c + 1 in element order against 64 contiguous activation bytes.
template <bool kFiveBit, class Block>
FERRUM_AVX512 float dot_k4(int64_t n, const void* w, const void* act) {
  const Block* x = static_cast<const Block*>(w);
  const BlockQ8_K* y = static_cast<const BlockQ8_K*>(act);
  const __m512i low4 = _mm512_set1_epi8(15), fifth = _mm512_set1_epi8(0x10);
  const __m512i nibble_shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
  const __m512i index[4] = {scale_pair_index(0), scale_pair_index(1), scale_pair_index(2),
                            scale_pair_index(3)};
  __m512 acc = _mm512_setzero_ps();
  __m256 acc_min = _mm256_setzero_ps();
  for (int64_t i = 0; i < n / kQKK; ++i) {
    uint64_t scales, mins;
    unpack_k4_scales(x[i].scales, scales, mins);
    const __m512i scales16 =
        _mm512_cvtepu8_epi16(_mm256_zextsi128_si256(_mm_cvtsi64_si128(int64_t(scales))));
    __m512i qh;
    if constexpr (kFiveBit) qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[i].qh)));
    __m512i isum = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {
      const __m512i both = _mm512_broadcast_i64x4(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[i].qs + 32 * c)));
      __m512i q = _mm512_and_si512(_mm512_srlv_epi16(both, nibble_shift), low4);
      if constexpr (kFiveBit) {
        const __m512i bit = _mm512_inserti64x4(_mm512_set1_epi8(char(1 << (2 * c))),
                                               _mm256_set1_epi8(char(2 << (2 * c))), 1);
        q = _mm512_mask_or_epi32(q, 0xffff, q,
                                 _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(qh, bit), fifth));
      }
      const __m512i a = _mm512_loadu_si512(y[i].qs + 64 * c);
      const __m512i scale = _mm512_permutexvar_epi16(index[c], scales16);
      isum = _mm512_dpwssd_epi32(isum, _mm512_maddubs_epi16(q, a), scale);
    }
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(h2f(x[i].d) * y[i].d), acc);
    acc_min = _mm256_fmadd_ps(_mm256_cvtepi32_ps(min_terms(mins, y[i].bsums)),
                              _mm256_set1_ps(h2f(x[i].dmin) * y[i].d), acc_min);
  }
  __m256 lo = _mm512_castps512_ps256(acc);
  __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1));
  const __m256 total = _mm256_sub_ps(_mm256_add_ps(lo, hi), acc_min);
  return _mm512_reduce_add_ps(_mm512_zextps256_ps512(total));
}

// Q6_K: per half, 64 ql bytes give groups 0,1 (low nibbles) and 2,3 (high nibbles) in element
// order; qh is paired with qh >> 2 so each group's 2-bit field sits at the same bit position.
FERRUM_AVX512 float dot_q6_k(int64_t n, const void* w, const void* act) {
  const BlockQ6_K* x = static_cast<const BlockQ6_K*>(w);
  const BlockQ8_K* y = static_cast<const BlockQ8_K*>(act);
  const __m512i low4 = _mm512_set1_epi8(15), bits45 = _mm512_set1_epi8(0x30);
  // Word k of a 64-element group belongs to 16-element sub-block k / 8 of that group.
  __m512i index[4];
  for (int k = 0; k < 4; ++k) {
    alignas(64) int16_t idx[32];
    for (int j = 0; j < 32; ++j) idx[j] = int16_t(4 * k + j / 8);
    index[k] = _mm512_load_si512(idx);
  }
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n / kQKK; ++i) {
    const __m256i scales16 =
        _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x[i].scales)));
    const __m256i zero_point = _mm256_slli_epi32(
        _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(y[i].bsums)),
                          scales16),
        5);
    const __m512i scales512 = _mm512_castsi256_si512(scales16);
    __m512i isum = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_zextsi256_si512(zero_point));
    for (int h = 0; h < 2; ++h) {
      const __m512i ql = _mm512_loadu_si512(x[i].ql + 64 * h);
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[i].qh + 32 * h));
      const __m512i qh2 = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
      const __m512i q_lo = _mm512_or_si512(_mm512_and_si512(ql, low4),
                                           _mm512_and_si512(_mm512_slli_epi16(qh2, 4), bits45));
      const __m512i q_hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4),
                                           _mm512_and_si512(qh2, bits45));
      const __m512i a_lo = _mm512_loadu_si512(y[i].qs + 128 * h);
      const __m512i a_hi = _mm512_loadu_si512(y[i].qs + 128 * h + 64);
      isum = _mm512_dpwssd_epi32(isum, _mm512_maddubs_epi16(q_lo, a_lo),
                                 _mm512_permutexvar_epi16(index[2 * h], scales512));
      isum = _mm512_dpwssd_epi32(isum, _mm512_maddubs_epi16(q_hi, a_hi),
                                 _mm512_permutexvar_epi16(index[2 * h + 1], scales512));
    }
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(h2f(x[i].d) * y[i].d), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

}  // namespace

DotBatchFn avx512_dot_batch(DType t) {
  switch (t) {
    case DType::Q4_0: return dot_batch_legacy<BlockQ4_0, 4, 3, false>;
    case DType::Q4_1: return dot_batch_legacy<BlockQ4_1, 4, 0, true>;
    case DType::Q5_0: return dot_batch_legacy<BlockQ5_0, 5, 4, false>;
    case DType::Q5_1: return dot_batch_legacy<BlockQ5_1, 5, 0, true>;
    case DType::Q8_0: return dot_batch_legacy<BlockQ8_0, 8, 7, false>;
    default: return nullptr;
  }
}

DotBatchFn avx512_gemm(DType t) {
  switch (t) {
    case DType::Q4_0: return gemm_legacy<BlockQ4_0, 4, 3, false>;
    case DType::Q4_1: return gemm_legacy<BlockQ4_1, 4, 0, true>;
    case DType::Q5_0: return gemm_legacy<BlockQ5_0, 5, 4, false>;
    case DType::Q5_1: return gemm_legacy<BlockQ5_1, 5, 0, true>;
    case DType::Q8_0: return gemm_legacy<BlockQ8_0, 8, 7, false>;
    default: return avx512_gemm_kquant(t);
  }
}

DotRowsFn avx512_dot_rows(DType t) {
  switch (t) {
    case DType::F32: return for_each_row<dot_float<float, load16_f32>>;
    case DType::F16: return for_each_row<dot_float<uint16_t, load16_f16>>;
    case DType::BF16: return for_each_row<dot_float<uint16_t, load16_bf16>>;
    case DType::Q4_0: return dot_rows_legacy<BlockQ4_0, 4, 3, false>;
    case DType::Q4_1: return dot_rows_legacy<BlockQ4_1, 4, 0, true>;
    case DType::Q5_0: return dot_rows_legacy<BlockQ5_0, 5, 4, false>;
    case DType::Q5_1: return dot_rows_legacy<BlockQ5_1, 5, 0, true>;
    case DType::Q8_0: return dot_rows_legacy<BlockQ8_0, 8, 7, false>;
    case DType::Q4_K: return for_each_row<dot_k4<false, BlockQ4_K>>;
    case DType::Q5_K: return for_each_row<dot_k4<true, BlockQ5_K>>;
    case DType::Q6_K: return for_each_row<dot_q6_k>;
    default: return nullptr;
  }
}

}  // namespace ferrum::quant::detail
