#include "model/rope.h"

#include <cmath>

#include "core/error.h"

namespace ferrum {

namespace {
// Llama-3: keep high frequencies, divide low ones by factor, blend in between.
double llama3_scaled(double freq, const ModelConfig& c) {
  const double wavelen = 2.0 * M_PI / freq;
  const double low_wavelen = c.rope_original_max_positions / c.rope_low_freq_factor;
  const double high_wavelen = c.rope_original_max_positions / c.rope_high_freq_factor;
  if (wavelen < high_wavelen) return freq;
  if (wavelen > low_wavelen) return freq / c.rope_factor;
  double smooth = (c.rope_original_max_positions / wavelen - c.rope_low_freq_factor) /
                  (c.rope_high_freq_factor - c.rope_low_freq_factor);
  return (1.0 - smooth) * freq / c.rope_factor + smooth * freq;
}
}  // namespace

RopeTable make_rope_table(Backend& be, const ModelConfig& c, int64_t positions,
                          const std::vector<float>& freq_factors) {
  const int64_t half = c.head_dim / 2;
  if (!freq_factors.empty() && int64_t(freq_factors.size()) != half)
    throw FormatError("rope_freqs has " + std::to_string(freq_factors.size()) + " entries, expected " +
                      std::to_string(half));
  std::vector<double> freq(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) {
    double f = 1.0 / std::pow(c.rope_theta, double(2 * i) / double(c.head_dim));
    if (c.rope_factor > 0) f = llama3_scaled(f, c);
    if (!freq_factors.empty()) {
      const float divisor = freq_factors[size_t(i)];
      if (!(std::isfinite(divisor) && divisor > 0))
        throw FormatError("rope_freqs holds " + std::to_string(divisor) + ", not a positive divisor");
      f /= divisor;
    }
    freq[size_t(i)] = f;
  }
  std::vector<float> cs(size_t(positions * half)), sn(cs.size());
  for (int64_t p = 0; p < positions; ++p)
    for (int64_t i = 0; i < half; ++i) {
      double a = double(p) * freq[size_t(i)];
      cs[size_t(p * half + i)] = float(std::cos(a));
      sn[size_t(p * half + i)] = float(std::sin(a));
    }
  RopeTable t;
  t.cos = be.from_host(cs.data(), DType::F32, {positions, half});
  t.sin = be.from_host(sn.data(), DType::F32, {positions, half});
  t.layout = c.rope_layout;
  return t;
}

}  // namespace ferrum
