#include "io/gguf.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "core/error.h"
#include "io/utf8.h"

namespace ferrum {

namespace {

// Bounds-checked cursor over the header: every read names the file when it runs past EOF.
class Reader {
 public:
  Reader(const MappedFile& f) : f_(f) {}
  template <typename T>
  T get() {
    need(sizeof(T), "a value");
    T v;
    std::memcpy(&v, f_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  std::string str() {
    uint64_t n = get<uint64_t>();
    need(n, "a string of " + std::to_string(n) + " bytes");
    std::string s(f_.data() + pos_, n);
    pos_ += n;
    return s;
  }
  void need(uint64_t n, const std::string& what) const {
    if (n > f_.size() - pos_)
      throw FormatError(f_.path() + ": truncated GGUF header (" + what + " at byte " +
                        std::to_string(pos_) + " runs past the end of the " +
                        std::to_string(f_.size()) + "-byte file)");
  }
  size_t pos() const { return pos_; }
  uint64_t left() const { return f_.size() - pos_; }

 private:
  const MappedFile& f_;
  size_t pos_ = 0;
};

enum : uint32_t { U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 };

// The fewest bytes a value of this type takes (a string is at least its 8-byte length).
uint64_t min_value_bytes(uint32_t type) {
  static const uint8_t kBytes[] = {1, 1, 2, 2, 4, 4, 4, 1, 8, 12, 8, 8, 8};
  return type <= F64 ? kBytes[type] : 1;
}

// `where` names the value in errors; an array's items add their index to it.
GgufValue read_value(Reader& r, uint32_t type, const std::string& where, int depth = 0, int64_t index = -1) {
  auto name = [&] { return index < 0 ? where : where + "[" + std::to_string(index) + "]"; };
  GgufValue v;
  switch (type) {
    case U8: v.kind = GgufValue::Kind::UInt; v.u = r.get<uint8_t>(); break;
    case I8: v.kind = GgufValue::Kind::Int; v.i = r.get<int8_t>(); break;
    case U16: v.kind = GgufValue::Kind::UInt; v.u = r.get<uint16_t>(); break;
    case I16: v.kind = GgufValue::Kind::Int; v.i = r.get<int16_t>(); break;
    case U32: v.kind = GgufValue::Kind::UInt; v.u = r.get<uint32_t>(); break;
    case I32: v.kind = GgufValue::Kind::Int; v.i = r.get<int32_t>(); break;
    case U64: v.kind = GgufValue::Kind::UInt; v.u = r.get<uint64_t>(); break;
    case I64: v.kind = GgufValue::Kind::Int; v.i = r.get<int64_t>(); break;
    case F32: v.kind = GgufValue::Kind::Float; v.f = r.get<float>(); break;
    case F64: v.kind = GgufValue::Kind::Float; v.f = r.get<double>(); break;
    case BOOL: {
      uint8_t b = r.get<uint8_t>();
      if (b > 1) throw FormatError(name() + " is a boolean of value " + std::to_string(b) + " (0 or 1)");
      v.kind = GgufValue::Kind::Bool;
      v.b = b != 0;
      break;
    }
    case STRING: {
      v.kind = GgufValue::Kind::String;
      v.s = r.str();
      // GGUF strings are UTF-8; a damaged one is refused rather than read with replacements.
      const size_t bad = invalid_utf8_at(v.s);
      if (bad != std::string::npos)
        throw FormatError(name() + " is not valid UTF-8 (byte " + std::to_string(bad) + " of " +
                          std::to_string(v.s.size()) + ")");
      break;
    }
    case ARRAY: {
      if (depth > 0) throw FormatError(where + " is a nested array, which ferrum does not read");
      v.kind = GgufValue::Kind::Array;
      uint32_t item = r.get<uint32_t>();
      uint64_t n = r.get<uint64_t>();
      if (n > r.left() / min_value_bytes(item)) r.need(UINT64_MAX, "an array of " + std::to_string(n) + " items");
      v.array.reserve(n);
      for (uint64_t i = 0; i < n; ++i)
        v.array.push_back(read_value(r, item, where, depth + 1, int64_t(i)));
      break;
    }
    default:
      throw FormatError(name() + " has an unknown GGUF value type " + std::to_string(type));
  }
  return v;
}

}  // namespace

const char* GgufValue::kind_name() const {
  switch (kind) {
    case Kind::Int:
    case Kind::UInt: return "an integer";
    case Kind::Float: return "a float";
    case Kind::Bool: return "a boolean";
    case Kind::String: return "a string";
    case Kind::Array: return "an array";
  }
  return "a value";
}

namespace {
// The name of a ggml type ferrum does not read, for the error (the number where unknown).
std::string ggml_type_name(uint32_t type) {
  static const std::pair<uint32_t, const char*> kNames[] = {
      {16, "IQ2_XXS"}, {17, "IQ2_XS"}, {18, "IQ3_XXS"}, {19, "IQ1_S"}, {21, "IQ3_S"}, {22, "IQ2_S"},
      {25, "I16"},     {27, "I64"},    {28, "F64"},     {29, "IQ1_M"}, {34, "TQ1_0"}, {35, "TQ2_0"},
      {39, "MXFP4"}};
  for (const auto& [id, name] : kNames)
    if (id == type) return std::string(name) + " (" + std::to_string(type) + ")";
  return std::to_string(type);
}
}  // namespace

DType dtype_from_ggml(uint32_t type, const std::string& path, const std::string& tensor) {
  switch (type) {
    case 0: return DType::F32;
    case 1: return DType::F16;
    case 2: return DType::Q4_0;
    case 3: return DType::Q4_1;
    case 6: return DType::Q5_0;
    case 7: return DType::Q5_1;
    case 8: return DType::Q8_0;
    case 9: return DType::Q8_1;
    case 10: return DType::Q2_K;
    case 11: return DType::Q3_K;
    case 12: return DType::Q4_K;
    case 13: return DType::Q5_K;
    case 14: return DType::Q6_K;
    case 15: return DType::Q8_K;
    case 20: return DType::IQ4_NL;
    case 23: return DType::IQ4_XS;
    case 24: return DType::I8;
    case 26: return DType::I32;
    case 30: return DType::BF16;
    default:
      throw FormatError(path + ": tensor '" + tensor + "' has ggml type " + ggml_type_name(type) +
                        ", which ferrum does not read (it reads F32, F16, BF16, Q4_0, Q4_1, Q5_0, "
                        "Q5_1, Q8_0, Q2_K .. Q6_K, IQ4_NL and IQ4_XS)");
  }
}

GgufFile GgufFile::open(const std::string& path) {
  auto file = MappedFile::open(path);
  Reader r(*file);
  GgufFile g;
  g.weights.path = path;
  r.need(4, "the magic");
  if (std::memcmp(file->data(), "GGUF", 4) != 0) throw FormatError(path + ": not a GGUF file (bad magic)");
  r.get<uint32_t>();
  g.version = r.get<uint32_t>();
  if (g.version != 2 && g.version != 3)
    throw FormatError(path + ": GGUF version " + std::to_string(g.version) + " is not supported (2 or 3)");
  uint64_t n_tensors = r.get<uint64_t>();
  uint64_t n_kv = r.get<uint64_t>();
  // Each key/value takes >= 13 bytes and each tensor info >= 32: reject counts the file can't hold.
  if (n_kv > file->size() / 13 || n_tensors > file->size() / 32)
    throw FormatError(path + ": GGUF header claims " + std::to_string(n_tensors) + " tensors and " +
                      std::to_string(n_kv) + " metadata entries, more than the file can hold");
  for (uint64_t i = 0; i < n_kv; ++i) {
    std::string key = r.str();
    if (invalid_utf8_at(key) != std::string::npos)
      throw FormatError(path + ": metadata key " + std::to_string(i) + " is not valid UTF-8");
    uint32_t type = r.get<uint32_t>();
    if (g.metadata.count(key)) throw FormatError(path + ": metadata key '" + key + "' appears twice");
    g.metadata[key] = read_value(r, type, path + ": metadata '" + key + "'");
  }
  struct Raw { std::string name; uint32_t type; Shape shape; uint64_t offset; };
  std::vector<Raw> raws;
  for (uint64_t i = 0; i < n_tensors; ++i) {
    Raw t;
    t.name = r.str();
    if (invalid_utf8_at(t.name) != std::string::npos)
      throw FormatError(path + ": the name of tensor " + std::to_string(i) + " is not valid UTF-8");
    const std::string what = path + ": tensor '" + t.name + "'";
    uint32_t nd = r.get<uint32_t>();
    if (nd == 0 || nd > 4) throw FormatError(what + " has " + std::to_string(nd) + " dimensions (1 to 4)");
    Shape ggml_dims(nd);
    for (uint32_t d = 0; d < nd; ++d) {
      uint64_t v = r.get<uint64_t>();
      if (v == 0 || v > (uint64_t(1) << 40)) throw FormatError(what + " has a bad dimension " + std::to_string(v));
      ggml_dims[d] = int64_t(v);
    }
    t.shape.assign(ggml_dims.rbegin(), ggml_dims.rend());  // ggml lists the innermost dim first
    t.type = r.get<uint32_t>();
    t.offset = r.get<uint64_t>();
    if (g.weights.tensors.count(t.name)) throw FormatError(what + " appears twice");
    g.weights.tensors[t.name].name = t.name;  // a placeholder until the data checks below
    raws.push_back(std::move(t));
  }
  uint64_t align = 32;
  if (std::optional<int64_t> a = g.integer("general.alignment")) {
    if (*a <= 0 || *a > (1 << 30) || (*a & (*a - 1)))
      throw FormatError(path + ": general.alignment " + std::to_string(*a) + " is not a power of two");
    align = uint64_t(*a);
  }
  auto padded = [align](uint64_t n) { return (n + align - 1) / align * align; };
  const uint64_t data_start = padded(r.pos());
  const uint64_t data_bytes = file->size() > data_start ? file->size() - data_start : 0;
  // llama.cpp's layout: tensor data in info order, each where the previous one's padded data ends.
  uint64_t expected = 0, end = 0;
  const std::string* previous = nullptr;
  for (Raw& t : raws) {
    const std::string what = path + ": tensor '" + t.name + "'";
    TensorInfo& info = g.weights.tensors[t.name];
    info.dtype = dtype_from_ggml(t.type, path, t.name);
    info.shape = t.shape;
    info.nbytes = tensor_file_bytes(info.dtype, t.shape, what);
    if (t.offset % align != 0)
      throw FormatError(what + " has data offset " + std::to_string(t.offset) + ", not a multiple of the alignment " +
                        std::to_string(align));
    if (t.offset < expected)
      throw FormatError(what + " data at offset " + std::to_string(t.offset) + " overlaps tensor '" + *previous +
                        "', whose data ends at " + std::to_string(expected));
    if (t.offset > expected)
      throw FormatError(path + ": " + std::to_string(t.offset - expected) + " bytes of the data section before tensor '" +
                        t.name + "' belong to no tensor" +
                        (previous ? " (the type or shape of '" + *previous + "' does not match its data)" : ""));
    if (info.nbytes > data_bytes || t.offset > data_bytes - info.nbytes)
      throw FormatError(what + " data (" + std::to_string(info.nbytes) + " bytes at offset " +
                        std::to_string(data_start + t.offset) + ") runs past the end of the file (" +
                        std::to_string(file->size()) + " bytes)");
    info.data = file->data() + data_start + t.offset;
    info.file = file;
    end = t.offset + info.nbytes;
    expected = padded(end);
    previous = &t.name;
    // Writers pad with zeros: other bytes there are data that the tensor's type or shape lost.
    const char* pad = file->data() + data_start + end;
    for (uint64_t i = 0; i < std::min(expected, data_bytes) - end; ++i)
      if (pad[i] != 0)
        throw FormatError(what + " is followed by nonzero padding (its type or shape does not match its data)");
  }
  // The last tensor's data ends the file, but for its padding.
  if (previous && data_bytes - end >= align)
    throw FormatError(path + ": " + std::to_string(data_bytes - end) + " bytes after the data of tensor '" +
                      raws.back().name + "' belong to no tensor (its type or shape does not match its data)");
  return g;
}

const GgufValue* GgufFile::get(const std::string& key) const {
  auto it = metadata.find(key);
  return it == metadata.end() ? nullptr : &it->second;
}

namespace {
[[noreturn]] void wrong_type(const GgufFile& g, const std::string& key, const GgufValue& v, const char* expected) {
  throw FormatError(g.weights.path + ": metadata '" + key + "' is " + v.kind_name() + ", expected " + expected);
}
}  // namespace

std::optional<int64_t> GgufFile::integer(const std::string& key) const {
  const GgufValue* v = get(key);
  if (!v) return std::nullopt;
  if (v->kind == GgufValue::Kind::Int) return v->i;
  if (v->kind != GgufValue::Kind::UInt) wrong_type(*this, key, *v, "an integer");
  if (v->u > uint64_t(INT64_MAX))
    throw FormatError(weights.path + ": metadata '" + key + "' is out of range (" + std::to_string(v->u) + ")");
  return int64_t(v->u);
}

std::optional<double> GgufFile::real(const std::string& key) const {
  const GgufValue* v = get(key);
  if (!v) return std::nullopt;
  if (v->kind == GgufValue::Kind::Float) return v->f;
  if (v->kind == GgufValue::Kind::Int) return double(v->i);
  if (v->kind == GgufValue::Kind::UInt) return double(v->u);
  wrong_type(*this, key, *v, "a number");
}

std::optional<bool> GgufFile::boolean(const std::string& key) const {
  const GgufValue* v = get(key);
  if (!v) return std::nullopt;
  if (v->kind != GgufValue::Kind::Bool) wrong_type(*this, key, *v, "a boolean");
  return v->b;
}

std::optional<std::string> GgufFile::string(const std::string& key) const {
  const GgufValue* v = get(key);
  if (!v) return std::nullopt;
  if (v->kind != GgufValue::Kind::String) wrong_type(*this, key, *v, "a string");
  return v->s;
}

}  // namespace ferrum
