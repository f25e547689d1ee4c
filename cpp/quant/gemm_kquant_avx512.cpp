// AVX-512 VNNI int8 GEMM for the k-quants (Q4_K, Q5_K, Q6_K) against Q8_K activations: what
// linear() runs for prefill. The layout follows gemm_legacy in dot_avx512.cpp: weight rows go
// across the lanes, kRows at a time, and for each 4-element group g one register holds elements
// 4g..4g+3 of 16 rows as unsigned quants; an activation row's 4 bytes are broadcast against it,
// so every packed register serves many activation rows and there is no horizontal sum.
//
// Per 256-element super-block, output (row, t) is computed as
//   isum = sum_s scale_s * (sum over sub-block s of q * a  [- 32 * bsum_s for Q6_K])   (int32)
//   acc += float(isum) * (d * d_a)
//   acc -= float(sum_s min_s * bsum_s) * (dmin * d_a)                   (Q4_K / Q5_K only)
// The integers are exact (|isum| < 2^29), and the float steps run in super-block order with the
// same operands whatever T or the output's place in a register block, so a row's result does not
// depend on its batch. Super-blocks are the outer loop: one packed super-block of a tile (8 KiB)
// stays in L1 while every activation row passes over it, into a float accumulator per output.
#include <algorithm>
#include <cstring>
#include <vector>

#include "quant/avx512_common.h"
#include "quant/formats.h"
#include "quant/kernels.h"

namespace ferrum::quant::detail {

namespace {

constexpr int kVecs = 2;           // 16-row weight registers per tile
constexpr int kRows = 16 * kVecs;  // weight rows per tile
constexpr int kActs = 4;           // activation rows per register block
constexpr int kGroups = kQKK / 4;  // 4-byte groups per super-block

// One super-block of a tile, ready for the multiply loop; lanes past the tile's rows are zero.
struct PackedSuperBlock {
  alignas(64) uint32_t quants[kGroups][kRows];  // unsigned quants, 4 per lane
  alignas(64) int32_t scales[16][kRows];        // sub-block scales (Q4_K / Q5_K use 8)
  alignas(64) int32_t min_pairs[4][kRows];      // Q4_K / Q5_K: mins 2k, 2k + 1 as int16 halves
  alignas(64) float d[kRows], dmin[kRows];
};

// Per activation row and super-block: the sub-block terms that need the activation sums.
struct KActs {
  std::vector<const BlockQ8_K*> rows;  // [T]
  std::vector<int32_t> terms;          // [T][nb][16], see prepare_acts
};

// The formats: a super-block's quants as 256 unsigned bytes in element order, its sub-block
// scales, and (Q4_K / Q5_K) mins.

FERRUM_AVX512 inline __m256i load32(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
FERRUM_AVX512 inline void store32(uint8_t* p, __m256i v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v);
}

// Q4_K / Q5_K: each 32 bytes of qs hold sub-block 2c in the low nibbles and 2c + 1 in the high
// ones; Q5_K's fifth bit of element l of those sub-blocks is bit 2c / 2c + 1 of qh[l].
template <class Block, bool kFiveBit>
struct K4Format {
  using BlockType = Block;
  static constexpr int kSubBlocks = 8;
  static constexpr bool kHasMin = true;

  FERRUM_AVX512 static void unpack(const Block& b, uint8_t* q) {
    const __m256i low4 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
    for (int c = 0; c < 4; ++c) {
      const __m256i x = load32(b.qs + 32 * c);
      __m256i lo = _mm256_and_si256(x, low4), hi = _mm256_and_si256(_mm256_srli_epi16(x, 4), low4);
      if constexpr (kFiveBit) {
        const __m256i qh = load32(b.qh);
        const __m256i bit_lo = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), one);
        const __m256i bit_hi = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * c + 1), one);
        lo = _mm256_or_si256(lo, _mm256_slli_epi16(bit_lo, 4));
        hi = _mm256_or_si256(hi, _mm256_slli_epi16(bit_hi, 4));
      }
      store32(q + 64 * c, lo);
      store32(q + 64 * c + 32, hi);
    }
  }

  FERRUM_AVX512 static void scales(const Block& b, int r, PackedSuperBlock& p) {
    uint64_t scales, mins;
    unpack_k4_scales(b.scales, scales, mins);
    for (int s = 0; s < kSubBlocks; ++s) p.scales[s][r] = int32_t((scales >> (8 * s)) & 0xff);
    for (int k = 0; k < 4; ++k)
      p.min_pairs[k][r] = int32_t((mins >> (16 * k)) & 0xff) | int32_t(((mins >> (16 * k + 8)) & 0xff) << 16);
    p.d[r] = h2f(b.d);
    p.dmin[r] = h2f(b.dmin);
  }
};

// Q6_K: each half (128 elements) takes 64 bytes of ql and 32 of qh; its four 32-element quarters
// are the low / high nibbles of ql[0..31] / ql[32..63] with successive 2-bit fields of qh on top.
// Quants stay unsigned (0..63); the -32 offset comes in through the activation sums.
struct Q6Format {
  using BlockType = BlockQ6_K;
  static constexpr int kSubBlocks = 16;
  static constexpr bool kHasMin = false;

  FERRUM_AVX512 static void unpack(const BlockQ6_K& b, uint8_t* q) {
    const __m256i low4 = _mm256_set1_epi8(15), two_bits = _mm256_set1_epi8(3 << 4);
    for (int h = 0; h < 2; ++h) {
      const __m256i ql0 = load32(b.ql + 64 * h), ql1 = load32(b.ql + 64 * h + 32);
      const __m256i qh = load32(b.qh + 32 * h);
      const __m256i lows[4] = {_mm256_and_si256(ql0, low4), _mm256_and_si256(ql1, low4),
                               _mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4),
                               _mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4)};
      // Quarter k's 2 high bits are bits 2k, 2k + 1 of qh; move them to bits 4, 5.
      const __m256i highs[4] = {_mm256_slli_epi16(qh, 4), _mm256_slli_epi16(qh, 2), qh, _mm256_srli_epi16(qh, 2)};
      for (int k = 0; k < 4; ++k)
        store32(q + 128 * h + 32 * k, _mm256_or_si256(lows[k], _mm256_and_si256(highs[k], two_bits)));
    }
  }

  FERRUM_AVX512 static void scales(const BlockQ6_K& b, int r, PackedSuperBlock& p) {
    for (int s = 0; s < kSubBlocks; ++s) p.scales[s][r] = b.scales[s];
    p.d[r] = h2f(b.d);
  }
};

// Super-block sb of `rows` (<= kRows) weight rows into p.
template <class F>
FERRUM_AVX512 void pack_super_block(const char* w, size_t w_row_bytes, int64_t rows, int64_t sb,
                                    PackedSuperBlock& p) {
  if (rows < kRows) std::memset(&p, 0, sizeof(p));
  for (int r = 0; r < rows; ++r) {
    const auto& blk = reinterpret_cast<const typename F::BlockType*>(w + r * w_row_bytes)[sb];
    alignas(64) uint32_t q[kGroups];
    F::unpack(blk, reinterpret_cast<uint8_t*>(q));
    for (int g = 0; g < kGroups; ++g) p.quants[g][r] = q[g];
    F::scales(blk, r, p);
  }
}

// terms[t][sb][.]: Q4_K / Q5_K: the 32-element sub-block sums of a (bsums 2j + 2j + 1) in int16
// pairs (sums 2k, 2k + 1 in term k), for the min term; Q6_K: -32 * bsums[s], where sub-block s's
// integer sum starts.
template <class F>
void prepare_acts(int64_t nb, const void* act, size_t act_row_bytes, int64_t T, KActs& acts) {
  acts.rows.resize(size_t(T));
  acts.terms.resize(size_t(T * nb * 16));
  for (int64_t t = 0; t < T; ++t) {
    const BlockQ8_K* y = reinterpret_cast<const BlockQ8_K*>(static_cast<const char*>(act) + t * act_row_bytes);
    acts.rows[size_t(t)] = y;
    for (int64_t sb = 0; sb < nb; ++sb) {
      int32_t* terms = &acts.terms[size_t((t * nb + sb) * 16)];
      const int16_t* bsums = y[sb].bsums;
      for (int s = 0; s < 16; ++s) {
        if constexpr (F::kHasMin) {
          if (s >= 4) break;
          const int lo = bsums[4 * s] + bsums[4 * s + 1], hi = bsums[4 * s + 2] + bsums[4 * s + 3];
          terms[s] = int32_t(uint32_t(uint16_t(lo)) | (uint32_t(uint16_t(hi)) << 16));
        } else {
          terms[s] = -32 * bsums[s];
        }
      }
    }
  }
}

FERRUM_AVX512 inline __m512i broadcast32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// Activation rows t0 .. t0 + kN - 1 against packed super-block sb, into acc[t][kRows].
template <class F, int kN>
FERRUM_AVX512 void multiply_block(const PackedSuperBlock& p, const KActs& acts, int64_t nb, int64_t sb,
                                  int64_t t0, float* acc) {
  constexpr int kGroupsPerSub = kGroups / F::kSubBlocks;
  const BlockQ8_K* y[kN];
  const int32_t* terms[kN];
  for (int j = 0; j < kN; ++j) {
    y[j] = acts.rows[size_t(t0 + j)] + sb;
    terms[j] = &acts.terms[size_t(((t0 + j) * nb + sb) * 16)];
  }
  __m512i isum[kN][kVecs];
  for (int s = 0; s < F::kSubBlocks; ++s) {
    __m512i sum[kN][kVecs];
    for (int j = 0; j < kN; ++j)
      for (int v = 0; v < kVecs; ++v)
        sum[j][v] = F::kHasMin ? _mm512_setzero_si512() : _mm512_set1_epi32(terms[j][s]);
    for (int g = s * kGroupsPerSub; g < (s + 1) * kGroupsPerSub; ++g) {
      __m512i q[kVecs];
      for (int v = 0; v < kVecs; ++v) q[v] = _mm512_load_si512(&p.quants[g][16 * v]);
      for (int j = 0; j < kN; ++j) {
        const __m512i a = broadcast32(y[j]->qs + 4 * g);
        for (int v = 0; v < kVecs; ++v) sum[j][v] = _mm512_dpbusd_epi32(sum[j][v], q[v], a);
      }
    }
    for (int v = 0; v < kVecs; ++v) {
      const __m512i scale = _mm512_load_si512(&p.scales[s][16 * v]);
      for (int j = 0; j < kN; ++j) {
        const __m512i scaled = _mm512_mullo_epi32(sum[j][v], scale);
        isum[j][v] = s == 0 ? scaled : _mm512_add_epi32(isum[j][v], scaled);
      }
    }
  }
  for (int j = 0; j < kN; ++j) {
    const __m512 d_act = _mm512_set1_ps(y[j]->d);
    float* out = acc + (t0 + j) * kRows;
    for (int v = 0; v < kVecs; ++v) {
      __m512 a = sb == 0 ? _mm512_setzero_ps() : _mm512_load_ps(out + 16 * v);
      a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[j][v]), _mm512_mul_ps(_mm512_load_ps(&p.d[16 * v]), d_act), a);
      if constexpr (F::kHasMin) {
        __m512i min_sum = _mm512_setzero_si512();
        for (int k = 0; k < 4; ++k)
          min_sum = _mm512_dpwssd_epi32(min_sum, _mm512_load_si512(&p.min_pairs[k][16 * v]), _mm512_set1_epi32(terms[j][k]));
        a = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(min_sum), _mm512_mul_ps(_mm512_load_ps(&p.dmin[16 * v]), d_act), a);
      }
      _mm512_store_ps(out + 16 * v, a);
    }
  }
}

template <class F>
FERRUM_AVX512 void gemm_kquant(int64_t n, const void* w, size_t w_row_bytes, int64_t rows, const void* act,
                               size_t act_row_bytes, int64_t T, float* out, int64_t ldo) {
  const int64_t nb = n / kQKK;
  thread_local KActs acts;
  thread_local PackedSuperBlock packed;
  thread_local std::vector<float> acc_buffer;
  prepare_acts<F>(nb, act, act_row_bytes, T, acts);
  acc_buffer.resize(size_t(T * kRows + 16));
  float* acc = acc_buffer.data();  // [T][kRows], 64-byte aligned
  acc += (64 - reinterpret_cast<uintptr_t>(acc) % 64) % 64 / sizeof(float);
  for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
    const int64_t tile_rows = std::min<int64_t>(kRows, rows - r0);
    for (int64_t sb = 0; sb < nb; ++sb) {
      pack_super_block<F>(static_cast<const char*>(w) + r0 * w_row_bytes, w_row_bytes, tile_rows, sb, packed);
      int64_t t = 0;
      for (; t + kActs <= T; t += kActs) multiply_block<F, kActs>(packed, acts, nb, sb, t, acc);
      for (; t < T; ++t) multiply_block<F, 1>(packed, acts, nb, sb, t, acc);
    }
    for (int64_t t = 0; t < T; ++t)
      for (int v = 0; v < kVecs && 16 * v < tile_rows; ++v) {
        const int64_t left = tile_rows - 16 * v;
        const __mmask16 keep = left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
        _mm512_mask_storeu_ps(out + t * ldo + r0 + 16 * v, keep, _mm512_load_ps(acc + t * kRows + 16 * v));
      }
  }
}

}  // namespace

DotBatchFn avx512_gemm_kquant(DType t) {
  switch (t) {
    case DType::Q4_K: return gemm_kquant<K4Format<BlockQ4_K, false>>;
    case DType::Q5_K: return gemm_kquant<K4Format<BlockQ5_K, true>>;
    case DType::Q6_K: return gemm_kquant<Q6Format>;
    default: return nullptr;
  }
}

}  // namespace ferrum::quant::detail
