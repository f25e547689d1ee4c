// x86 features detected once at run time (cpuid + xgetbv), so one binary picks its kernels.
#pragma once
#include <string>

namespace ferrum {

struct CpuFeatures {
  bool avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512_vnni = false,
       avx512_bf16 = false;
  std::string str() const;
};

const CpuFeatures& cpu_features();

}  // namespace ferrum
