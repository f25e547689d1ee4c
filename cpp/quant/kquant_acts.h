// Internal: the Q8_K activation terms that the k-quant int8 GEMMs (gemm_kquant_avx512.cpp, the R16
// kernels in dot_r16_avx512.cpp and dot_r16_kquant_avx2.cpp) add per super-block besides the
// weight products.
#pragma once
#include <cstdint>
#include <vector>

#include "quant/formats.h"

namespace ferrum::quant::detail {

// Per activation row and super-block: the sub-block terms that need the activation sums.
struct KActs {
  std::vector<const BlockQ8_K*> rows;  // [T]
  std::vector<int32_t> terms;          // [T][nb][16], see prepare_kquant_acts
};

// terms[t][sb][.]: formats with mins: the sub-block sums of a (bsums, summed in pairs for the
// 32-element sub-blocks) as int16 pairs, sums 2k, 2k + 1 in term k (vpdpwssd against mins 2k,
// 2k + 1); formats with a zero point: -zero point * bsums[s], where sub-block s's integer sum
// starts.
// Static: every kernel file compiles its own copy for its ISA (one shared instantiation could be
// an AVX-512 file's, and run on an AVX2-only CPU).
template <int kSubBlocks, bool kHasMin, int kZeroPoint>
static void prepare_kquant_acts(int64_t nb, const void* act, size_t act_row_bytes, int64_t T, KActs& acts) {
  acts.rows.resize(size_t(T));
  acts.terms.resize(size_t(T * nb * 16));
  for (int64_t t = 0; t < T; ++t) {
    const BlockQ8_K* y = reinterpret_cast<const BlockQ8_K*>(static_cast<const char*>(act) + t * act_row_bytes);
    acts.rows[size_t(t)] = y;
    for (int64_t sb = 0; sb < nb; ++sb) {
      int32_t* terms = &acts.terms[size_t((t * nb + sb) * 16)];
      const int16_t* bsums = y[sb].bsums;
      if constexpr (kHasMin) {
        constexpr int kPer = 16 / kSubBlocks;  // bsums per sub-block
        int sub_sums[16];
        for (int s = 0; s < kSubBlocks; ++s) {
          sub_sums[s] = 0;
          for (int k = 0; k < kPer; ++k) sub_sums[s] += bsums[kPer * s + k];
        }
        for (int k = 0; k < kSubBlocks / 2; ++k)
          terms[k] = int32_t(uint32_t(uint16_t(sub_sums[2 * k])) | (uint32_t(uint16_t(sub_sums[2 * k + 1])) << 16));
      } else {
        for (int s = 0; s < 16; ++s) terms[s] = -kZeroPoint * bsums[s];
      }
    }
  }
}

}  // namespace ferrum::quant::detail
