// AVX-512 VNNI int8 GEMM for the k-quants (Q2_K .. Q6_K) against Q8_K activations: what
// linear() runs for prefill. The layout follows gemm_legacy in dot_avx512.cpp: weight rows go
// across the lanes, kRows at a time, and for each 4-element group g one register holds elements
// 4g..4g+3 of 16 rows as unsigned quants; an activation row's 4 bytes are broadcast against it,
// so every packed register serves many activation rows and there is no horizontal sum.
//
// Per 256-element super-block, output (row, t) is computed as
//   isum = sum_s scale_s * (sum over sub-block s of q * a  - zero point * bsum_s)    (int32)
//   acc += float(isum) * (d * d_a)
//   acc -= float(sum_s min_s * bsum_s) * (dmin * d_a)                (Q2_K, Q4_K, Q5_K)
// with q the unsigned quants; the zero point is 32 for Q6_K, 4 for Q3_K, 0 for the formats
// with mins.
// The integers are exact (|isum| < 2^29), and the float steps run in super-block order with the
// same operands whatever T or the output's place in a register block, so a row's result does not
// depend on its batch. Super-blocks are the outer loop: one packed super-block of a tile (8 KiB)
// stays in L1 while every activation row passes over it, into a float accumulator per output.
#include <algorithm>
#include <cstddef>
#include <cstring>
#include <type_traits>
#include <vector>

#include "quant/avx512_common.h"
#include "quant/formats.h"
#include "quant/kernels.h"
#include "quant/kquant_acts.h"

namespace ferrum::quant::detail {

namespace {

constexpr int kVecs = 2;           // 16-row weight registers per tile
constexpr int kRows = 16 * kVecs;  // weight rows per tile
constexpr int kActs = 4;           // activation rows per register block
constexpr int kGroups = kQKK / 4;  // 4-byte groups per super-block

// One super-block of a tile, ready for the multiply loop; lanes past the tile's rows are zero.
struct PackedSuperBlock {
  alignas(64) uint32_t quants[kGroups][kRows];  // unsigned quants, 4 per lane
  alignas(64) int32_t scales[16][kRows];        // sub-block scales (8 or 16 used)
  alignas(64) int32_t min_pairs[8][kRows];      // formats with mins: mins 2k, 2k + 1 as int16 halves
  alignas(64) float d[kRows], dmin[kRows];
};

// Packing goes 16 rows (one register's lanes) at a time: each row's bytes are loaded as 16
// dwords and a 16 x 16 transpose puts dword j of every row into register j, where the quants are
// unpacked lane-wise (4 elements per dword keep their order through the transpose).

// The first `dwords` dwords at byte `offset` of 16 blocks (nullptr: a row past the tile, zero),
// transposed.
FERRUM_AVX512 inline void load_transposed(const uint8_t* const blocks[16], size_t offset, int dwords,
                                          __m512i r[16]) {
  const __mmask16 m = __mmask16((1u << dwords) - 1);
  for (int i = 0; i < 16; ++i) r[i] = blocks[i] ? _mm512_maskz_loadu_epi32(m, blocks[i] + offset) : _mm512_setzero_si512();
  transpose16x16(r);
}

FERRUM_AVX512 inline void store_lanes(void* dst, __m512i v) { _mm512_store_si512(dst, v); }
FERRUM_AVX512 inline __m512i bytes(int v) { return _mm512_set1_epi8(char(v)); }

// Q4_K / Q5_K: each 32 bytes of qs hold sub-block 2c in the low nibbles and 2c + 1 in the high
// ones, so dword m of those bytes is group 16c + m (low) and 16c + 8 + m (high); Q5_K's fifth
// bit of element l of those sub-blocks is bit 2c / 2c + 1 of qh[l].
template <class Block, bool kFiveBit>
struct K4Format {
  using BlockType = Block;
  static constexpr int kSubBlocks = 8;
  static constexpr bool kHasMin = true;
  static constexpr int kZeroPoint = 0;

  // Rows 16v.. of p from their blocks.
  FERRUM_AVX512 static void pack16(const uint8_t* const blocks[16], int v, PackedSuperBlock& p) {
    __m512i qh[16], qs[16];
    if constexpr (kFiveBit) load_transposed(blocks, offsetof(Block, qh), 8, qh);
    for (int half = 0; half < 2; ++half) {  // chunks 2 half, 2 half + 1
      load_transposed(blocks, offsetof(Block, qs) + 64 * half, 16, qs);
      for (int j = 0; j < 16; ++j) {
        const int c = 2 * half + j / 8, m = j % 8;
        __m512i lo = _mm512_and_si512(qs[j], bytes(15));
        __m512i hi = _mm512_and_si512(_mm512_srli_epi32(qs[j], 4), bytes(15));
        if constexpr (kFiveBit) {
          lo = _mm512_or_si512(lo, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(qh[m], 2 * c), bytes(1)), 4));
          hi = _mm512_or_si512(hi, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(qh[m], 2 * c + 1), bytes(1)), 4));
        }
        store_lanes(&p.quants[16 * c + m][16 * v], lo);
        store_lanes(&p.quants[16 * c + 8 + m][16 * v], hi);
      }
    }
    __m512i sm[16];  // row i: its 8 scales, then its 8 mins, as int32
    for (int i = 0; i < 16; ++i) {
      uint64_t scales = 0, mins = 0;
      if (blocks[i]) unpack_k4_scales(reinterpret_cast<const Block*>(blocks[i])->scales, scales, mins);
      sm[i] = _mm512_cvtepu8_epi32(_mm_set_epi64x(int64_t(mins), int64_t(scales)));
    }
    transpose16x16(sm);
    for (int s = 0; s < 8; ++s) store_lanes(&p.scales[s][16 * v], sm[s]);
    for (int k = 0; k < 4; ++k) store_lanes(&p.min_pairs[k][16 * v], _mm512_or_si512(sm[8 + 2 * k], _mm512_slli_epi32(sm[9 + 2 * k], 16)));
    for (int i = 0; i < 16; ++i) {
      const Block* b = reinterpret_cast<const Block*>(blocks[i]);
      p.d[16 * v + i] = b ? h2f(b->d) : 0.0f;
      p.dmin[16 * v + i] = b ? h2f(b->dmin) : 0.0f;
    }
  }
};

// Q6_K: each half h (128 elements) takes 64 bytes of ql and 32 of qh; its four 32-element
// quarters k are the low (k = 0, 1) / high (k = 2, 3) nibbles of ql[0..31] / ql[32..63] with
// bits 2k, 2k + 1 of qh on top, so dword m of each gives group 32h + 8k + m. Quants stay
// unsigned (0..63); the -32 offset comes in through the activation sums.
struct Q6Format {
  using BlockType = BlockQ6_K;
  static constexpr int kSubBlocks = 16;
  static constexpr bool kHasMin = false;
  static constexpr int kZeroPoint = 32;

  FERRUM_AVX512 static void pack16(const uint8_t* const blocks[16], int v, PackedSuperBlock& p) {
    __m512i qh[16], ql[16];
    load_transposed(blocks, offsetof(BlockQ6_K, qh), 16, qh);
    for (int h = 0; h < 2; ++h) {
      load_transposed(blocks, offsetof(BlockQ6_K, ql) + 64 * h, 16, ql);
      for (int m = 0; m < 8; ++m) {
        const __m512i high = qh[8 * h + m];  // bits 2k, 2k + 1 of each byte go to bits 4, 5
        const __m512i high_bits[4] = {_mm512_slli_epi32(high, 4), _mm512_slli_epi32(high, 2), high, _mm512_srli_epi32(high, 2)};
        const __m512i low_bits[4] = {ql[m], ql[8 + m], _mm512_srli_epi32(ql[m], 4), _mm512_srli_epi32(ql[8 + m], 4)};
        for (int k = 0; k < 4; ++k)
          store_lanes(&p.quants[32 * h + 8 * k + m][16 * v],
                      _mm512_or_si512(_mm512_and_si512(low_bits[k], bytes(15)), _mm512_and_si512(high_bits[k], bytes(0x30))));
      }
    }
    __m512i sc[16];  // row i: its 16 scales as int32
    for (int i = 0; i < 16; ++i)
      sc[i] = blocks[i] ? _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blocks[i] + offsetof(BlockQ6_K, scales))))
                        : _mm512_setzero_si512();
    transpose16x16(sc);
    for (int s = 0; s < 16; ++s) store_lanes(&p.scales[s][16 * v], sc[s]);
    for (int i = 0; i < 16; ++i) p.d[16 * v + i] = blocks[i] ? h2f(reinterpret_cast<const BlockQ6_K*>(blocks[i])->d) : 0.0f;
  }
};

// Q2_K / Q3_K: each 32 bytes of qs hold four 32-element quarters j in successive 2-bit fields,
// so dword m of qs[32h..] gives group 32h + 8j + m; every 16 elements have their own scale. Q3_K
// adds bit 4h + j of hmask[l] as the quant's third bit and has a zero point of 4; Q2_K has a
// 4-bit scale and min per sub-block.
template <bool kThreeBit>
struct K2Format {
  using BlockType = std::conditional_t<kThreeBit, BlockQ3_K, BlockQ2_K>;
  static constexpr int kSubBlocks = 16;
  static constexpr bool kHasMin = !kThreeBit;
  static constexpr int kZeroPoint = kThreeBit ? 4 : 0;

  FERRUM_AVX512 static void pack16(const uint8_t* const blocks[16], int v, PackedSuperBlock& p) {
    __m512i qs[16], hmask[16];
    load_transposed(blocks, offsetof(BlockType, qs), 16, qs);
    if constexpr (kThreeBit) load_transposed(blocks, offsetof(BlockType, hmask), 8, hmask);
    for (int h = 0; h < 2; ++h)
      for (int j = 0; j < 4; ++j)
        for (int m = 0; m < 8; ++m) {
          __m512i q = _mm512_and_si512(_mm512_srli_epi32(qs[8 * h + m], 2 * j), bytes(3));
          if constexpr (kThreeBit)
            q = _mm512_or_si512(q, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(hmask[m], 4 * h + j), bytes(1)), 2));
          store_lanes(&p.quants[32 * h + 8 * j + m][16 * v], q);
        }
    __m512i sc[16], mins[16];  // row i: its 16 scales (Q2_K: and mins) as int32
    for (int i = 0; i < 16; ++i) {
      const BlockType* b = reinterpret_cast<const BlockType*>(blocks[i]);
      if constexpr (kThreeBit) {
        alignas(64) int32_t scales[16] = {};
        for (int s = 0; b && s < 16; ++s) scales[s] = q3k_scale(b->scales, s) - 32;
        sc[i] = _mm512_load_si512(scales);
      } else {
        const __m512i packed = b ? _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b->scales)))
                                 : _mm512_setzero_si512();
        sc[i] = _mm512_and_si512(packed, _mm512_set1_epi32(15));
        mins[i] = _mm512_srli_epi32(packed, 4);
      }
      p.d[16 * v + i] = b ? h2f(b->d) : 0.0f;
      if constexpr (!kThreeBit) p.dmin[16 * v + i] = b ? h2f(b->dmin) : 0.0f;
    }
    transpose16x16(sc);
    for (int s = 0; s < 16; ++s) store_lanes(&p.scales[s][16 * v], sc[s]);
    if constexpr (!kThreeBit) {
      transpose16x16(mins);
      for (int k = 0; k < 8; ++k)
        store_lanes(&p.min_pairs[k][16 * v], _mm512_or_si512(mins[2 * k], _mm512_slli_epi32(mins[2 * k + 1], 16)));
    }
  }
};

// Super-block sb of `rows` (<= kRows) weight rows into p.
template <class F>
FERRUM_AVX512 void pack_super_block(const char* w, size_t w_row_bytes, int64_t rows, int64_t sb,
                                    PackedSuperBlock& p) {
  for (int v = 0; v < kVecs; ++v) {
    const uint8_t* blocks[16];
    for (int i = 0; i < 16; ++i) {
      const int64_t r = 16 * v + i;
      blocks[i] = r < rows ? reinterpret_cast<const uint8_t*>(w + r * w_row_bytes + sb * int64_t(sizeof(typename F::BlockType)))
                           : nullptr;
    }
    F::pack16(blocks, v, p);
  }
}

// Requests super-block sb of `rows` weight rows into L1 ahead of packing it: the rows are far apart,
// so the hardware prefetcher does not see these reads coming.
template <class F>
FERRUM_AVX512 void prefetch_super_block(const char* w, size_t w_row_bytes, int64_t rows, int64_t sb) {
  constexpr size_t kBytes = sizeof(typename F::BlockType);
  for (int64_t r = 0; r < rows; ++r) {
    const char* b = w + r * w_row_bytes + sb * int64_t(kBytes);
    for (size_t off = 0; off < kBytes; off += 64) _mm_prefetch(b + off, _MM_HINT_T0);
    _mm_prefetch(b + kBytes - 1, _MM_HINT_T0);
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
        sum[j][v] = F::kZeroPoint == 0 ? _mm512_setzero_si512() : _mm512_set1_epi32(terms[j][s]);
#pragma GCC unroll 8  // straight-line dpbusd: the rolled loop shuffles the accumulators between registers
    for (int gi = 0; gi < kGroupsPerSub; ++gi) {
      const int g = s * kGroupsPerSub + gi;
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
        for (int k = 0; k < F::kSubBlocks / 2; ++k)
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
  prepare_kquant_acts<F::kSubBlocks, F::kHasMin, F::kZeroPoint>(nb, act, act_row_bytes, T, acts);
  acc_buffer.resize(size_t(T * kRows + 16));
  float* acc = acc_buffer.data();  // [T][kRows], 64-byte aligned
  acc += (64 - reinterpret_cast<uintptr_t>(acc) % 64) % 64 / sizeof(float);
  for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
    const int64_t tile_rows = std::min<int64_t>(kRows, rows - r0);
    for (int64_t sb = 0; sb < nb; ++sb) {
      const char* tile = static_cast<const char*>(w) + r0 * w_row_bytes;
      pack_super_block<F>(tile, w_row_bytes, tile_rows, sb, packed);
      if (sb + 1 < nb)
        prefetch_super_block<F>(tile, w_row_bytes, tile_rows, sb + 1);
      else if (r0 + kRows < rows)
        prefetch_super_block<F>(tile + kRows * w_row_bytes, w_row_bytes, std::min<int64_t>(kRows, rows - r0 - kRows), 0);
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
    case DType::Q2_K: return gemm_kquant<K2Format<false>>;
    case DType::Q3_K: return gemm_kquant<K2Format<true>>;
    case DType::Q4_K: return gemm_kquant<K4Format<BlockQ4_K, false>>;
    case DType::Q5_K: return gemm_kquant<K4Format<BlockQ5_K, true>>;
    case DType::Q6_K: return gemm_kquant<Q6Format>;
    default: return nullptr;
  }
}

}  // namespace ferrum::quant::detail
