#include "io/safetensors.h"

#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "core/error.h"

namespace ferrum {

using json = nlohmann::json;

namespace {
DType dtype_from_safetensors(const std::string& s, const std::string& path, const std::string& name) {
  if (s == "F32") return DType::F32;
  if (s == "F16") return DType::F16;
  if (s == "BF16") return DType::BF16;
  if (s == "I32") return DType::I32;
  if (s == "I8") return DType::I8;
  throw FormatError(path + ": tensor '" + name + "' has dtype " + s + ", which ferrum does not read");
}

bool exists(const std::string& p) { return std::ifstream(p).good(); }
}  // namespace

void read_safetensors_file(const std::string& path, WeightSource& ws) {
  auto file = MappedFile::open(path);
  if (file->size() < 8) throw FormatError(path + ": too short for a safetensors file");
  uint64_t header_len;
  std::memcpy(&header_len, file->data(), 8);
  if (header_len > file->size() - 8)
    throw FormatError(path + ": safetensors header length " + std::to_string(header_len) +
                      " runs past the end of the file");
  json header;
  try {
    header = json::parse(file->data() + 8, file->data() + 8 + header_len);
  } catch (const json::exception& e) {
    throw FormatError(path + ": safetensors header is not valid JSON (" + e.what() + ")");
  }
  if (!header.is_object()) throw FormatError(path + ": safetensors header is not a JSON object");
  const size_t data_start = 8 + header_len, data_len = file->size() - data_start;
  for (auto& [name, entry] : header.items()) {
    if (name == "__metadata__") continue;
    try {
      TensorInfo info;
      info.name = name;
      info.dtype = dtype_from_safetensors(entry.at("dtype").get<std::string>(), path, name);
      for (auto& d : entry.at("shape")) {
        int64_t v = d.get<int64_t>();
        if (v < 0) throw FormatError(path + ": tensor '" + name + "' has a negative dimension");
        info.shape.push_back(v);
      }
      if (info.shape.empty()) info.shape.push_back(1);
      auto offs = entry.at("data_offsets");
      uint64_t b = offs.at(0).get<uint64_t>(), e = offs.at(1).get<uint64_t>();
      Tensor probe;
      probe.dtype = info.dtype;
      probe.shape = info.shape;
      info.nbytes = probe.nbytes();
      if (b > e || e > data_len)
        throw FormatError(path + ": tensor '" + name + "' data_offsets [" + std::to_string(b) + ", " +
                          std::to_string(e) + ") lie outside the " + std::to_string(data_len) +
                          "-byte data section");
      if (e - b != info.nbytes)
        throw FormatError(path + ": tensor '" + name + "' has " + std::to_string(e - b) +
                          " bytes but its shape and dtype need " + std::to_string(info.nbytes));
      info.data = file->data() + data_start + b;
      info.file = file;
      if (ws.tensors.count(name)) throw FormatError(path + ": tensor '" + name + "' appears twice");
      ws.tensors[name] = std::move(info);
    } catch (const json::exception& e) {
      throw FormatError(path + ": malformed entry for tensor '" + name + "' (" + e.what() + ")");
    }
  }
}

WeightSource open_safetensors_dir(const std::string& dir) {
  WeightSource ws;
  ws.path = dir;
  const std::string single = dir + "/model.safetensors", index = dir + "/model.safetensors.index.json";
  if (exists(index)) {
    json j;
    try {
      std::ifstream in(index);
      j = json::parse(in);
    } catch (const json::exception& e) {
      throw FormatError(index + ": not valid JSON (" + e.what() + ")");
    }
    if (!j.contains("weight_map") || !j["weight_map"].is_object())
      throw FormatError(index + ": no weight_map");
    std::set<std::string> shards;
    for (auto& [name, file] : j["weight_map"].items()) shards.insert(file.get<std::string>());
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
