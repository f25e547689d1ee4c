// Internal: the arithmetic of add_group_offsets (backend.h), shared by the dense op
// (cpu_backend.cpp) and the asymmetric 8-bit experts of moe_experts (cpu_moe.cpp), so that both
// add an output's offsets in one float order: a row's group sums (each 32-column block summed in
// 8 lanes, then the blocks into their groups in column order), then per output the products over
// the groups in order, accumulated apart and added to the output once.
#pragma once
#include <algorithm>
#include <cstdint>

namespace ferrum::cpu {

inline float block_sum(const float* x) {
  float lane[8] = {};
  for (int j = 0; j < 32; j += 8)
    for (int l = 0; l < 8; ++l) lane[l] += x[j + l];
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

// sums[0, G) = the sums of x's blocks by group (block b in group[b]; a group outside [0, G)
// counts nowhere).
inline void group_sums(const float* x, int64_t blocks, const int32_t* group, int64_t G, float* sums) {
  std::fill(sums, sums + G, 0.0f);
  for (int64_t b = 0; b < blocks; ++b)
    if (group[b] >= 0 && group[b] < G) sums[group[b]] += block_sum(x + b * 32);
}

constexpr int64_t kOffsetChunk = 64;

// out[i * ldo + j] += sum_g sums[i * G + g] * w[g * N + j] for R rows and len <= kOffsetChunk
// outputs, accumulated in registers.
template <int R>
void offsets_tile(const float* sums, int64_t G, const float* w, int64_t N, float* out, int64_t ldo, int64_t len) {
  float acc[R][kOffsetChunk] = {};
  if (len == kOffsetChunk) {
    for (int64_t g = 0; g < G; ++g)
      for (int i = 0; i < R; ++i)
        for (int64_t j = 0; j < kOffsetChunk; ++j) acc[i][j] += sums[i * G + g] * w[g * N + j];
  } else {
    for (int64_t g = 0; g < G; ++g)
      for (int i = 0; i < R; ++i)
        for (int64_t j = 0; j < len; ++j) acc[i][j] += sums[i * G + g] * w[g * N + j];
  }
  for (int i = 0; i < R; ++i)
    for (int64_t j = 0; j < len; ++j) out[i * ldo + j] += acc[i][j];
}

// out[j] += sum_g sums[g] * w[g * N + j] for j < len: one row, chunk by chunk.
inline void add_row_offsets(const float* sums, int64_t G, const float* w, int64_t N, float* out, int64_t len) {
  for (int64_t c = 0; c < len; c += kOffsetChunk)
    offsets_tile<1>(sums, G, w + c, N, out + c, 0, std::min(kOffsetChunk, len - c));
}

}  // namespace ferrum::cpu
