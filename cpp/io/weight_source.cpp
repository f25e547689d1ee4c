#include "io/weight_source.h"

#include <set>

#include "core/error.h"

namespace ferrum {

uint64_t WeightSource::file_bytes() const {
  std::set<const MappedFile*> files;
  uint64_t total = 0;
  for (const auto& [name, t] : tensors)
    if (files.insert(t.file.get()).second) total += t.file->size();
  return total;
}

size_t tensor_file_bytes(DType dtype, const Shape& shape, const std::string& where) {
  // No file holds 2^48 elements; the bound keeps every later product (bytes, offsets) in range.
  constexpr int64_t kMaxElements = int64_t(1) << 48;
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) throw FormatError(where + " has a negative dimension in " + shape_str(shape));
    if (d > 0 && n > kMaxElements / d)
      throw FormatError(where + " has more elements than any file holds (shape " + shape_str(shape) + ")");
    n *= d;
  }
  const int64_t row = shape.empty() ? 1 : shape.back();
  if (row % dtype_info(dtype).block_elems != 0)
    throw FormatError(where + " has rows of " + std::to_string(row) + " elements, not a multiple of " +
                      dtype_name(dtype) + "'s block of " + std::to_string(dtype_info(dtype).block_elems));
  return dtype_bytes(dtype, n);
}

}  // namespace ferrum
