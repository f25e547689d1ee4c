#include "io/group_quant.h"

#include <algorithm>

#include <cstring>

#include "core/error.h"
#include "quant/formats.h"

namespace ferrum {

using json = nlohmann::json;

namespace {
constexpr int kBlock = quant::kQK;
}

const TensorInfo& packed_tensor(const WeightSource& ws, const std::string& name, DType dtype, const Shape& shape,
                                const std::string& why, const char* method) {
  const std::string what = ws.path + ": " + method + " tensor '" + name + "'";
  const TensorInfo* t = ws.find(name);
  if (!t) throw ValueError(what + " is missing");
  if (t->dtype != dtype)
    throw ValueError(what + " has dtype " + dtype_name(t->dtype) + ", expected " + dtype_name(dtype));
  if (t->shape != shape)
    throw ValueError(what + " has shape " + shape_str(t->shape) + ", expected " + shape_str(shape) + " (" + why + ")");
  return *t;
}

uint32_t packed_word(const TensorInfo& t, int64_t i) {
  uint32_t w;
  std::memcpy(&w, t.data + 4 * i, 4);
  return w;
}

const json* config_field(const json& q, const char* key) {
  auto it = q.find(key);
  return it == q.end() || it->is_null() ? nullptr : &*it;
}

int64_t config_int(const json& q, const char* key, int64_t fallback, const std::string& where) {
  const json* v = config_field(q, key);
  if (!v) return fallback;
  if (!v->is_number_integer()) throw ValueError(where + " '" + key + "' must be an integer, not " + v->dump());
  return v->get<int64_t>();
}

std::string config_string(const json& q, const char* key, const std::string& fallback, const std::string& where) {
  const json* v = config_field(q, key);
  if (!v) return fallback;
  if (!v->is_string()) throw ValueError(where + " '" + key + "' must be a string, not " + v->dump());
  return v->get<std::string>();
}

bool config_bool(const json& q, const char* key, bool fallback, const std::string& where) {
  const json* v = config_field(q, key);
  if (!v) return fallback;
  if (!v->is_boolean()) throw ValueError(where + " '" + key + "' must be true or false, not " + v->dump());
  return v->get<bool>();
}

void store_as_blocks(WeightSource& ws, const std::string& module, const GroupCodes& c, const char* method,
                     const std::vector<std::string>& packed_suffixes) {
  const int64_t N = c.N, K = c.K, G = c.groups();
  const int mid = 1 << (c.bits - 1);
  bool symmetric = true;
  for (uint8_t z : c.zeros) symmetric = symmetric && z == mid;
  const std::string out_name = module + ".weight";
  const DType dtype = c.bits == 8 ? DType::Q8_0 : symmetric ? DType::Q4_0 : DType::Q5_0;
  const int64_t blocks = K / kBlock;
  const size_t row_bytes = dtype_bytes(dtype, K);
  auto home = MappedFile::anonymous(ws.path + ": " + out_name + " (from " + method + ")", row_bytes * size_t(N));
  char* out = home->writable();
  for (int64_t n = 0; n < N; ++n) {
    const uint8_t* qn = c.q.data() + n * K;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t g = c.block_group(b);
      const uint16_t d = c.scales[size_t(n * G + g)];
      const int z = c.zeros[size_t(n * G + g)];
      const uint8_t* v = qn + b * kBlock;
      char* dst = out + size_t(n) * row_bytes + size_t(b) * dtype_bytes(dtype, kBlock);
      if (dtype == DType::Q4_0) {
        quant::BlockQ4_0 blk;
        blk.d = d;
        for (int j = 0; j < kBlock / 2; ++j) blk.qs[j] = uint8_t(v[j] | (v[j + kBlock / 2] << 4));
        std::memcpy(dst, &blk, sizeof blk);
      } else if (dtype == DType::Q5_0) {
        quant::BlockQ5_0 blk;
        blk.d = d;
        uint32_t qh = 0;
        uint8_t u[kBlock];
        for (int j = 0; j < kBlock; ++j) {
          u[j] = uint8_t(int(v[j]) - z + 16);  // 1..31
          qh |= uint32_t(u[j] >> 4) << j;
        }
        for (int j = 0; j < kBlock / 2; ++j) blk.qs[j] = uint8_t((u[j] & 15) | ((u[j + kBlock / 2] & 15) << 4));
        std::memcpy(blk.qh, &qh, 4);
        std::memcpy(dst, &blk, sizeof blk);
      } else {
        quant::BlockQ8_0 blk;
        blk.d = d;
        for (int j = 0; j < kBlock; ++j) blk.qs[j] = int8_t(int(v[j]) - 128);
        std::memcpy(dst, &blk, sizeof blk);
      }
    }
  }

  for (const std::string& suffix : packed_suffixes) {
    auto it = ws.tensors.find(module + suffix);
    if (it == ws.tensors.end()) continue;
    it->second.file->release_pages(it->second.data, it->second.nbytes);
    ws.tensors.erase(it);
  }
  TensorInfo t;
  t.name = out_name;
  t.dtype = dtype;
  t.shape = {N, K};
  t.data = home->data();
  t.nbytes = home->size();
  t.file = home;
  if (!c.input_order.empty()) t.input_order = std::make_shared<const std::vector<int32_t>>(c.input_order);
  if (c.bits == 8 && !symmetric) {
    auto go = std::make_shared<GroupOffsets>();
    go->groups = G;
    go->offsets.resize(size_t(N * G));
    for (int64_t i = 0; i < N * G; ++i)  // exact: an f16 times an integer of 8 bits
      go->offsets[size_t(i)] = f16_to_f32(c.scales[size_t(i)]) * float(128 - int(c.zeros[size_t(i)]));
    go->block_groups.resize(size_t(blocks));
    for (int64_t b = 0; b < blocks; ++b) go->block_groups[size_t(b)] = int32_t(c.block_group(b));
    t.group_offsets = std::move(go);
  }
  ws.tensors[out_name] = std::move(t);
}

void group_inputs(GroupCodes& c, const std::vector<int32_t>& g_idx, const std::string& where,
                  const std::string& tensor) {
  const int64_t K = c.K, N = c.N, G = c.groups();
  std::vector<int64_t> count(size_t(G), 0);
  for (int32_t g : g_idx) count[size_t(g)]++;
  for (int64_t g = 0; g < G; ++g)
    if (count[size_t(g)] % kBlock != 0)
      throw ValueError(where + " tensor '" + tensor + "' puts " + std::to_string(count[size_t(g)]) +
                       " inputs in group " + std::to_string(g) + ", not a multiple of " + std::to_string(kBlock) +
                       " (ferrum keeps each group whole blocks of " + std::to_string(kBlock) + ")");
  c.input_order.resize(size_t(K));
  for (int64_t k = 0; k < K; ++k) c.input_order[size_t(k)] = int32_t(k);
  std::stable_sort(c.input_order.begin(), c.input_order.end(),
                   [&](int32_t a, int32_t b) { return g_idx[size_t(a)] < g_idx[size_t(b)]; });
  c.block_groups.resize(size_t(K / kBlock));
  for (int64_t b = 0; b < K / kBlock; ++b) c.block_groups[size_t(b)] = g_idx[size_t(c.input_order[size_t(b * kBlock)])];
  std::vector<uint8_t> row(static_cast<size_t>(K));
  for (int64_t n = 0; n < N; ++n) {
    uint8_t* q = c.q.data() + n * K;
    for (int64_t j = 0; j < K; ++j) row[size_t(j)] = q[c.input_order[size_t(j)]];
    std::copy(row.begin(), row.end(), q);
  }
}

}  // namespace ferrum
