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

// What an asymmetric 8-bit matrix adds to its stored values s (q - 128) to give s (q - z): per
// output n and group g, offsets[n * groups + g] = s (128 - z) times the sum of the inputs in g;
// block b of the stored columns (32 of them) is in group block_groups[b].
struct GroupOffsets {
  int64_t groups = 0;
  std::vector<float> offsets;         // [N, groups]
  std::vector<int32_t> block_groups;  // [K / 32]
};

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
  // An asymmetric 8-bit matrix's offsets (rows as the tensor's); null: none.
  std::shared_ptr<const GroupOffsets> group_offsets;
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
