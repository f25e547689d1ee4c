// Internal: the CPU backend's paged-attention kernel, compiled twice (docs/install.md):
// cpu_attention.cpp holds the baseline copy (x86-64-v3 in the portable build) and
// cpu_attention_avx512.cpp the AVX-512 one, which CpuBackend::paged_attention runs where
// cpu_features() reports AVX-512. Both take the same floats through the same operations in the
// same order (fast_math.h), so they agree bit for bit. Everything but the description of a call
// has internal linkage: the two copies are different code, and the linker must not keep one of
// them for both (scripts/check_isa.py).
//
// Flash-attention style: the queries of a tile (up to kTileTokens consecutive tokens of one
// sequence, times the q heads that share a kv head) walk the keys in blocks of kKeyBlock: each
// key and value row is converted to f32 once for all of them, the keys dimension-major (the K
// pool's panels, cpu_kernels.h, are already; plain rows are transposed) so scores come 16 keys at
// a time (no horizontal sums), and an online softmax keeps one running max / sum / output row per
// query.
//
// Key blocks sit at absolute multiples of kKeyBlock and a query skips every block in which it
// sees no key, so a query's arithmetic does not depend on the other tokens of its tile: a
// sequence gets the same outputs alone or batched, in one prefill or in chunks, cached or not.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/cpu_kernels.h"
#include "backend/cpu/fast_math.h"
#if defined(__AVX512F__)
#include "quant/avx512_common.h"
#endif

namespace ferrum::cpu {

constexpr int64_t kTileTokens = 16;

struct AttnTile {
  int64_t t0, t1;  // tokens [t0, t1): one sequence, consecutive
};

// One paged_attention call as the kernel reads it: its tensors' host pointers and shapes.
struct AttnCall {
  const float* q;         // [tokens, heads, head_dim]
  float* out;             // [tokens, heads, head_dim]
  const int32_t* seq;     // AttnBatch::token_seq
  const int32_t* pos;     // AttnBatch::token_pos
  const int32_t* tables;  // AttnBatch::block_tables [num_seqs, max_blocks]
  int64_t num_seqs, max_blocks, max_ctx;
  const KvLayer* kv;
  AttnParams p;
};

// Thread ith of nth's share of the call's (tile, kv head) items; scratch: its own
// attention_scratch_floats(p) floats.
using AttendItemsFn = void (*)(const AttnCall& call, const AttnTile* tiles, int64_t num_tiles, float* scratch,
                               int ith, int nth);
// The AVX-512 copy of attend_items below (AVX-512 F/BW/VL CPUs only).
void attend_items_avx512(const AttnCall& call, const AttnTile* tiles, int64_t num_tiles, float* scratch, int ith,
                         int nth);

namespace {

constexpr int64_t kKeyBlock = 16;
static_assert(kKeyBlock == kKeyPanel, "a key block is one K panel");
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// One f32 row of a K or V pool (a K pool's in panels: every kKeyPanel-th element, cpu_kernels.h).
void load_kv_row(const Tensor& pool, const Tensor& scales, int64_t row, int64_t hd, bool panels, float* dst) {
  const int64_t at = row_start(row, hd, panels), step = row_stride(panels);
  switch (pool.dtype) {
    case DType::F32: {
      const float* src = host_ptr<float>(pool) + at;
      for (int64_t i = 0; i < hd; ++i) dst[i] = src[i * step];
      break;
    }
    case DType::F16: {
      const uint16_t* src = host_ptr<uint16_t>(pool) + at;
      int64_t i = 0;
      if (step == 1) {
#if defined(__AVX512F__)
        for (; i + 16 <= hd; i += 16)
          _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
#endif
#if defined(__F16C__)
        for (; i + 8 <= hd; i += 8)
          _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
      }
      for (; i < hd; ++i) dst[i] = f16_to_f32(src[i * step]);
      break;
    }
    case DType::I8: {
      const int8_t* src = host_ptr<int8_t>(pool) + at;
      const float s = host_ptr<float>(scales)[row];
      for (int64_t i = 0; i < hd; ++i) dst[i] = float(src[i * step]) * s;
      break;
    }
    default:
      break;
  }
}

// Per-thread working memory of one (tile, kv head) item, carved from one float buffer. Rows
// of head_dim floats are padded to hd16 (a multiple of 16) with zeros.
struct TileScratch {
  float* out;     // [rows][hd16] running (unnormalised) outputs
  float* max;     // [rows] running score max
  float* sum;     // [rows] running sum of exp(score - max)
  f32x16* keys;   // [hd16]: element k of keys[d] is dimension d of key k of the block
  float* vals;    // [kKeyBlock][hd16] the value block
  float* stage;   // [kKeyBlock][hd16] the key block as rows, before the transpose

  static int64_t padded(int64_t hd) { return (hd + 15) / 16 * 16; }
  static size_t floats(int64_t rows, int64_t hd) {
    return size_t(rows * padded(hd) + 2 * rows + 3 * padded(hd) * kKeyBlock) + 16;
  }
  TileScratch(float* base, int64_t rows, int64_t hd) {
    const int64_t hd16 = padded(hd);
    keys = reinterpret_cast<f32x16*>((reinterpret_cast<uintptr_t>(base) + 63) / 64 * 64);
    vals = reinterpret_cast<float*>(keys + hd16);
    stage = vals + kKeyBlock * hd16;
    out = stage + kKeyBlock * hd16;
    max = out + rows * hd16;
    sum = max + rows;
  }
};

// keys[d][k] = stage[k][d] for d < hd16 (stage rows are zero-padded to hd16).
void transpose_keys(const float* stage, int64_t hd16, f32x16* keys) {
#if defined(__AVX512F__)
  for (int64_t c = 0; c < hd16; c += 16) {
    __m512i r[16];
    for (int k = 0; k < 16; ++k) r[k] = _mm512_castps_si512(_mm512_loadu_ps(stage + k * hd16 + c));
    quant::detail::transpose16x16(r);
    for (int d = 0; d < 16; ++d) _mm512_storeu_si512(keys + c + d, r[d]);
  }
#else
  for (int64_t k = 0; k < kKeyBlock; ++k)
    for (int64_t d = 0; d < hd16; ++d) keys[d][k] = stage[k * hd16 + d];
#endif
}

// The pool row of key position j of kv head kvh (block table `table`), or -1 where j's block is
// not mapped.
int64_t pool_row(const KvLayer& kv, const int32_t* table, int64_t j, int64_t kvh) {
  const int64_t bs = kv.block_size(), b = table[j / bs];
  if (b < 0 || b >= kv.k.dim(0)) return -1;
  return (b * kv.k.dim(1) + kvh) * bs + j % bs;
}

// The pool rows of keys j0 .. j0 + kKeyBlock - 1 are consecutive when the pool's block size is a
// multiple of kKeyBlock (key blocks start at multiples of it): the first one's row, or -1 when
// they are not or j0's block is not mapped.
int64_t block_rows(const KvLayer& kv, const int32_t* table, int64_t j0, int64_t kvh) {
  return kv.block_size() % kKeyBlock == 0 ? pool_row(kv, table, j0, kvh) : -1;
}

// Asks for the K and V rows of key block j0 (keys up to hi): a block's rows are scattered over
// the pool, and at 16 sequences the pool is far larger than the cache.
void prefetch_block(const KvLayer& kv, const int32_t* table, int64_t j0, int64_t hi, int64_t kvh) {
  if (j0 > hi) return;
  const int64_t row_bytes = int64_t(dtype_bytes(kv.k.dtype, kv.k.dim(3)));
  const int64_t n = std::min(kKeyBlock, hi - j0 + 1), first = block_rows(kv, table, j0, kvh);
  auto ask = [](const Tensor& pool, int64_t from, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(host_ptr<char>(pool) + from + o, _MM_HINT_T1);
  };
  if (first >= 0) {  // consecutive rows; the K rows are one panel
    ask(kv.k, first * row_bytes, kKeyBlock * row_bytes);
    ask(kv.v, first * row_bytes, n * row_bytes);
    return;
  }
  for (int64_t k = 0; k < n; ++k) {  // plain rows (a block size that is no multiple of 16)
    const int64_t row = pool_row(kv, table, j0 + k, kvh);
    if (row < 0) continue;
    ask(kv.k, row * row_bytes, row_bytes);
    ask(kv.v, row * row_bytes, row_bytes);
  }
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__F16C__))
#define FERRUM_KV_BLOCK_ROWS 1
// A pool's element type, and 16 of its elements from p as f32 (int8 ones times `scale`).
template <DType kType>
using KvElem = std::conditional_t<kType == DType::F16, uint16_t, std::conditional_t<kType == DType::F32, float, int8_t>>;

template <DType kType>
inline f32x16 kv16(const KvElem<kType>* p, f32x16 scale) {
  if constexpr (kType == DType::F32) {
    return load16(p);
  } else {
#if defined(__AVX512F__)
    const __m512 v = kType == DType::F16
                         ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))
                         : _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    const f32x16 f = f32x16(v);
#else
    __m256 half[2];
    for (int h = 0; h < 2; ++h)
      half[h] = kType == DType::F16
                    ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8 * h)))
                    : _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * h))));
    f32x16 f;
    std::memcpy(&f, half, sizeof f);
#endif
    return kType == DType::I8 ? f * scale : f;
  }
}

// Keys j0 .. j0 + n - 1 at consecutive pool rows from `first` (a panel's first row), head_dim a
// multiple of 16: the keys read dimension by dimension from the panel (int8 ones times their
// rows' scales), the values row by row, straight from the pool. Lanes and rows of keys past n
// are zero (their pool rows may hold anything). (Pointers are taken once: the vector stores may
// alias anything, so a tensor's data pointer would be reloaded after every one.)
template <DType kType>
void load_block_rows(const KvLayer& kv, int64_t first, int64_t n, int64_t hd, TileScratch& s) {
  constexpr bool kScaled = kType == DType::I8;
  const i32x16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const i32x16 live = lane < int32_t(n);  // all bits set in the lanes of keys that exist
  const KvElem<kType>* k = host_ptr<KvElem<kType>>(kv.k) + row_start(first, hd, true);
  const KvElem<kType>* v = host_ptr<KvElem<kType>>(kv.v) + first * hd;
  const float* v_scale = kScaled ? host_ptr<float>(kv.v_scale) + first : nullptr;
  f32x16 k_scales = splat(1.0f);
  if (kScaled) k_scales = load16(host_ptr<float>(kv.k_scale) + first);
  f32x16* keys = s.keys;
  float* vals = s.vals;
  for (int64_t d = 0; d < hd; ++d) keys[d] = f32x16(i32x16(kv16<kType>(k + d * kKeyBlock, k_scales)) & live);
  for (int64_t r = 0; r < kKeyBlock; ++r) {
    const f32x16 scale = splat(kScaled && r < n ? v_scale[r] : 1.0f);
    for (int64_t c = 0; c < hd; c += 16)
      store16(vals + r * hd + c, r < n ? kv16<kType>(v + r * hd + c, scale) : splat(0.0f));
  }
}
#endif

// Key block j0 (keys past hi or unmapped are zero, and cleared in the returned mask) into
// s.keys (transposed) and s.vals.
f32x16 load_key_block(const KvLayer& kv, const int32_t* table, int64_t j0, int64_t hi, int64_t kvh, int64_t hd,
                      TileScratch& s) {
  const int64_t n = std::min(kKeyBlock, hi - j0 + 1);
  f32x16 mapped = {};
#if defined(FERRUM_KV_BLOCK_ROWS)
  const int64_t first = hd % 16 == 0 ? block_rows(kv, table, j0, kvh) : -1;
  auto (*load)(const KvLayer&, int64_t, int64_t, int64_t, TileScratch&) -> void =
      kv.k.dtype == DType::F16   ? load_block_rows<DType::F16>
      : kv.k.dtype == DType::F32 ? load_block_rows<DType::F32>
      : kv.k.dtype == DType::I8  ? load_block_rows<DType::I8>
                                 : nullptr;
  if (first >= 0 && load) {
    load(kv, first, n, hd, s);
    for (int64_t k = 0; k < n; ++k) mapped[k] = 1.0f;
    return mapped;
  }
#endif
  const int64_t hd16 = TileScratch::padded(hd);
  for (int64_t k = 0; k < kKeyBlock; ++k) {
    const int64_t row = k < n ? pool_row(kv, table, j0 + k, kvh) : -1;
    mapped[k] = row >= 0 ? 1.0f : 0.0f;
    float *key = s.stage + k * hd16, *val = s.vals + k * hd16;
    if (row >= 0) {
      load_kv_row(kv.k, kv.k_scale, row, hd, k_in_panels(kv), key);
      load_kv_row(kv.v, kv.v_scale, row, hd, false, val);
      std::fill(key + hd, key + hd16, 0.0f);  // the padding columns
      std::fill(val + hd, val + hd16, 0.0f);
    } else {
      std::fill(key, key + hd16, 0.0f);
      std::fill(val, val + hd16, 0.0f);
    }
  }
  transpose_keys(s.stage, hd16, s.keys);
  return mapped;
}

// The positions token t sees: [first, pos]; false for padding / out-of-range tokens.
bool visible(const AttnCall& v, const AttnParams& p, int64_t t, int64_t* first, int64_t* last) {
  const int64_t pos = v.pos[t];
  if (pos < 0 || pos >= v.max_ctx || v.seq[t] < 0 || v.seq[t] >= v.num_seqs) return false;
  *first = p.window > 0 ? std::max<int64_t>(0, pos - p.window + 1) : 0;
  *last = pos;
  return true;
}

// Up to kRows query rows (of one token or of consecutive tokens of a tile) against one key
// block, each row in exactly the float order a row alone would take (so results do not depend
// on the grouping): scores in four chains over d, the block max, the online-softmax update, then
// o = o * rescale + sum over keys k = 0 .. 15 of weight[k] * value row k, one chain per 16-float
// chunk. Grouped, the rows share every key and value load and their chains overlap (one row's
// chains alone leave the FMA units waiting on their latency).
// kChunks = head_dim / 16 keeps the output rows in registers; 0 takes any head_dim (hd).
// Row i: query q[i], seen[i]: the block's keys its token sees (all bits set) or not; output,
// running max and sum: row `first` + i of the tile's scratch (the rows that see a block are
// consecutive). Returns false, having changed nothing, when a row's block max is -inf (no key of
// the block seen, or infinite scores).
struct BlockRows {
  static constexpr int kMax = 6;
  const float* q[kMax];
  i32x16 seen[kMax];
  int64_t first = 0;
  int n = 0;
};

template <int kChunks, int kRows>
bool attend_rows(const BlockRows& r, float scale, int64_t hd, const TileScratch& s) {
  if constexpr (kChunks > 0) hd = kChunks * 16;
  const int64_t hd16 = TileScratch::padded(hd);
  float* const out = s.out + r.first * hd16;
  float* const max = s.max + r.first;
  float* const sum = s.sum + r.first;
  f32x16 score[kRows];
  {
    f32x16 acc[kRows][4] = {};  // four chains a row: one would wait on each FMA's latency
    int64_t d = 0;
    for (; d + 4 <= hd; d += 4)
      for (int c = 0; c < 4; ++c) {
        const f32x16 key = in_register(s.keys[d + c]);
        for (int i = 0; i < kRows; ++i) acc[i][c] = fmadd(splat(r.q[i][d + c]), key, acc[i][c]);
      }
    if constexpr (kChunks == 0)  // (a fixed head size is a multiple of 16: no tail)
      for (; d < hd; ++d)
        for (int i = 0; i < kRows; ++i) acc[i][0] = fmadd(splat(r.q[i][d]), s.keys[d], acc[i][0]);
    for (int i = 0; i < kRows; ++i) {
      score[i] = (acc[i][0] + acc[i][1]) + (acc[i][2] + acc[i][3]);
      score[i] = select(r.seen[i], score[i] * scale, splat(kNegInf));
    }
  }
  float block_max[kRows];
  for (int i = 0; i < kRows; ++i) {
    block_max[i] = hmax(score[i]);
    if (block_max[i] == kNegInf) return false;  // (the caller takes such rows one by one)
  }
  f32x16 weight[kRows];
  float rescale[kRows];
  for (int i = 0; i < kRows; ++i) {
    const float new_max = std::max(max[i], block_max[i]);
    rescale[i] = fast_exp(max[i] - new_max);  // ~0 for the first block
    weight[i] = select(r.seen[i], fast_exp(score[i] - new_max), splat(0.0f));
    max[i] = new_max;
    sum[i] = sum[i] * rescale[i] + hsum(weight[i]);
  }
  if constexpr (kChunks > 0) {
    f32x16 acc[kRows][kChunks];
    for (int i = 0; i < kRows; ++i)
      for (int c = 0; c < kChunks; ++c) acc[i][c] = load16(out + i * hd16 + 16 * c) * rescale[i];
    for (int k = 0; k < kKeyBlock; ++k)
      for (int c = 0; c < kChunks; ++c) {
        const f32x16 v = in_register(load16(s.vals + k * hd16 + 16 * c));
        for (int i = 0; i < kRows; ++i) acc[i][c] = fmadd(splat(weight[i][k]), v, acc[i][c]);
      }
    for (int i = 0; i < kRows; ++i)
      for (int c = 0; c < kChunks; ++c) store16(out + i * hd16 + 16 * c, acc[i][c]);
  } else {
    for (int i = 0; i < kRows; ++i)
      for (int64_t c = 0; c < hd16; c += 16) {
        f32x16 acc = load16(out + i * hd16 + c) * rescale[i];
        for (int k = 0; k < kKeyBlock; ++k) acc = fmadd(splat(weight[i][k]), load16(s.vals + k * hd16 + c), acc);
        store16(out + i * hd16 + c, acc);
      }
  }
  return true;
}

using AttendRowsFn = bool (*)(const BlockRows&, float, int64_t, const TileScratch&);

// How many rows go into one attend_rows call: as many as keep its accumulators in registers
// (6 at head_dim 64, 3 at 128; others one at a time), and the kernel for n of them.
int rows_per_call(int64_t hd) { return hd == 64 ? 6 : hd == 128 ? 3 : 1; }
AttendRowsFn attend_rows_kernel(int64_t hd, int n) {
  static constexpr AttendRowsFn k64[] = {attend_rows<4, 1>, attend_rows<4, 2>, attend_rows<4, 3>,
                                         attend_rows<4, 4>, attend_rows<4, 5>, attend_rows<4, 6>};
  static constexpr AttendRowsFn k128[] = {attend_rows<8, 1>, attend_rows<8, 2>, attend_rows<8, 3>};
  return hd == 64 ? k64[n - 1] : hd == 128 ? k128[n - 1] : attend_rows<0, 1>;
}

// Runs the collected rows against the block and empties the list.
void attend_block_rows(BlockRows& r, float scale, int64_t hd, const TileScratch& s) {
  if (r.n == 0) return;
  if (!attend_rows_kernel(hd, r.n)(r, scale, hd, s) && r.n > 1)
    for (int i = 0; i < r.n; ++i) {  // a row that skips the block must not hold up the others
      BlockRows one;
      one.q[0] = r.q[i], one.seen[0] = r.seen[i], one.first = r.first + i, one.n = 1;
      attend_rows_kernel(hd, 1)(one, scale, hd, s);
    }
  r.n = 0;
}

// The keys the tile's tokens see, [lo, hi]; false when it has only padding tokens.
bool key_range(const AttnCall& v, const AttnParams& p, const AttnTile& tile, int64_t* lo, int64_t* hi) {
  *lo = v.max_ctx;
  *hi = -1;
  for (int64_t t = tile.t0; t < tile.t1; ++t) {
    int64_t first, last;
    if (!visible(v, p, t, &first, &last)) continue;
    *lo = std::min(*lo, first);
    *hi = std::max(*hi, last);
  }
  return *hi >= 0;
}

// Prefetches the first key block of a tile: an item asks for the next one's while it runs (its
// own later blocks are asked for one block ahead), so no item starts on a cold block.
void prefetch_first_block(const AttnCall& v, const KvLayer& kv, const AttnParams& p, const AttnTile& tile, int64_t kvh) {
  int64_t lo, hi;
  if (key_range(v, p, tile, &lo, &hi))
    prefetch_block(kv, v.tables + int64_t(v.seq[tile.t0]) * v.max_blocks, lo / kKeyBlock * kKeyBlock, hi, kvh);
}

void attend_tile(const AttnCall& v, const KvLayer& kv, const AttnParams& p, const AttnTile& tile,
                 int64_t kvh, TileScratch& s) {
  const int64_t hd = p.head_dim, hd16 = TileScratch::padded(hd), group = p.heads / p.kv_heads;
  const int64_t rows = (tile.t1 - tile.t0) * group;
  int64_t lo, hi;
  if (!key_range(v, p, tile, &lo, &hi)) return;  // only padding tokens
  const int32_t* table = v.tables + int64_t(v.seq[tile.t0]) * v.max_blocks;
  std::fill(s.out, s.out + rows * hd16, 0.0f);
  std::fill(s.max, s.max + rows, kNegInf);
  std::fill(s.sum, s.sum + rows, 0.0f);
  const f32x16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const int per_call = rows_per_call(hd);

  for (int64_t j0 = lo / kKeyBlock * kKeyBlock; j0 <= hi; j0 += kKeyBlock) {
    prefetch_block(kv, table, j0 + kKeyBlock, hi, kvh);
    const f32x16 mapped = load_key_block(kv, table, j0, hi, kvh, hd, s);
    const f32x16 key_pos = lane + float(j0);
    BlockRows rows_in;
    for (int64_t t = tile.t0; t < tile.t1; ++t) {
      int64_t first, last;
      if (!visible(v, p, t, &first, &last) || last < j0 || first >= j0 + kKeyBlock) continue;
      const f32x16 seen_lo = key_pos - float(first), seen_hi = float(last) - key_pos;  // both >= 0: seen
      const f32x16 zero = splat(0.0f);
      const i32x16 seen = lanes_lt(zero, mapped) & lanes_ge(seen_lo, zero) & lanes_ge(seen_hi, zero);
      for (int64_t g = 0; g < group; ++g) {
        const int64_t r = (t - tile.t0) * group + g;
        if (rows_in.n == 0) rows_in.first = r;
        const int i = rows_in.n++;
        rows_in.q[i] = v.q + (t * p.heads + kvh * group + g) * hd;
        rows_in.seen[i] = seen;
        if (rows_in.n == per_call) attend_block_rows(rows_in, p.scale, hd, s);
      }
    }
    attend_block_rows(rows_in, p.scale, hd, s);
  }

  for (int64_t t = tile.t0; t < tile.t1; ++t) {
    int64_t first, last;
    if (!visible(v, p, t, &first, &last)) continue;
    for (int64_t g = 0; g < group; ++g) {
      const int64_t r = (t - tile.t0) * group + g;
      const float inv = s.sum[r] > 0.0f ? 1.0f / s.sum[r] : 0.0f;  // 0: no mapped key at all
      float* dst = v.out + (t * p.heads + kvh * group + g) * hd;
      for (int64_t d = 0; d < hd; ++d) dst[d] = s.out[r * hd16 + d] * inv;
    }
  }
}

// Floats of scratch one thread needs for a call with these parameters.
inline size_t attention_scratch_floats(const AttnParams& p) {
  return TileScratch::floats(kTileTokens * (p.heads / p.kv_heads), p.head_dim);
}

// Items (tile, kv head) are dealt round-robin: later prefill tiles see more keys, so contiguous
// ranges would leave one thread with the long ones.
inline void attend_items(const AttnCall& c, const AttnTile* tiles, int64_t num_tiles, float* scratch, int ith,
                         int nth) {
  const KvLayer& kv = *c.kv;
  const AttnParams& p = c.p;
  TileScratch ts(scratch, kTileTokens * (p.heads / p.kv_heads), p.head_dim);
  const int64_t items = num_tiles * p.kv_heads;
  for (int64_t i = ith; i < items; i += nth) {
    if (i + nth < items) prefetch_first_block(c, kv, p, tiles[(i + nth) / p.kv_heads], (i + nth) % p.kv_heads);
    attend_tile(c, kv, p, tiles[i / p.kv_heads], i % p.kv_heads, ts);
  }
}

}  // namespace
}  // namespace ferrum::cpu
