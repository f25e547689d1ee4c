// GEMV throughput of the dot kernels: weight bytes read per second, single thread, for every
// type and ISA variant this CPU supports. Not a test; build with -DFERRUM_BENCH=ON.
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

#include "core/cpu_features.h"
#include "quant/quant.h"

using namespace ferrum;
using namespace ferrum::quant;

int main() {
  std::printf("cpu: %s\n", cpu_features().str().c_str());
  const DType types[] = {DType::F32,  DType::F16,  DType::BF16, DType::Q8_0, DType::Q4_0,
                         DType::Q4_1, DType::Q5_0, DType::Q5_1, DType::Q2_K, DType::Q3_K,
                         DType::Q4_K, DType::Q5_K, DType::Q6_K};
  const int shapes[][2] = {{576, 1536}, {4096, 4096}};  // rows x n
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-1, 1);
  std::printf("%-6s %-7s %12s %12s\n", "type", "isa", "576x1536", "4096x4096");
  for (DType t : types) {
    std::vector<double> gbps[3];
    std::vector<const char*> isas = dot_kernel_isas(t);
    for (auto& shape : shapes) {
      const int rows = shape[0], n = shape[1];
      const size_t row_bytes = dtype_bytes(t, n);
      std::vector<uint8_t> w(row_bytes * rows);
      std::vector<float> x(n);
      for (int r = 0; r < rows; ++r) {
        for (float& v : x) v = u(rng);
        quantize_row(t, x.data(), w.data() + r * row_bytes, n);
      }
      for (float& v : x) v = u(rng);
      std::vector<float> out(rows);
      for (size_t k = 0; k < isas.size(); ++k) {
        const DotKernel* kern = dot_kernel_for_isa(t, isas[k]);
        std::vector<uint8_t> act(dtype_bytes(kern->act_type, n));
        quantize_row(kern->act_type, x.data(), act.data(), n);
        // Repeat for ~0.3 s; the small matrix (L2-resident after the first pass) measures the
        // kernel's compute rate, the large one DRAM streaming.
        int reps = 0;
        const auto t0 = std::chrono::steady_clock::now();
        double elapsed = 0;
        do {
          kern->dot_rows(n, w.data(), row_bytes, rows, act.data(), out.data());
          ++reps;
          elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        } while (elapsed < 0.3);
        gbps[k].push_back(double(w.size()) * reps / elapsed / 1e9);
      }
    }
    for (size_t k = 0; k < isas.size(); ++k)
      std::printf("%-6s %-7s %9.1f GB/s %7.1f GB/s\n", dtype_name(t), isas[k], gbps[k][0],
                  gbps[k][1]);
  }
  return 0;
}
