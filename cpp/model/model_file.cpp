#include "model/model_file.h"

#include <sys/stat.h>

#include <cstdio>
#include <cstring>

#include "core/error.h"
#include "io/gptq.h"
#include "io/llama2c.h"
#include "io/safetensors.h"
#include "model/weight_names.h"

namespace ferrum {

namespace {
bool is_dir(const std::string& p) {
  struct stat st;
  return stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool has_gguf_magic(const std::string& p) {
  FILE* f = std::fopen(p.c_str(), "rb");
  if (!f) throw FormatError(p + ": cannot open");
  char m[4] = {0};
  size_t n = std::fread(m, 1, 4, f);
  std::fclose(f);
  return n == 4 && std::memcmp(m, "GGUF", 4) == 0;
}
}  // namespace

ModelFile open_model_file(const std::string& path) {
  ModelFile m;
  m.path = path;
  if (is_dir(path)) {
    m.format = "safetensors";
    m.config = config_from_hf(path);
    m.weights = open_safetensors_dir(path);
    translate_quantized_weights(path, m.weights);
  } else if (has_gguf_magic(path)) {
    m.format = "gguf";
    GgufFile g = GgufFile::open(path);
    m.config = config_from_gguf(g);
    for (auto& [key, value] : g.metadata)
      if (key.rfind("tokenizer.", 0) == 0) m.tokenizer_metadata[key] = std::move(value);
    m.weights = std::move(g.weights);
  } else {
    m.format = "llama2c";
    Llama2cHeader h;
    m.weights = open_llama2c(path, &h);
    m.config = config_from_llama2c(h, path);
  }
  check_weights(m.weights, m.config);
  return m;
}

}  // namespace ferrum
