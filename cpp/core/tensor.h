// A tensor is a typed, contiguous, row-major view into a backend allocation (Storage).
// Views share the storage; slicing is along the first dimension only, which is all the
// decoder needs and keeps every kernel stride-free.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace ferrum {

class Backend;
using Shape = std::vector<int64_t>;

// One allocation on a backend. Backends derive from it to hold their handle.
struct Storage {
  explicit Storage(Backend* b, size_t n) : backend(b), bytes(n) {}
  virtual ~Storage() = default;
  Backend* backend;
  size_t bytes;
};

struct Tensor {
  std::shared_ptr<Storage> storage;
  size_t offset = 0;  // bytes from the start of storage
  DType dtype = DType::F32;
  Shape shape;

  bool defined() const { return storage != nullptr; }
  int64_t numel() const;
  int64_t dim(int i) const { return shape.at(i < 0 ? shape.size() + i : i); }
  int64_t cols() const { return shape.empty() ? 1 : shape.back(); }
  int64_t rows() const { return cols() == 0 ? 0 : numel() / cols(); }
  size_t nbytes() const { return dtype_bytes(dtype, numel()); }
  size_t row_bytes() const { return dtype_bytes(dtype, cols()); }

  Tensor slice(int64_t begin, int64_t count) const;  // rows [begin, begin+count) of dim 0
  Tensor reshape(Shape s) const;                      // same element count
  std::string str() const;                            // "f32[4, 64]" for messages
};

std::string shape_str(const Shape& s);

}  // namespace ferrum
