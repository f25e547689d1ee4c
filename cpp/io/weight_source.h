// What every weight file format presents: named tensors (dtype, shape, bytes in a mapped
// file) plus format metadata. Shapes are row-major ([out, in] for a linear weight).
#pragma once
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "io/mapped_file.h"

namespace ferrum {

struct TensorInfo {
  std::string name;
  DType dtype;
  Shape shape;
  const char* data;  // into file
  size_t nbytes;
  std::shared_ptr<MappedFile> file;
  // A matrix whose columns hold its inputs in this order (column j: input input_order[j]), as a
  // GPTQ act-order checkpoint groups them; null: in order.
  std::shared_ptr<const std::vector<int32_t>> input_order;
};

struct WeightSource {
  std::string path;                          // file or directory, for messages
  std::map<std::string, TensorInfo> tensors;
  const TensorInfo* find(const std::string& name) const {
    auto it = tensors.find(name);
    return it == tensors.end() ? nullptr : &it->second;
  }
  uint64_t file_bytes() const;  // the sizes of the files the tensors live in, added up
};

// Bytes a tensor of this dtype and shape takes in a file. FormatError (prefixed with `where`)
// when a dimension is negative, the element count overflows, or a row is not whole blocks.
size_t tensor_file_bytes(DType dtype, const Shape& shape, const std::string& where);

}  // namespace ferrum
