// A model file opened and checked, before any weight is loaded: its format, config and tensor
// table (over a memory map), and for GGUF the tokenizer's metadata. Parsed once: the tokenizer
// is built from `tokenizer_metadata`, which is then dropped, and the weights load from the same
// open file.
#pragma once
#include <map>
#include <string>

#include "io/gguf.h"
#include "io/weight_source.h"
#include "model/config.h"

namespace ferrum {

struct ModelFile {
  std::string path;
  std::string format;  // "gguf", "safetensors" (a directory) or "llama2c"
  ModelConfig config;
  WeightSource weights;
  std::map<std::string, GgufValue> tokenizer_metadata;  // GGUF's tokenizer.* keys
};

// path: a directory (HF config.json + safetensors), a GGUF file or a llama2.c checkpoint.
// FormatError naming the file and the first rule it breaks (io/gguf.h, io/safetensors.h,
// io/llama2c.h, ModelConfig::validate, check_weights).
ModelFile open_model_file(const std::string& path);

}  // namespace ferrum
