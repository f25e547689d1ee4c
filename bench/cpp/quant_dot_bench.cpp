// GEMV throughput of the dot kernels: weight bytes read per second, single thread, for every
// type and ISA variant this CPU supports; then the batched kernels (a batch of decodes) in
// multiply-adds per second; then the prefill GEMM against dequantize + sgemm. Not a test; build
// with -DFERRUM_BENCH=ON.
// usage: quant_dot_bench [batch|gemm|prefill|stream|peak|rows TYPE|read TYPE [N [hot|2]]]   (only the batched kernels /
// the GEMM / ... / the arithmetic ceiling / one type's row kernel / one thread's decode stream against a plain read)
#include <cblas.h>
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "backend/cpu/weight_arena.h"
#include "core/cpu_features.h"
#include "quant/quant.h"
#include "quant/repack.h"

using namespace ferrum;
using namespace ferrum::quant;

// A weight format the benchmarks run: a type in the file's layout or in the CPU's R16 one.
struct Format {
  DType type;
  WeightLayout layout = WeightLayout::Plain;
  std::string name() const { return std::string(dtype_name(type)) + (layout == WeightLayout::R16 ? "_r16" : ""); }
};
constexpr WeightLayout R16 = WeightLayout::R16;

// rows x n random weights of format f (R16: quantized to the type, then repacked).
std::vector<uint8_t> random_weights(Format f, int rows, int n, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-1, 1);
  const size_t row_bytes = dtype_bytes(f.type, n);
  std::vector<uint8_t> w(row_bytes * rows);
  std::vector<float> x(n);
  for (int r = 0; r < rows; ++r) {
    for (float& v : x) v = u(rng);
    quantize_row(f.type, x.data(), w.data() + r * row_bytes, n);
  }
  if (f.layout == R16) {
    std::vector<uint8_t> packed(w.size());
    repack_r16(f.type, w.data(), packed.data(), rows, n);
    w.swap(packed);
  }
  return w;
}

// n rounded up to whole blocks of t (the k-quants: 576 -> 768).
int whole_blocks(DType t, int n) {
  const int b = dtype_info(t).block_elems;
  return (n + b - 1) / b * b;
}

// Batched kernels at T activation rows: GMAC/s over the weight matrix (rows x n), best of 5.
void bench_batch() {
  const Format formats[] = {{DType::Q8_0}, {DType::Q4_0}, {DType::Q4_1}, {DType::Q5_0}, {DType::Q5_1},
                            {DType::Q8_0, R16}, {DType::Q4_0, R16}, {DType::Q4_1, R16}, {DType::Q5_0, R16}, {DType::Q5_1, R16},
                            {DType::Q4_K, R16}, {DType::Q5_K, R16}, {DType::Q6_K, R16}, {DType::Q2_K, R16}, {DType::Q3_K, R16},
                            {DType::F16, R16}};
  // rows x n: L2-resident, and the tied lm_head of SmolLM2 (L3-resident, 3 MB of outputs at T = 16)
  const int shapes[][2] = {{576, 1536}, {1536, 576}, {49152, 576}};
  const int batch_rows[] = {2, 4, 8, 16, 32, 64};
  std::mt19937 rng(2);
  std::uniform_real_distribution<float> u(-1, 1);
  std::printf("batched (GMAC/s)    ");
  for (int T : batch_rows)
    for (auto& shape : shapes) std::printf(" T%-2d %4dx%-4d", T, shape[0], shape[1]);
  std::printf("\n");
  for (const Format& f : formats) {
    DotBatchFn batch = dot_batch_kernel(f.type, f.layout);
    if (!batch) continue;
    std::printf("%-8s            ", f.name().c_str());
    for (int T : batch_rows) {
      for (auto& shape : shapes) {
        const int rows = shape[0], n = whole_blocks(f.type, shape[1]);
        const DType act_type = dot_kernel(f.type, f.layout).act_type;
        const size_t row_bytes = dtype_bytes(f.type, n), act_bytes = dtype_bytes(act_type, n);
        std::vector<uint8_t> w = random_weights(f, rows, n, rng), act(act_bytes * T);
        std::vector<float> x(n), out(size_t(T) * rows);
        for (int r = 0; r < T; ++r) {
          for (float& v : x) v = u(rng);
          quantize_row(act_type, x.data(), act.data() + r * act_bytes, n);
        }
        double best = 1e30;
        for (int rep = 0; rep < 5; ++rep) {
          const auto t0 = std::chrono::steady_clock::now();
          for (int k = 0; k < 4; ++k)
            batch(n, w.data(), row_bytes, rows, act.data(), act_bytes, T, out.data(), rows);
          best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 4);
        }
        std::printf(" %12.1f", double(rows) * n * T / best / 1e9);
      }
    }
    std::printf("\n");
  }
}

// This thread's CPU seconds: on a shared machine, time spent descheduled does not count.
double thread_seconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

// A batch of decodes through a whole SmolLM2-135M's weights (30 layers' qkv, o, gate_up and
// down, then the tied lm_head: 93 MB of Q4_1 in R16, streamed from DRAM every step as in the engine)
// against the same kernel calls repeated on the first layer only (its 3.5 MB stay in L2 / L3):
// one thread, GMAC/s (and GB/s of weights), best of 3 steps.
void bench_stream() {
  const Format f{DType::Q4_1, R16};
  const int layer[][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}};  // rows, n
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1, 1);
  struct Matrix { int rows, n; const uint8_t* w; };
  WeightArena arena;  // as the CPU backend keeps weights: 2 MiB pages, in load order
  std::vector<WeightArena::Block> blocks;
  std::vector<Matrix> model;
  auto add = [&](int rows, int n) {
    const std::vector<uint8_t> w = random_weights(f, rows, n, rng);
    blocks.push_back(arena.allocate(w.size()));
    std::memcpy(blocks.back().data, w.data(), w.size());
    model.push_back({rows, n, static_cast<const uint8_t*>(blocks.back().data)});
  };
  for (int l = 0; l < 30; ++l)
    for (auto& sh : layer) add(sh[0], sh[1]);
  add(49152, 576);
  std::printf("decode steps through SmolLM2-135M's Q4_1 (R16) weights, one thread (GMAC/s)\n   T   streamed   layer 0 repeated\n");
  for (int T : {1, 2, 4, 6, 8, 16, 32}) {  // 2-8: steps verifying proposals
    std::vector<uint8_t> act(dtype_bytes(DType::Q8_0, 1536) * T);
    std::vector<float> x(1536), out(size_t(T) * 49152);
    for (int r = 0; r < T; ++r) {
      for (float& v : x) v = u(rng);
      quantize_row(DType::Q8_0, x.data(), act.data() + r * dtype_bytes(DType::Q8_0, 1536), 1536);
    }
    double rate[2];
    for (int hot = 0; hot < 2; ++hot) {
      double best = 1e30, macs = 0;
      for (int rep = 0; rep < 3; ++rep) {
        macs = 0;
        const double t0 = thread_seconds();
        for (size_t i = 0; i < model.size(); ++i) {
          const Matrix& m = hot ? model[i % 4] : model[i];
          const size_t ab = dtype_bytes(DType::Q8_0, m.n);
          if (T == 1)
            dot_kernel(f.type, f.layout).dot_rows(m.n, m.w, dtype_bytes(f.type, m.n), m.rows, act.data(), out.data());
          else
            dot_batch_kernel(f.type, f.layout)(m.n, m.w, dtype_bytes(f.type, m.n), m.rows, act.data(), ab, T, out.data(), m.rows);
          macs += double(m.rows) * m.n * T;
        }
        best = std::min(best, thread_seconds() - t0);
      }
      rate[hot] = macs / best / 1e9;
    }
    const double bytes_per_mac = double(dtype_bytes(f.type, 32)) / 32 / T;
    std::printf("%4d   %8.1f   %8.1f      (%.1f GB/s streamed)\n", T, rate[0], rate[1], rate[0] * bytes_per_mac);
  }
}

// Prefill at T = 128 activation rows against a 5632 x 2048 weight (TinyLlama's FFN up shape), one
// thread, GMAC per CPU second, best of 3: the int8 GEMM where the type has one, and what linear()
// does without it (dequantize 128-row tiles to f32, then sgemm).
void bench_gemm() {
  const DType types[] = {DType::Q8_0, DType::Q4_0, DType::Q2_K, DType::Q3_K, DType::Q4_K, DType::Q5_K, DType::Q6_K};
  const int T = 128, rows = 5632, n = 2048, tile = 128;
  openblas_set_num_threads(1);
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-1, 1);
  std::printf("prefill T=%d %dx%d (GMAC per CPU s)   int8 GEMM   dequantize + sgemm\n", T, rows, n);
  for (DType t : types) {
    const DType at = dot_kernel(t).act_type;
    const size_t row_bytes = dtype_bytes(t, n), act_bytes = dtype_bytes(at, n);
    std::vector<uint8_t> w(row_bytes * rows), act(act_bytes * T);
    std::vector<float> x(size_t(T) * n), out(size_t(T) * rows), wf(size_t(tile) * n);
    for (int r = 0; r < rows; ++r) {
      for (int i = 0; i < n; ++i) x[size_t(i)] = u(rng);
      quantize_row(t, x.data(), w.data() + r * row_bytes, n);
    }
    for (float& v : x) v = u(rng);
    for (int r = 0; r < T; ++r) quantize_row(at, x.data() + size_t(r) * n, act.data() + r * act_bytes, n);
    auto best_gmacs = [&](auto&& run) {
      double best = 1e30;
      for (int rep = 0; rep < 3; ++rep) {
        const double t0 = thread_seconds();
        run();
        best = std::min(best, thread_seconds() - t0);
      }
      return double(rows) * n * T / best / 1e9;
    };
    const DotBatchFn gemm = gemm_kernel(t);
    const double int8 = gemm ? best_gmacs([&] { gemm(n, w.data(), row_bytes, rows, act.data(), act_bytes, T, out.data(), rows); }) : 0;
    const double sgemm = best_gmacs([&] {
      for (int r0 = 0; r0 < rows; r0 += tile) {
        for (int r = 0; r < tile; ++r) dequantize_row(t, w.data() + (r0 + r) * row_bytes, wf.data() + size_t(r) * n, n);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, tile, n, 1.0f, x.data(), n, wf.data(), n, 0.0f,
                    out.data() + r0, rows);
      }
    });
    std::printf("%-6s                          %9.1f   %9.1f\n", dtype_name(t), int8, sgemm);
  }
}

// The int8 GEMM of a prefill chunk at SmolLM2-135M's shapes (one thread): what the model's
// linear_dot commands run per thread, without the model around them.
void bench_prefill() {
  const Format formats[] = {{DType::Q4_1, R16}, {DType::Q8_0, R16}, {DType::Q4_1}, {DType::Q5_0, R16}, {DType::Q5_0},
                            {DType::Q4_K, R16}, {DType::Q4_K}, {DType::Q5_K, R16}, {DType::Q5_K}, {DType::Q6_K, R16},
                            {DType::Q6_K}, {DType::Q2_K, R16}, {DType::Q2_K}, {DType::Q3_K, R16},
                            {DType::Q3_K}, {DType::IQ4_NL, R16}, {DType::IQ4_XS, R16}};
  const int shapes[][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}};  // rows, n
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-1, 1);
  std::printf("prefill GEMM, SmolLM2-135M shapes (GMAC per CPU s)\n%-9s %5s", "type", "T");
  for (auto& sh : shapes) std::printf("   %4dx%-4d", sh[0], sh[1]);
  std::printf("\n");
  for (const Format& f : formats)
    for (int T : {64, 512}) {
      if (!gemm_kernel(f.type, f.layout)) continue;  // no R16 kernels on this CPU
      std::printf("%-9s %5d", f.name().c_str(), T);
      for (auto& sh : shapes) {
        const int rows = sh[0], n = whole_blocks(f.type, sh[1]);
        const DType at = gemm_act_type(f.type);
        const size_t row_bytes = dtype_bytes(f.type, n), act_bytes = dtype_bytes(at, n);
        std::vector<uint8_t> w = random_weights(f, rows, n, rng), act(act_bytes * T);
        std::vector<float> x(n), out(size_t(T) * rows);
        for (int r = 0; r < T; ++r) {
          for (float& v : x) v = u(rng);
          quantize_row(at, x.data(), act.data() + r * act_bytes, n);
        }
        const DotBatchFn gemm = gemm_kernel(f.type, f.layout);
        double best = 1e30;
        for (int rep = 0; rep < 5; ++rep) {
          const double t0 = thread_seconds();
          gemm(n, w.data(), row_bytes, rows, act.data(), act_bytes, T, out.data(), rows);
          best = std::min(best, thread_seconds() - t0);
        }
        std::printf("   %9.1f", double(rows) * n * T / best / 1e9);
      }
      std::printf("\n");
    }
}

// The bytes of [p, p + bytes) summed as 64-bit integers: what a plain read of the weights costs.
__attribute__((target("avx2"))) uint64_t plain_read(const uint8_t* p, size_t bytes) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  for (size_t o = 0; o + 128 <= bytes; o += 128) {
    a0 = _mm256_add_epi64(a0, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + o)));
    a1 = _mm256_add_epi64(a1, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + o + 32)));
    a2 = _mm256_add_epi64(a2, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + o + 64)));
    a3 = _mm256_add_epi64(a3, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + o + 96)));
  }
  alignas(32) uint64_t v[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(v), _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3)));
  return v[0] + v[1] + v[2] + v[3];
}

// A decode's stream: 256 MB of TYPE weights (rows x n; 512 MB for two threads) on the engine's
// 2 MiB pages, read by the row kernel in calls of 1536 rows (a SmolLM2 MLP matrix's), each thread
// its half of the rows as the engine splits a matmul, and by a plain read of the same bytes; the
// two alternate, 9 times (this VM's bandwidth drifts, in phases of seconds to minutes, so each
// pair is printed: the medians of the pairs would mix phases). hot: 256 rows read 2000 times
// instead (in L2: the kernel's compute rate).
void bench_read(Format f, int n, bool hot, int threads) {
  const size_t row_bytes = dtype_bytes(f.type, n);
  const int rows = hot ? 256 : int((size_t(threads) << 28) / row_bytes) & ~15, call_rows = 1536, passes = hot ? 2000 : 1;
  std::mt19937 rng(3);
  const std::vector<uint8_t> one = random_weights(f, std::min(rows, call_rows), n, rng);
  WeightArena arena;
  WeightArena::Block block = arena.allocate(row_bytes * rows);
  uint8_t* w = static_cast<uint8_t*>(block.data);
  for (int r = 0; r < rows; r += call_rows)
    std::memcpy(w + r * row_bytes, one.data(), std::min<size_t>(one.size(), (rows - r) * row_bytes));
  const DotKernel& kern = dot_kernel(f.type, f.layout);
  std::vector<float> x(n);
  std::uniform_real_distribution<float> u(-1, 1);
  for (float& v : x) v = u(rng);
  WeightArena::Block act = arena.allocate(dtype_bytes(kern.act_type, n));  // 64-byte aligned
  quantize_row(kern.act_type, x.data(), act.data, n);
  const int share = rows / threads / 16 * 16;  // each thread's rows: whole 16-row groups
  std::vector<uint64_t> sinks(static_cast<size_t>(threads));
  const auto on_threads = [&](auto body) {  // body(first row, row count, thread)
    std::vector<std::thread> pool;
    for (int i = 0; i < threads; ++i) pool.emplace_back(body, i * share, i + 1 < threads ? share : rows - i * share, i);
    for (std::thread& th : pool) th.join();
  };
  const auto kernel_pass = [&](int r0, int count, int) {
    std::vector<float> out(call_rows);
    for (int p = 0; p < passes; ++p)
      for (int r = r0; r < r0 + count; r += call_rows)
        kern.dot_rows(n, w + r * row_bytes, row_bytes, std::min(call_rows, r0 + count - r), act.data, out.data());
  };
  const auto read_pass = [&](int r0, int count, int i) {
    for (int p = 0; p < passes; ++p) sinks[size_t(i)] += plain_read(w + r0 * row_bytes, size_t(count) * row_bytes);
  };
  const double bytes = double(row_bytes) * rows * passes;
  std::printf("%s %dx%d%s, %d thread%s: row kernel / plain read GB/s\n ", f.name().c_str(), rows, n, hot ? " (hot)" : "",
              threads, threads > 1 ? "s" : "");
  std::vector<double> shares;
  for (int rep = 0; rep < 9; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    on_threads(kernel_pass);
    const auto t1 = std::chrono::steady_clock::now();
    on_threads(read_pass);
    const auto t2 = std::chrono::steady_clock::now();
    const double k = bytes / std::chrono::duration<double>(t1 - t0).count() / 1e9;
    const double r = bytes / std::chrono::duration<double>(t2 - t1).count() / 1e9;
    shares.push_back(k / r);
    std::printf(" %.1f/%.1f", k, r);
  }
  std::sort(shares.begin(), shares.end());
  std::printf("\n  median share %.0f%%%s\n", 100 * shares[4], sinks[0] == 1 ? " " : "");
}

// The arithmetic ceiling: independent f32 FMAs (GFMA/s) and int8 dot products (GMAC/s), on 1
// thread and on 2 at once. AVX-512: 512-bit FMAs (16 a vector) and VNNI (64 a vector). AVX2: 256-bit
// FMAs (8 a vector) and maddubs accumulated by an int16 add (32 a vector, the least an AVX2 int8
// dot product does per product: its GEMMs' ceiling).
template <class Step>
double peak_rate(int threads, double macs_per_step, Step step) {
  constexpr long kSteps = 20000000;
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  std::vector<float> sinks(static_cast<size_t>(threads));
  for (int i = 0; i < threads; ++i) pool.emplace_back([&, i] { sinks[size_t(i)] = step(kSteps); });
  for (std::thread& th : pool) th.join();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  volatile float keep = sinks[0];  // the sums are used: the loops stay
  (void)keep;
  return threads * kSteps * macs_per_step / s / 1e9;
}

constexpr int kChains = 12;  // independent accumulators: more than latency x throughput

__attribute__((target("avx512f"))) float fma_steps(long steps) {
  __m512 acc[kChains];
  for (int j = 0; j < kChains; ++j) acc[j] = _mm512_set1_ps(float(j));
  const __m512 b = _mm512_set1_ps(1.0f), c = _mm512_set1_ps(1e-7f);
  for (long i = 0; i < steps; ++i)
    for (__m512& a : acc) a = _mm512_fmadd_ps(a, b, c);
  float s = 0;
  for (__m512& a : acc) s += _mm512_reduce_add_ps(a);
  return s;
}

__attribute__((target("avx512f,avx512vnni"))) float vnni_steps(long steps) {
  __m512i acc[kChains];
  for (int j = 0; j < kChains; ++j) acc[j] = _mm512_set1_epi32(j);
  const __m512i b = _mm512_set1_epi8(1), c = _mm512_set1_epi8(2);
  for (long i = 0; i < steps; ++i)
    for (__m512i& a : acc) a = _mm512_dpbusd_epi32(a, b, c);
  int s = 0;
  for (__m512i& a : acc) s += _mm512_reduce_add_epi32(a);
  return float(s);
}

__attribute__((target("avx2,fma"))) float fma256_steps(long steps) {
  __m256 acc[kChains];
  for (int j = 0; j < kChains; ++j) acc[j] = _mm256_set1_ps(float(j));
  const __m256 b = _mm256_set1_ps(1.0f), c = _mm256_set1_ps(1e-7f);
  for (long i = 0; i < steps; ++i)
    for (__m256& a : acc) a = _mm256_fmadd_ps(a, b, c);
  alignas(32) float lanes[8];
  __m256 s = acc[0];
  for (int j = 1; j < kChains; ++j) s = _mm256_add_ps(s, acc[j]);
  _mm256_store_ps(lanes, s);
  return lanes[0];
}

// One accumulator's step of maddubs_steps: three products of its operand, made opaque first (an
// empty asm) so that they cannot be hoisted out of the loop.
__attribute__((target("avx2"), always_inline)) inline void three_products(__m256i& acc, __m256i& x, __m256i c0,
                                                                          __m256i c1, __m256i c2) {
  asm("" : "+x"(x));
  acc = _mm256_add_epi16(acc, _mm256_maddubs_epi16(x, c0));
  acc = _mm256_add_epi16(acc, _mm256_maddubs_epi16(x, c1));
  acc = _mm256_add_epi16(acc, _mm256_maddubs_epi16(x, c2));
}

// Four accumulators of three products each a step (named variables: an array of them stays in
// memory), 12 in all, as kChains.
__attribute__((target("avx2"))) float maddubs_steps(long steps) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  __m256i x0 = _mm256_set1_epi8(1), x1 = _mm256_set1_epi8(2), x2 = _mm256_set1_epi8(3), x3 = _mm256_set1_epi8(4);
  const __m256i c0 = _mm256_set1_epi8(2), c1 = _mm256_set1_epi8(3), c2 = _mm256_set1_epi8(5);
  for (long i = 0; i < steps; ++i) {
    three_products(a0, x0, c0, c1, c2), three_products(a1, x1, c0, c1, c2);
    three_products(a2, x2, c0, c1, c2), three_products(a3, x3, c0, c1, c2);
  }
  const __m256i s = _mm256_add_epi16(_mm256_add_epi16(a0, a1), _mm256_add_epi16(a2, a3));
  return float(_mm256_extract_epi16(s, 0));
}

void bench_peak() {
  for (int threads : {1, 2}) {
    std::printf("%d thread%s:", threads, threads > 1 ? "s" : " ");
    if (cpu_features().avx512f && cpu_features().avx512_vnni)
      std::printf(" AVX-512 f32 FMA %.1f GFMA/s, int8 VNNI %.1f GMAC/s;", peak_rate(threads, kChains * 16, fma_steps),
                  peak_rate(threads, kChains * 64, vnni_steps));
    std::printf(" AVX2 f32 FMA %.1f GFMA/s, int8 maddubs + add %.1f GMAC/s\n", peak_rate(threads, kChains * 8, fma256_steps),
                peak_rate(threads, kChains * 32, maddubs_steps));
  }
}

int main(int argc, char** argv) {
  std::printf("cpu: %s\n", cpu_features().str().c_str());
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "peak") {
    bench_peak();
    return 0;
  }
  if (mode == "prefill") {
    bench_prefill();
    return 0;
  }
  if (mode == "stream") {
    bench_stream();
    return 0;
  }
  if (mode == "read" && argc > 2) {
    for (int i = 0; i <= int(kLastType); ++i)
      for (WeightLayout layout : {WeightLayout::Plain, R16}) {
        const Format f{DType(i), layout};
        if (argv[2] != f.name()) continue;
        const std::string opt = argc > 4 ? argv[4] : "";
        bench_read(f, argc > 3 ? std::atoi(argv[3]) : 576, opt == "hot", opt == "2" ? 2 : 1);
      }
    return 0;
  }
  if (mode == "batch" || mode == "gemm") {
    mode == "batch" ? bench_batch() : bench_gemm();
    return 0;
  }
  const std::string only = mode == "rows" && argc > 2 ? argv[2] : "";  // rows TYPE: that row kernel
  const Format formats[] = {{DType::F32}, {DType::F16}, {DType::BF16}, {DType::Q8_0}, {DType::Q4_0},
                            {DType::Q4_1}, {DType::Q5_0}, {DType::Q5_1}, {DType::Q2_K}, {DType::Q3_K},
                            {DType::Q4_K}, {DType::Q5_K}, {DType::Q6_K}, {DType::Q8_0, R16}, {DType::Q4_0, R16},
                            {DType::Q4_1, R16}, {DType::Q5_0, R16}, {DType::Q5_1, R16}, {DType::Q4_K, R16},
                            {DType::Q5_K, R16}, {DType::Q6_K, R16}, {DType::Q2_K, R16}, {DType::Q3_K, R16},
                            {DType::IQ4_NL}, {DType::IQ4_XS}, {DType::IQ4_NL, R16}, {DType::IQ4_XS, R16},
                            {DType::F16, R16}, {DType::BF16, R16}};
  // rows x n: L2-resident, L3-resident (up to 32 MB), and 64 MB worth of rows (DRAM)
  const int shapes[][2] = {{576, 1536}, {4096, 4096}, {0, 4096}};
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-1, 1);
  std::printf("%-8s %-7s %12s %12s %12s\n", "type", "isa", "576x1536", "4096x4096", "64MBx4096");
  for (const Format& f : formats) {
    if (!only.empty() && only != f.name()) continue;
    std::vector<double> gbps[3];
    std::vector<const char*> isas = dot_kernel_isas(f.type, f.layout);
    for (auto& shape : shapes) {
      const int n = shape[1];
      const size_t row_bytes = dtype_bytes(f.type, n);
      const int rows = (shape[0] ? shape[0] : int((64 << 20) / row_bytes)) & ~15;  // R16: whole groups
      const std::vector<uint8_t> w = random_weights(f, rows, n, rng);
      std::vector<float> x(n);
      for (float& v : x) v = u(rng);
      std::vector<float> out(rows);
      for (size_t k = 0; k < isas.size(); ++k) {
        const DotKernel* kern = dot_kernel_for_isa(f.type, isas[k], f.layout);
        std::vector<uint8_t> act(dtype_bytes(kern->act_type, n));
        quantize_row(kern->act_type, x.data(), act.data(), n);
        // Repeat for ~0.3 s; the small matrix (L2-resident after the first pass) measures the
        // kernel's compute rate, the largest one DRAM streaming.
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
      std::printf("%-8s %-7s %9.1f GB/s %7.1f GB/s %7.1f GB/s\n", f.name().c_str(), isas[k], gbps[k][0],
                  gbps[k][1], gbps[k][2]);
  }
  if (only.empty()) {
    bench_batch();
    bench_gemm();
  }
  return 0;
}
