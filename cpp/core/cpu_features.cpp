#include "core/cpu_features.h"

#include <cstdlib>
#include <cstring>

#include "core/error.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace ferrum {

namespace {
CpuFeatures detect() {
  CpuFeatures f;
#if defined(__x86_64__) || defined(__i386__)
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  bool osxsave = c & (1u << 27);
  f.fma = c & (1u << 12);
  f.f16c = c & (1u << 29);
  unsigned long long xcr0 = 0;
  if (osxsave) {
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    xcr0 = (static_cast<unsigned long long>(hi) << 32) | lo;
  }
  bool ymm = (xcr0 & 0x6) == 0x6;     // OS saves SSE + AVX state
  bool zmm = (xcr0 & 0xe6) == 0xe6;   // ... and opmask + ZMM state
  if (!ymm) f.fma = f.f16c = false;
  __cpuid_count(7, 0, a, b, c, d);
  f.avx2 = ymm && (b & (1u << 5));
  // The portable build compiles the AVX-512 kernel files for x86-64-v4 (F, CD, BW, DQ, VL;
  // CMakeLists.txt): AVX-512 counts only with all five (every CPU with BW and VL has them).
  const bool v4 = zmm && (b & (1u << 16)) && (b & (1u << 17)) && (b & (1u << 28)) &&
                  (b & (1u << 30)) && (b & (1u << 31));
  f.avx512f = f.avx512bw = f.avx512vl = v4;
  f.avx512_vnni = v4 && (c & (1u << 11));
  __cpuid_count(7, 1, a, b, c, d);
  f.avx512_bf16 = v4 && (a & (1u << 5));
#endif
  return f;
}

// f with the features above the FERRUM_CPU_ISA level cleared.
CpuFeatures capped(CpuFeatures f) {
  const char* isa = std::getenv("FERRUM_CPU_ISA");
  if (isa == nullptr || *isa == '\0' || std::strcmp(isa, "avx512") == 0) return f;
  const bool scalar = std::strcmp(isa, "scalar") == 0;
  if (!scalar && std::strcmp(isa, "avx2") != 0)
    throw ValueError(std::string("FERRUM_CPU_ISA=") + isa + ": expected scalar, avx2 or avx512");
  f.avx512f = f.avx512bw = f.avx512vl = f.avx512_vnni = f.avx512_bf16 = false;
  if (scalar) f.avx2 = f.fma = f.f16c = false;
  return f;
}
}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures f = capped(detect());
  return f;
}

std::string CpuFeatures::str() const {
  std::string s;
  auto add = [&](bool on, const char* n) {
    if (on) s += (s.empty() ? "" : " ") + std::string(n);
  };
  add(avx2, "avx2");
  add(fma, "fma");
  add(f16c, "f16c");
  add(avx512f, "avx512f");
  add(avx512bw, "avx512bw");
  add(avx512vl, "avx512vl");
  add(avx512_vnni, "avx512_vnni");
  add(avx512_bf16, "avx512_bf16");
  return s;
}

}  // namespace ferrum
