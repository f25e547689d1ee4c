#include "io/safetensors.h"

#include <algorithm>
#include <fstream>
#include <iterator>
#include <set>
#include <cstring>

#include "core/error.h"
#include "io/json_strict.h"

namespace ferrum {

using json = nlohmann::json;

namespace {
DType dtype_from_safetensors(const std::string& s, const std::string& what) {
  if (s == "F32") return DType::F32;
  if (s == "F16") return DType::F16;
  if (s == "BF16") return DType::BF16;
  if (s == "I32") return DType::I32;
  if (s == "I8") return DType::I8;
  if (s == "I64") return DType::I64;
  throw FormatError(what + " has dtype " + s + ", which ferrum does not read");
}

bool exists(const std::string& p) { return std::ifstream(p).good(); }

// One header entry as read, before the tiling check.
struct Entry {
  TensorInfo info;
  uint64_t begin, end;
};

Entry read_entry(const std::string& name, const json& entry, uint64_t data_len, const std::string& what) {
  if (!entry.is_object()) throw FormatError(what + " is not described by a JSON object");
  auto field = [&](const char* key) -> const json& {
    auto it = entry.find(key);
    if (it == entry.end()) throw FormatError(what + " has no '" + key + "'");
    return *it;
  };
  const json& dtype = field("dtype");
  const json& shape = field("shape");
  const json& offsets = field("data_offsets");
  if (!dtype.is_string()) throw FormatError(what + " has a dtype that is not a string");
  if (!shape.is_array()) throw FormatError(what + " has a shape that is not a list");
  if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() || !offsets[1].is_number_unsigned())
    throw FormatError(what + " data_offsets must be two non-negative integers");
  Entry e;
  e.info.name = name;
  e.info.dtype = dtype_from_safetensors(dtype.get<std::string>(), what);
  for (const json& d : shape) {
    if (!d.is_number_unsigned()) throw FormatError(what + " has a dimension that is not a non-negative integer");
    if (d.get<uint64_t>() > uint64_t(1) << 48) throw FormatError(what + " has a dimension of " + d.dump());
    e.info.shape.push_back(d.get<int64_t>());
  }
  e.info.nbytes = tensor_file_bytes(e.info.dtype, e.info.shape, what);
  if (e.info.shape.empty()) e.info.shape.push_back(1);  // a scalar
  e.begin = offsets[0].get<uint64_t>();
  e.end = offsets[1].get<uint64_t>();
  if (e.begin > e.end || e.end > data_len)
    throw FormatError(what + " data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) +
                      ") lie outside the " + std::to_string(data_len) + "-byte data section");
  if (e.end - e.begin != e.info.nbytes)
    throw FormatError(what + " has " + std::to_string(e.end - e.begin) + " bytes but its shape and dtype need " +
                      std::to_string(e.info.nbytes));
  return e;
}
}  // namespace

void read_safetensors_file(const std::string& path, WeightSource& ws) {
  auto file = MappedFile::open(path);
  if (file->size() < 8) throw FormatError(path + ": too short for a safetensors file");
  uint64_t header_len;
  std::memcpy(&header_len, file->data(), 8);
  if (header_len > file->size() - 8)
    throw FormatError(path + ": safetensors header length " + std::to_string(header_len) +
                      " runs past the end of the file");
  const json header = parse_json_strict(file->data() + 8, file->data() + 8 + header_len, path + ": safetensors header");
  if (!header.is_object()) throw FormatError(path + ": safetensors header is not a JSON object");
  const uint64_t data_start = 8 + header_len, data_len = file->size() - data_start;
  std::vector<Entry> entries;
  for (auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) throw FormatError(path + ": __metadata__ is not a JSON object");
      continue;
    }
    const std::string what = path + ": tensor '" + name + "'";
    if (ws.tensors.count(name)) throw FormatError(what + " appears in two files");
    entries.push_back(read_entry(name, entry, data_len, what));
  }
  // The data section is the tensors' bytes, back to back: no gap, no overlap, nothing after.
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t at = 0;
  const std::string* previous = nullptr;
  for (const Entry& e : entries) {
    const std::string what = path + ": tensor '" + e.info.name + "'";
    if (e.begin < at)
      throw FormatError(what + " data [" + std::to_string(e.begin) + ", " + std::to_string(e.end) + ") overlaps tensor '" +
                        *previous + "'");
    if (e.begin > at)
      throw FormatError(path + ": bytes [" + std::to_string(at) + ", " + std::to_string(e.begin) +
                        ") of the data section belong to no tensor");
    at = e.end;
    previous = &e.info.name;
  }
  if (at != data_len)
    throw FormatError(path + ": the last " + std::to_string(data_len - at) +
                      " bytes of the data section belong to no tensor (does the header length " +
                      std::to_string(header_len) + " match the header?)");
  for (Entry& e : entries) {
    e.info.data = file->data() + data_start + e.begin;
    e.info.file = file;
    std::string name = e.info.name;
    ws.tensors[name] = std::move(e.info);
  }
}

WeightSource open_safetensors_dir(const std::string& dir) {
  WeightSource ws;
  ws.path = dir;
  const std::string single = dir + "/model.safetensors", index = dir + "/model.safetensors.index.json";
  if (exists(index)) {
    std::ifstream in(index, std::ios::binary);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const json j = parse_json_strict(text.data(), text.data() + text.size(), index);
    if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
      throw FormatError(index + ": no weight_map object");
    std::set<std::string> shards;
    for (auto& [name, file] : j["weight_map"].items()) {
      if (!file.is_string()) throw FormatError(index + ": the file of tensor '" + name + "' is not a string");
      const std::string shard = file.get<std::string>();
      if (shard.empty() || shard.find('/') != std::string::npos)
        throw FormatError(index + ": tensor '" + name + "' is in '" + shard + "', not a file beside the index");
      shards.insert(shard);
    }
    for (const std::string& s : shards) read_safetensors_file(dir + "/" + s, ws);
    for (auto& [name, file] : j["weight_map"].items())
      if (!ws.tensors.count(name)) throw FormatError(index + ": tensor '" + name + "' is not in " + file.get<std::string>());
  } else if (exists(single)) {
    read_safetensors_file(single, ws);
  } else {
    throw FormatError(dir + ": no model.safetensors or model.safetensors.index.json");
  }
  return ws;
}

}  // namespace ferrum
