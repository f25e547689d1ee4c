// The AVX-512 copy of the row kernels (row_kernels.h): compiled for x86-64-v4 in the portable
// build, handed out only where cpu_features() reports AVX-512 F/BW/VL.
#include "backend/cpu/row_kernels.h"

namespace ferrum::cpu {

const RowKernels& row_kernels_avx512() { return impl::kRowKernels; }

}  // namespace ferrum::cpu
