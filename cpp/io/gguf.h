// GGUF v2 / v3 reader: metadata key/values and tensor infos over a memory map.
//
// GgufFile::open refuses a file (FormatError naming it and the first rule it breaks) unless:
// the magic and version are right; the counts fit in the file; no metadata key and no tensor
// name appears twice; every value has a known type (arrays not nested); general.alignment is a
// power of two; every tensor has 1..4 positive dimensions, a type ferrum reads and whole blocks
// per row; and the tensors' data tile the data section as llama.cpp writes it: in the order of
// their infos, each at an aligned offset where the previous one's (padded) data ends, the last
// ending at the end of the file (short of the padding). That last rule is what catches a type
// or shape that does not match the data (a gap or an overlap follows) and an offset that wraps.
#pragma once
#include <map>
#include <optional>
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

  const char* kind_name() const;  // "an integer", "a string", ... for messages
};

struct GgufFile {
  uint32_t version = 0;
  std::map<std::string, GgufValue> metadata;
  WeightSource weights;

  static GgufFile open(const std::string& path);
  const GgufValue* get(const std::string& key) const;
  // Typed reads: nullopt when the key is absent, FormatError naming the file and the key when it
  // holds another type (no conversion between strings, booleans and numbers; an integer key
  // takes any integer width, a real key an integer or a float).
  std::optional<int64_t> integer(const std::string& key) const;
  std::optional<double> real(const std::string& key) const;
  std::optional<bool> boolean(const std::string& key) const;
  std::optional<std::string> string(const std::string& key) const;
};

// ggml type id -> DType (FormatError for types ferrum does not read).
DType dtype_from_ggml(uint32_t type, const std::string& path, const std::string& tensor);

}  // namespace ferrum
