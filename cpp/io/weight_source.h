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
};

struct WeightSource {
  std::string path;                          // file or directory, for messages
  std::map<std::string, TensorInfo> tensors;
  const TensorInfo* find(const std::string& name) const {
    auto it = tensors.find(name);
    return it == tensors.end() ? nullptr : &it->second;
  }
};

}  // namespace ferrum
