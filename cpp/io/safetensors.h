// Hugging Face safetensors: one model.safetensors or shards listed in
// model.safetensors.index.json. F32 / F16 / BF16 tensors (I32 / I8 read too).
//
// A file is refused (FormatError naming it and the first rule it breaks) unless: its 8-byte
// header length fits in the file; the header is a JSON object without repeated keys; every entry
// has a known dtype, a shape of non-negative integers and two data offsets whose span is exactly
// what the shape and dtype need; and the tensors tile the data section (sorted by offset, each
// starting where the previous one ends, the last ending at the end of the file: no gap, no
// overlap, as the format's own library requires). An index's shards must exist and hold every
// tensor it lists; a tensor may appear in one shard only.
#pragma once
#include <string>

#include "io/weight_source.h"

namespace ferrum {

// dir holds model.safetensors or model.safetensors.index.json.
WeightSource open_safetensors_dir(const std::string& dir);
// Adds one file's tensors to ws.
void read_safetensors_file(const std::string& path, WeightSource& ws);

}  // namespace ferrum
