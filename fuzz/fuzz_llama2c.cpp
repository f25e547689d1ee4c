// Input: a whole llama2.c checkpoint (any bytes that do not start with the GGUF magic).
#include <cstring>

#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size >= 4 && std::memcmp(data, "GGUF", 4) == 0) return -1;  // the GGUF target's inputs
  static const std::string path = ferrum::fuzz::scratch_path("model.bin");
  ferrum::fuzz::write_file(path, data, size);
  ferrum::fuzz::open_and_check(path);
  return 0;
}
