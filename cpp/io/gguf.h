// GGUF v2 / v3 reader: metadata key/values and tensor infos over a memory map.
#pragma once
#include <map>
#include <string>
#include <vector>

#include "io/weight_source.h"

namespace ferrum {

struct GgufValue {
  enum class Kind { Int, UInt, Float, Bool, String, Array } kind = Kind::Int;
  int64_t i = 0;
  uint64_t u = 0;
  double f = 0.0;
  bool b = false;
  std::string s;
  std::vector<GgufValue> array;

  bool is_number() const { return kind == Kind::Int || kind == Kind::UInt || kind == Kind::Float || kind == Kind::Bool; }
  double number() const;
  int64_t integer() const;
};

struct GgufFile {
  uint32_t version = 0;
  std::map<std::string, GgufValue> metadata;
  WeightSource weights;

  static GgufFile open(const std::string& path);  // FormatError with the file name on any problem
  const GgufValue* get(const std::string& key) const;
  int64_t get_int(const std::string& key, int64_t fallback) const;
  double get_float(const std::string& key, double fallback) const;
  std::string get_string(const std::string& key, const std::string& fallback = "") const;
};

// ggml type id -> DType (FormatError for types ferrum does not read).
DType dtype_from_ggml(uint32_t type, const std::string& path, const std::string& tensor);

}  // namespace ferrum
