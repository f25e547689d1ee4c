// The AVX-512 copy of the paged-attention kernel (attention_kernel.h): compiled for x86-64-v4 in
// the portable build, run only where cpu_features() reports AVX-512 F/BW/VL.
#include "backend/cpu/attention_kernel.h"

namespace ferrum::cpu {

void attend_items_avx512(const AttnCall& call, const AttnTile* tiles, int64_t num_tiles, float* scratch, int ith,
                         int nth) {
  attend_items(call, tiles, num_tiles, scratch, ith, nth);
}

}  // namespace ferrum::cpu
