// Hugging Face safetensors: one model.safetensors or shards listed in
// model.safetensors.index.json. F32 / F16 / BF16 tensors (I32 / I8 read too).
#pragma once
#include <string>

#include "io/weight_source.h"

namespace ferrum {

// dir holds model.safetensors or model.safetensors.index.json.
WeightSource open_safetensors_dir(const std::string& dir);
// Adds one file's tensors to ws (FormatError naming the file on any inconsistency).
void read_safetensors_file(const std::string& path, WeightSource& ws);

}  // namespace ferrum
