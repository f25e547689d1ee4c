#include "io/gguf.h"

#include <cstring>
#include <string>
#include <utility>

#include "core/error.h"

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

 private:
  const MappedFile& f_;
  size_t pos_ = 0;
};

enum : uint32_t { U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 };

GgufValue read_value(Reader& r, uint32_t type, const std::string& path, int depth = 0) {
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
    case BOOL: v.kind = GgufValue::Kind::Bool; v.b = r.get<uint8_t>() != 0; break;
    case STRING: v.kind = GgufValue::Kind::String; v.s = r.str(); break;
    case ARRAY: {
      if (depth > 0) throw FormatError(path + ": nested GGUF arrays are not supported");
      v.kind = GgufValue::Kind::Array;
      uint32_t item = r.get<uint32_t>();
      uint64_t n = r.get<uint64_t>();
      r.need(n, "an array of " + std::to_string(n) + " items");  // each item is >= 1 byte
      v.array.reserve(n);
      for (uint64_t i = 0; i < n; ++i) v.array.push_back(read_value(r, item, path, depth + 1));
      break;
    }
    default:
      throw FormatError(path + ": unknown GGUF metadata type " + std::to_string(type));
  }
  return v;
}

}  // namespace

double GgufValue::number() const {
  switch (kind) {
    case Kind::Int: return double(i);
    case Kind::UInt: return double(u);
    case Kind::Float: return f;
    case Kind::Bool: return b ? 1.0 : 0.0;
    default: throw ValueError("GGUF value is not a number");
  }
}

int64_t GgufValue::integer() const {
  if (kind == Kind::UInt) return int64_t(u);
  if (kind == Kind::Int) return i;
  if (kind == Kind::Bool) return b;
  throw ValueError("GGUF value is not an integer");
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
  // Each key/value takes >= 12 bytes and each tensor info >= 24: reject counts the file can't hold.
  if (n_kv > file->size() / 12 || n_tensors > file->size() / 24)
    throw FormatError(path + ": GGUF header claims " + std::to_string(n_tensors) + " tensors and " +
                      std::to_string(n_kv) + " metadata entries, more than the file can hold");
  for (uint64_t i = 0; i < n_kv; ++i) {
    std::string key = r.str();
    uint32_t type = r.get<uint32_t>();
    g.metadata[key] = read_value(r, type, path);
  }
  struct Raw { std::string name; uint32_t type; Shape shape; uint64_t offset; };
  std::vector<Raw> raws;
  for (uint64_t i = 0; i < n_tensors; ++i) {
    Raw t;
    t.name = r.str();
    uint32_t nd = r.get<uint32_t>();
    if (nd == 0 || nd > 4) throw FormatError(path + ": tensor '" + t.name + "' has " + std::to_string(nd) + " dimensions");
    Shape ggml_dims(nd);
    for (uint32_t d = 0; d < nd; ++d) {
      uint64_t v = r.get<uint64_t>();
      if (v == 0 || v > (uint64_t(1) << 40)) throw FormatError(path + ": tensor '" + t.name + "' has a bad dimension " + std::to_string(v));
      ggml_dims[d] = int64_t(v);
    }
    t.shape.assign(ggml_dims.rbegin(), ggml_dims.rend());  // ggml lists the innermost dim first
    t.type = r.get<uint32_t>();
    t.offset = r.get<uint64_t>();
    raws.push_back(std::move(t));
  }
  uint64_t align = uint64_t(g.get_int("general.alignment", 32));
  if (align == 0 || (align & (align - 1))) throw FormatError(path + ": bad general.alignment");
  uint64_t data_start = (r.pos() + align - 1) / align * align;
  for (Raw& t : raws) {
    TensorInfo info;
    info.name = t.name;
    info.dtype = dtype_from_ggml(t.type, path, t.name);
    info.shape = t.shape;
    Tensor probe;
    probe.dtype = info.dtype;
    probe.shape = t.shape;
    if (probe.cols() % dtype_info(info.dtype).block_elems != 0)
      throw FormatError(path + ": tensor '" + t.name + "' row length " + std::to_string(probe.cols()) +
                        " is not a multiple of its block size");
    info.nbytes = probe.nbytes();
    if (data_start + t.offset > file->size() || info.nbytes > file->size() - data_start - t.offset)
      throw FormatError(path + ": tensor '" + t.name + "' data (" + std::to_string(info.nbytes) +
                        " bytes at offset " + std::to_string(data_start + t.offset) +
                        ") runs past the end of the file (" + std::to_string(file->size()) + " bytes)");
    info.data = file->data() + data_start + t.offset;
    info.file = file;
    g.weights.tensors[t.name] = std::move(info);
  }
  return g;
}

const GgufValue* GgufFile::get(const std::string& key) const {
  auto it = metadata.find(key);
  return it == metadata.end() ? nullptr : &it->second;
}

int64_t GgufFile::get_int(const std::string& key, int64_t fallback) const {
  const GgufValue* v = get(key);
  return v && v->is_number() ? int64_t(v->number()) : fallback;
}

double GgufFile::get_float(const std::string& key, double fallback) const {
  const GgufValue* v = get(key);
  return v && v->is_number() ? v->number() : fallback;
}

std::string GgufFile::get_string(const std::string& key, const std::string& fallback) const {
  const GgufValue* v = get(key);
  return v && v->kind == GgufValue::Kind::String ? v->s : fallback;
}

}  // namespace ferrum
