// A LoRA adapter's shares under tensor and pipeline parallelism (model/lora.h): every rank's
// updates, multiplied out, are the whole update's rows (q/k/v, gate/up: split by output rows) or
// columns (o, down: split by input columns) it holds, whatever the storage dtype; a stage holds
// its layers' updates only.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>

#include "backend/backend.h"
#include "backend/cpu/cpu_backend.h"
#include "core/error.h"
#include "model/lora.h"
#include "quant/quant.h"

using namespace ferrum;

namespace {

// 4 heads of 16, 2 KV heads, intermediate 96: o's input shares of 32 columns (2 ranks) are whole
// q8_0 blocks, of 16 (4 ranks) not, nor down's of 48 or 24.
ModelConfig config() {
  ModelConfig c;
  c.arch = "llama";
  c.hidden = 64;
  c.layers = 2;
  c.heads = 4;
  c.kv_heads = 2;
  c.head_dim = 16;
  c.intermediate = 96;
  c.vocab = 512;
  return c;
}

std::vector<uint8_t> stored(DType t, const std::vector<float>& v) {
  std::vector<uint8_t> bytes(dtype_bytes(t, int64_t(v.size())));
  if (t == DType::F32) std::memcpy(bytes.data(), v.data(), bytes.size());
  else quant::quantize_row(t, v.data(), bytes.data(), int64_t(v.size()));
  return bytes;
}

LoraPart part(const ModelConfig& c, int64_t site, int64_t out_col, int64_t n, int64_t rank, DType a_dtype,
              std::mt19937& rng) {
  std::normal_distribution<float> normal;
  LoraPart p;
  p.site = site;
  p.rank = rank;
  p.n = n;
  p.out_col = out_col;
  p.scale = 0.75f;
  p.a_dtype = a_dtype;
  std::vector<float> a(size_t(rank * lora_site_shape(c, site).in)), b(size_t(n * rank));
  for (float& x : a) x = normal(rng);
  for (float& x : b) x = normal(rng);
  p.a = stored(a_dtype, a);
  p.b = stored(DType::F32, b);
  return p;
}

// q, k, some of v's rows, gate and up (f32 A), o and down (q8_0 A) of both layers.
std::vector<LoraPart> parts(const ModelConfig& c) {
  std::mt19937 rng(3);
  std::vector<LoraPart> ps;
  for (int64_t l = 0; l < c.layers; ++l) {
    const int64_t q = c.q_dim(), kv = c.kv_dim(), I = c.intermediate;
    ps.push_back(part(c, lora_site(l, LoraSite::Qkv), 0, q, 4, DType::F32, rng));
    ps.push_back(part(c, lora_site(l, LoraSite::Qkv), q, kv, 2, DType::F32, rng));
    ps.push_back(part(c, lora_site(l, LoraSite::Qkv), q + kv + 5, kv - 9, 3, DType::F32, rng));
    ps.push_back(part(c, lora_site(l, LoraSite::O), 0, c.hidden, 4, DType::Q8_0, rng));
    ps.push_back(part(c, lora_site(l, LoraSite::GateUp), 0, I, 4, DType::F32, rng));
    ps.push_back(part(c, lora_site(l, LoraSite::GateUp), I, I, 4, DType::F32, rng));
    ps.push_back(part(c, lora_site(l, LoraSite::Down), 0, c.hidden, 4, DType::Q8_0, rng));
  }
  return ps;
}

// A CPU tensor's values as [rows, cols], in whatever layout the backend keeps it.
std::vector<float> values(const Tensor& t) {
  std::vector<float> v(size_t(t.numel()));
  quant::dequantize_rows(t.dtype, layout_of(t), host_ptr<uint8_t>(t), 0, t.rows(), t.cols(), v.data());
  return v;
}

// The site's whole update scale * B A as [out, in], in double.
std::vector<double> product(const std::vector<LoraUpdate>& ups, int64_t out, int64_t in) {
  std::vector<double> d(size_t(out * in), 0.0);
  for (const LoraUpdate& u : ups) {
    const std::vector<float> a = values(u.a), b = values(u.b);
    const int64_t r = u.a.dim(0), n = u.b.dim(0), k = u.a.dim(1);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < k; ++j) {
        double s = 0;
        for (int64_t x = 0; x < r; ++x) s += double(b[size_t(i * r + x)]) * double(a[size_t(x * k + j)]);
        d[size_t((u.out_col + i) * in + j)] += double(u.scale) * s;
      }
  }
  return d;
}

// The whole fused output's column of a rank's column j: its rows of q, then of k, then of v (or
// of gate, then of up).
int64_t whole_column(const ModelConfig& c, const TensorSplit& s, LoraSite site, int64_t j) {
  const int64_t hd = c.head_dim;
  if (site == LoraSite::GateUp)
    return j < s.intermediate ? s.inter0 + j : c.intermediate + s.inter0 + (j - s.intermediate);
  const int64_t qn = s.heads * hd, kvn = s.kv_heads * hd;
  if (j < qn) return s.head0 * hd + j;
  if (j < qn + kvn) return c.q_dim() + s.kv_head0 * hd + (j - qn);
  return c.q_dim() + c.kv_dim() + s.kv_head0 * hd + (j - qn - kvn);
}

}  // namespace

TEST(LoraShare, EachRankHoldsItsRowsOrColumnsOfTheWholeUpdate) {
  auto be = make_backend("cpu", 1);
  for (const int64_t kv_heads : {2, 1}) {
    ModelConfig c = config();
    c.kv_heads = kv_heads;
    const auto whole = make_lora_adapter(*be, c, 8, parts(c), 1);
    for (int ranks : {2, 4}) {
      std::vector<std::vector<double>> assembled(whole->sites.size());
      for (int r = 0; r < ranks; ++r) {
        const TensorSplit s = split_model(c, r, ranks);
        const ModelConfig l = s.local(c);
        const auto mine = make_lora_adapter(*be, c, 8, parts(c), 1, s, PipelineStage{0, 1, 0, c.layers});
        EXPECT_LT(mine->bytes, whole->bytes);
        for (size_t site = 0; site < whole->sites.size(); ++site) {
          const LoraSiteShape ws = lora_site_shape(c, int64_t(site)), ls = lora_site_shape(l, int64_t(site));
          for (const LoraUpdate& u : mine->sites[site]) {
            EXPECT_EQ(u.a.dim(1), ls.in);
            EXPECT_LE(u.out_col + u.b.dim(0), ls.out);
          }
          const std::vector<double> got = product(mine->sites[site], ls.out, ls.in);
          std::vector<double>& all = assembled[site];
          all.resize(size_t(ws.out * ws.in), 0.0);
          const LoraSite kind = LoraSite(int64_t(site) % kLoraSitesPerLayer);
          if (kind == LoraSite::Qkv || kind == LoraSite::GateUp) {  // its output rows, whole
            for (int64_t j = 0; j < ls.out; ++j)
              for (int64_t k = 0; k < ws.in; ++k)
                all[size_t(whole_column(c, s, kind, j) * ws.in + k)] = got[size_t(j * ws.in + k)];
          } else {  // its input columns
            const int64_t c0 = kind == LoraSite::O ? s.head0 * c.head_dim : s.inter0;
            for (int64_t i = 0; i < ws.out; ++i)
              for (int64_t k = 0; k < ls.in; ++k) all[size_t(i * ws.in + c0 + k)] = got[size_t(i * ls.in + k)];
          }
        }
      }
      for (size_t site = 0; site < whole->sites.size(); ++site) {
        const LoraSiteShape ws = lora_site_shape(c, int64_t(site));
        const std::vector<double> want = product(whole->sites[site], ws.out, ws.in);
        for (size_t i = 0; i < want.size(); ++i)
          ASSERT_NEAR(assembled[site][i], want[i], 1e-9 * (1 + std::abs(want[i])))
              << "site " << site << " ranks " << ranks << " kv_heads " << kv_heads << " element " << i;
      }
    }
  }
}

TEST(LoraShare, AStageHoldsItsLayersOnly) {
  auto be = make_backend("cpu", 1);
  const ModelConfig c = config();
  const auto second = make_lora_adapter(*be, c, 8, parts(c), 1, TensorSplit{}, PipelineStage{1, 2, 1, 1});
  const size_t per_site[kLoraSitesPerLayer] = {3, 1, 2, 1};  // q/k/v, o, gate/up, down
  for (int64_t site = 0; site < int64_t(second->sites.size()); ++site)
    EXPECT_EQ(second->sites[size_t(site)].size(), site < kLoraSitesPerLayer ? 0 : per_site[site % kLoraSitesPerLayer]);
}

TEST(LoraShare, AnUpdateAcrossTwoPartsOfAFusedOutputIsRefusedWhenSplit) {
  auto be = make_backend("cpu", 1);
  const ModelConfig c = config();
  std::mt19937 rng(5);
  // q's last 8 rows and k's first 8
  std::vector<LoraPart> across{part(c, lora_site(0, LoraSite::Qkv), c.q_dim() - 8, 16, 2, DType::F32, rng)};
  EXPECT_NO_THROW(make_lora_adapter(*be, c, 8, across, 1));
  try {
    make_lora_adapter(*be, c, 8, across, 1, split_model(c, 1, 2), PipelineStage{0, 1, 0, c.layers});
    FAIL() << "no ValueError";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("within one of its parts"), std::string::npos) << e.what();
  }
}
