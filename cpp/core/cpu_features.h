// x86 features detected once at run time (cpuid + xgetbv), so one binary picks its kernels.
// FERRUM_CPU_ISA=scalar|avx2|avx512 caps what is reported (the kernels of a smaller CPU can then
// be tested on a bigger one); unset means everything detected.
#pragma once
#include <string>

namespace ferrum {

struct CpuFeatures {
  bool avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512_vnni = false,
       avx512_bf16 = false;
  std::string str() const;
};

// Throws ValueError on an unknown FERRUM_CPU_ISA.
const CpuFeatures& cpu_features();

}  // namespace ferrum
