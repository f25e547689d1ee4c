#include "core/tensor.h"

#include "core/error.h"

namespace ferrum {

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

Tensor Tensor::slice(int64_t begin, int64_t count) const {
  FERRUM_CHECK(!shape.empty() && begin >= 0 && count >= 0 && begin + count <= shape[0],
               "slice [" + std::to_string(begin) + ", " + std::to_string(begin + count) +
                   ") out of range for " + str());
  Tensor t = *this;
  t.shape[0] = count;
  int64_t inner = shape[0] == 0 ? 0 : numel() / shape[0];
  t.offset += dtype_bytes(dtype, begin * inner);
  return t;
}

Tensor Tensor::reshape(Shape s) const {
  Tensor t = *this;
  t.shape = std::move(s);
  FERRUM_CHECK(t.numel() == numel(), "cannot reshape " + str() + " to " + shape_str(t.shape));
  return t;
}

std::string shape_str(const Shape& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

std::string Tensor::str() const { return std::string(dtype_name(dtype)) + shape_str(shape); }

}  // namespace ferrum
